"""The model engine (backend/models/, plans/wan.py) against ComfyUI's own Wan: the same file, every layout, gloo.

Tiny Wan transformers are built by ComfyUI's own detection and classes (`detect_unet_config` on a header's
shapes -> supported_models WAN21_T2V / WAN22_T2V -> model_base.WAN21 / WAN22 around comfy/ldm/wan/model.py
`WanModel`), filled with seeded random weights and saved by ComfyUI's ModelSave node; ComfyUI's own loader
(`comfy.sd.load_diffusion_model_state_dict`, with the file's metadata, as the UNETLoader calls it) loads each
in this process and its `diffusion_model.forward` is the reference. The pack loads the same file with
`engine='comfy'` through the public API on CPU workers. No detection value is told to either side: Wan's
widths are all read from the shapes (heads as dim // 128) or from the file's metadata.

    COMFYUI_PATH=<ComfyUI checkout> PYTHONPATH=<stand-ins>:<pack parent> \\
        python -m pytest -q tests/comfy/test_engine_wan.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import test_engine
import torch
from comfy_server import COMFYUI_PATH
from safetensors.torch import save_file

from rocm_parallel.backend.api import ParallelModel

pytestmark = [pytest.mark.comfy, pytest.mark.timeout(3000)]

TOL = 1e-4  # float32 on gloo: ComfyUI's attention on CPU vs the pack's CPU flash kernel, over 315 tokens
LAYOUTS = {
    "tp 2": 2,
    "ring 2": 2,
    "ulysses 2": 2,
    "ring 2 x tp 2": 4,
    "batch 2 x tp 2": 4,
}  # layout -> workers
TEXT = 4096  # umt5's width: ComfyUI's WanModel default (its detection does not read it)
CLIP = 1280  # CLIP vision's width (ComfyUI's MLPProj for I2V), 257 tokens
# name -> width, FFN, blocks, latent channels in / out, seed, the file's metadata config (None: none).
# wan21-t2v: 2 heads of 128 (ComfyUI reads heads as dim // 128); wan21-i2v: CLIP image tokens in the
# cross-attention (k_img, v_img, norm_k_img: what the plan's `optional` names); wan22-ti2v: Wan 2.2 TI2V 5B's 48 channels
# (WAN22_T2V: per-frame timesteps); wan21-heads64: issue 51's file, 12 heads of 64 set by its metadata.
MODELS: dict[str, dict[str, Any]] = {
    "wan21-t2v": {"dim": 256, "ffn": 512, "blocks": 2, "in": 16, "out": 16, "seed": 5101},
    "wan21-i2v": {"dim": 256, "ffn": 512, "blocks": 2, "in": 36, "out": 16, "seed": 5104, "image": True},
    "wan22-ti2v": {"dim": 256, "ffn": 512, "blocks": 2, "in": 48, "out": 48, "seed": 5102},
    "wan21-heads64": {"dim": 768, "ffn": 256, "blocks": 1, "in": 16, "out": 16, "seed": 5103,
                      "metadata": {"transformer": {"num_heads": 12}}},
}  # fmt: skip
SUPPORTED = {
    "wan21-t2v": "WAN21_T2V",
    "wan21-i2v": "WAN21_I2V",
    "wan22-ti2v": "WAN22_T2V",
    "wan21-heads64": "WAN21_T2V",
}
FRAMES, HEIGHT, WIDTH = 9, 9, 13  # odd latent sizes: ComfyUI pads to 10 x 14, 9 x 5 x 7 = 315 tokens

# test_engine.py's fixtures (this ComfyUI imported in this process; worker groups of 2 and 4) and reference
comfy, groups, comfy_forward = test_engine.comfy, test_engine.groups, test_engine.comfy_forward


def header_like(spec: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The keys and shapes comfy/model_detection.py reads for a Wan (meta tensors: a header, abridged)."""
    t = lambda *shape: torch.empty(shape, device="meta")  # noqa: E731
    dim = spec["dim"]
    sd = {
        "head.modulation": t(1, 2, dim),
        "head.head.weight": t(4 * spec["out"], dim),
        "patch_embedding.weight": t(dim, spec["in"], 1, 2, 2),
        **{f"blocks.{i}.ffn.0.weight": t(spec["ffn"], dim) for i in range(spec["blocks"])},
    }
    if spec.get("image"):
        sd["img_emb.proj.0.bias"] = t(CLIP)
    return sd


def build_and_save(comfy: dict[str, Any], spec: dict[str, Any], path: Path) -> str:
    """ComfyUI's detection (with the metadata the file will carry), its supported model and WanModel, seeded
    random weights, ModelSave; the metadata config added to the saved file by ComfyUI's own writer. Returns
    ComfyUI's supported-model class name."""
    import comfy_models
    from test_comfy_wan import fill_random

    detection, utils = comfy["detection"], comfy["utils"]
    metadata = {"config": json.dumps(spec["metadata"])} if "metadata" in spec else None
    probe = header_like(spec)
    config = detection.model_config_from_unet_config(detection.detect_unet_config(probe, "", metadata), probe)
    config.set_inference_dtype(torch.float32, None)
    model = config.get_model({}, "")
    fill_random(model.diffusion_model, spec["seed"])
    cpu = torch.device("cpu")
    comfy_models.model_save(
        comfy, comfy["patcher"].ModelPatcher(model, load_device=cpu, offload_device=cpu), path
    )
    if metadata is not None:
        sd, saved = utils.load_torch_file(str(path), safe_load=True, return_metadata=True)
        utils.save_torch_file(sd, str(path), metadata={**(saved or {}), **metadata})
    return type(config).__name__


def load_in_comfy(
    comfy: dict[str, Any], path: str, loras: list[tuple[str, float]] = (), dtype: torch.dtype = torch.float32
) -> Any:
    """The UNETLoader's loader on `path` (its metadata included) in `dtype`, `loras` applied as
    LoraLoaderModelOnly applies them and patched in place; ComfyUI's diffusion model."""
    utils = comfy["utils"]
    sd, metadata = utils.load_torch_file(path, safe_load=True, return_metadata=True)
    patcher = comfy["sd"].load_diffusion_model_state_dict(
        sd, model_options={"dtype": dtype}, metadata=metadata
    )
    for lora, strength in loras:
        lora_sd = utils.load_torch_file(lora, safe_load=True)
        patcher = comfy["sd"].load_lora_for_models(patcher, None, lora_sd, strength, 0)[0]
    patcher.patch_model()
    return patcher.model.diffusion_model


@pytest.fixture(scope="module")
def files(comfy: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, Any]]:
    """name -> (a file ComfyUI's ModelSave wrote, ComfyUI's own diffusion model loaded from it)."""
    folder = tmp_path_factory.mktemp("engine-wan")
    out = {}
    for name, spec in MODELS.items():
        path = folder / f"{name}.safetensors"
        assert build_and_save(comfy, spec, path) == SUPPORTED[name]
        out[name] = (str(path), load_in_comfy(comfy, str(path)))
    return out


def call_inputs(name: str, seed: int = 0) -> dict[str, Any]:
    """A CFG-like call: two latent videos, each with its own prompt. Wan 2.2 TI2V gets one timestep per latent
    frame (WAN22.process_timestep with a start image's noise mask: the first frame at 0), the others one."""
    spec = MODELS[name]
    g = torch.Generator().manual_seed(seed)
    if name == "wan22-ti2v":
        timestep = torch.linspace(0.0, 900.0, FRAMES).repeat(2, 1)
        timestep[1] *= 0.5
    else:
        timestep = torch.tensor([700.0, 700.0])
    inputs = {
        "x": torch.randn(2, spec["in"], FRAMES, HEIGHT, WIDTH, generator=g),
        "timestep": timestep,
        "context": torch.randn(2, 7, TEXT, generator=g),
    }
    if spec.get("image"):
        inputs["clip_fea"] = torch.randn(2, 257, CLIP, generator=g)
    return inputs


def engine_forward(group: ParallelModel, path: str, layout: str, inputs: dict[str, Any], **load: Any) -> Any:
    group.load(path, layout=layout, dtype="float32", engine="comfy", comfyui=COMFYUI_PATH, **load)
    return group.forward(**inputs)


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=lambda s: s.replace(" ", ""))
@pytest.mark.parametrize("name", ["wan21-t2v", "wan21-i2v", "wan22-ti2v"])
def test_the_engine_equals_comfyuis_own_wan(files, groups, name, layout) -> None:
    """9 latent frames at 9 x 13 (padded by ComfyUI to 10 x 14): 315 tokens, uneven over 2 ranks (padded keys
    dropped); Wan 2.1 I2V with CLIP image tokens (36 channels in: the latent, mask and start image ComfyUI
    concatenates before the call); Wan 2.2 TI2V with one timestep per frame, whose modulation rows each rank cuts to its tokens."""
    path, reference = files[name]
    inputs = call_inputs(name)
    expected = comfy_forward(reference, inputs)
    out = engine_forward(groups[LAYOUTS[layout]], path, layout, inputs)
    assert out.shape == expected.shape
    diff = (out - expected).abs().max().item()
    print(f"{name} {layout} {tuple(inputs['x'].shape)}: max |diff| {diff:.2e}")
    assert diff <= TOL


@pytest.mark.parametrize("layout", ["tp 2", "ulysses 2"], ids=lambda s: s.replace(" ", ""))
def test_heads_set_by_the_files_metadata_equal_comfyuis(comfy, files, groups, layout) -> None:
    """Issue 51: a file whose metadata (`config.transformer`) sets 12 heads of 64 on a 768-wide model. ComfyUI
    0.33's detection reads it (0.3.75's reads no metadata for Wan: dim // 128, 6 heads of 128); the engine
    builds from ComfyUI's own detection, so its heads are the ones this ComfyUI reads. The file read with the
    other head count is another model: the parity tells them apart."""
    path, reference = files["wan21-heads64"]
    reads_metadata = tuple(int(p) for p in comfy["version"].split(".")[:2]) >= (0, 33)
    heads = 12 if reads_metadata else 6
    assert (reference.num_heads, reference.dim // reference.num_heads) == (heads, 768 // heads)
    inputs = call_inputs("wan21-heads64")
    expected = comfy_forward(reference, inputs)
    group = groups[LAYOUTS[layout]]
    diff = (engine_forward(group, path, layout, inputs) - expected).abs().max().item()
    other = 18 - heads  # 6 heads of 128 where ComfyUI reads 12 of 64, and the reverse
    wrong = engine_forward(group, path, layout, inputs, detection={"num_heads": other}) - expected
    print(
        f"{heads} heads, {layout}: max |diff| {diff:.2e}; read as {other} heads: {wrong.abs().max().item():.2e}"
    )
    assert wrong.abs().max().item() > 1e-2
    assert diff <= TOL


@pytest.mark.parametrize("layout", ["tp 2", "ulysses 2"], ids=lambda s: s.replace(" ", ""))
def test_the_default_engine_reads_the_head_count_of_the_files_metadata(comfy, files, groups, layout) -> None:
    """The same file on the default engine (the pack's diffusers Wan): its inspection reads the metadata's 12
    heads as ComfyUI 0.33's detection does (backend/wan/keys.py config_with_metadata), so the output equals
    ComfyUI's own; before, it read dim // 128 = 6 heads and came out 0.77 off with no error. Broken on
    purpose (config_with_metadata returning the config unchanged): this test failed reading 6 heads of 128."""
    from rocm_parallel.backend.checkpoint import inspect_checkpoint

    if tuple(int(p) for p in comfy["version"].split(".")[:2]) < (0, 33):
        pytest.skip("ComfyUI 0.3.75 reads no metadata for Wan (6 heads); the pack reads it as 0.33 does")
    path, reference = files["wan21-heads64"]
    info = inspect_checkpoint(path)
    assert (info.config["num_attention_heads"], info.config["attention_head_dim"]) == (12, 64)
    inputs = call_inputs("wan21-heads64")
    expected = comfy_forward(reference, inputs)
    group = groups[LAYOUTS[layout]]
    group.load(path, layout=layout, dtype="float32")
    diff = (group.forward(**inputs) - expected).abs().max().item()
    print(f"default engine, 12 heads of 64, {layout}: max |diff| {diff:.2e}")
    assert diff <= TOL


def write_loras(folder: Path, checkpoint: str) -> list[tuple[str, float]]:
    """A LoRA on every linear of the blocks (the pack's writer, ComfyUI's key names), and full differences
    (`.diff`, which ComfyUI applies to any weight) on the float32 patch embedding (whole on every rank) and on a
    self-attention q norm (an RMS norm over all heads: each rank holds its heads' slice)."""
    from safetensors import safe_open

    from rocm_parallel.backend.checkpoint import inspect_checkpoint
    from rocm_parallel.testing.writers import write_random_lora

    info = inspect_checkpoint(checkpoint)
    lora = write_random_lora(
        folder / "wan-lora.safetensors", info.config, "bfl", seed=7, family="wan", relative=0.5, rank=4
    )
    with safe_open(checkpoint, "pt") as f:
        keys = list(f.keys())
        shape = {k: f.get_slice(k).get_shape() for k in keys if k.endswith(("patch_embedding.weight", "0.self_attn.norm_q.weight"))}  # fmt: skip
    g = torch.Generator().manual_seed(8)
    embedding = next(v for k, v in shape.items() if k.endswith("patch_embedding.weight"))
    norm = next(v for k, v in shape.items() if k.endswith("norm_q.weight"))
    diffs = {
        "diffusion_model.patch_embedding.diff": 0.02 * torch.randn(*embedding, generator=g),
        "diffusion_model.blocks.0.self_attn.norm_q.diff": 0.2 * torch.randn(*norm, generator=g),
    }
    save_file(diffs, str(folder / "wan-diffs.safetensors"))
    return [(lora, 0.8), (str(folder / "wan-diffs.safetensors"), 1.0)]


@pytest.mark.parametrize("layout", ["tp 2", "ring 2 x tp 2"], ids=lambda s: s.replace(" ", ""))
def test_wan_loras_on_the_engine_equal_comfyuis_loras(comfy, files, groups, layout, tmp_path) -> None:
    """Each rank's slices patched by ComfyUI's own LoRA code equal ComfyUI's patched Wan; the LoRAs off again
    give the file's model back."""
    path, plain = files["wan21-t2v"]
    loras = write_loras(tmp_path, path)
    inputs = call_inputs("wan21-t2v")
    expected = comfy_forward(load_in_comfy(comfy, path, loras), inputs)
    group = groups[LAYOUTS[layout]]
    options = {"layout": layout, "dtype": "float32", "engine": "comfy", "comfyui": COMFYUI_PATH}
    reports = group.load(path, loras=loras, **options)
    assert reports[0].lora_tensors > 0
    diff = (group.forward(**inputs) - expected).abs().max().item()
    away = (expected - comfy_forward(plain, inputs)).abs().max().item()
    print(f"Wan LoRAs {layout}: max |diff| {diff:.2e} (the LoRAs move the output by {away:.2e})")
    assert away > 1e-2
    assert diff <= TOL
    group.load(path, loras=(), **options)
    assert (group.forward(**inputs) - comfy_forward(plain, inputs)).abs().max().item() <= TOL


def test_the_patch_embedding_stays_float32_in_a_bfloat16_load(comfy, files, groups, tmp_path) -> None:
    """ComfyUI builds Wan's Conv3d patch embedding in float32 whatever the model's dtype, runs it on x.float()
    and its loader keeps it float32: so does the engine (every other parameter of this file in bf16), a `.diff`
    on it patched in float32 too; the bf16 forward is ComfyUI's bf16 forward (bf16's rounding apart)."""
    path, _ = files["wan21-t2v"]
    loras = write_loras(tmp_path, path)
    reports = groups[2].load(
        path, layout="tp 2", dtype="bfloat16", engine="comfy", comfyui=COMFYUI_PATH, loras=loras
    )
    spec = MODELS["wan21-t2v"]
    embedding = spec["dim"] * spec["in"] * 4 + spec["dim"]  # Conv3d (1, 2, 2) weight and bias
    assert [r.parameter_bytes_by_dtype.get("float32") for r in reports] == [embedding * 4] * 2
    inputs = call_inputs("wan21-t2v")
    expected = comfy_forward(load_in_comfy(comfy, path, loras, torch.bfloat16), inputs).float()
    diff = (groups[2].forward(**inputs).float() - expected).abs().max().item()
    print(f"bf16 with LoRAs, tp 2: max |diff| {diff:.2e} (max |out| {expected.abs().max().item():.2f})")
    assert diff <= 2e-2 * expected.abs().max().item()  # bf16: 4.2e-2 of 4.57 on 0.33.0


@pytest.mark.parametrize("preset", ["wan2.1-t2v-14b", "wan2.1-i2v-14b", "wan2.2-ti2v-5b"])
def test_bytes_per_rank_at_the_released_wan_configs_are_not_above_the_diffusers_engines(
    comfy, preset
) -> None:
    """The issue's bar, as for FLUX (test_engine.py): bytes per GPU on the engine (ComfyUI's WanModel as its
    detection configures it from the released header's shapes, the plan applied under the fake process group,
    the patch embedding float32 as ComfyUI holds it) not above the planner's count of the diffusers engine's
    shards, at TP 1, 2 and 4, bf16 and fp8 weights, first and last rank."""
    from rocm_parallel.backend.config import ParallelLayout
    from rocm_parallel.backend.family import get_family
    from rocm_parallel.backend.plan import weight_bytes

    family = get_family("wan")
    config = family.presets[preset]
    spec = {
        "dim": config["num_attention_heads"] * config["attention_head_dim"], "ffn": config["ffn_dim"],
        "blocks": config["num_layers"], "in": config["in_channels"], "out": config["out_channels"],
        "image": config["image_dim"] is not None,
    }  # fmt: skip
    dims = family.dims(config)
    for tp in (1, 2, 4):
        for weights, size in (("compute", 2), ("fp8_e4m3fn", 1)):
            for rank in {0, tp - 1}:
                ours = test_engine.engine_bytes_of(comfy, header_like(spec), tp, rank, weights)
                today = weight_bytes(
                    dims, ParallelLayout(tp=tp), 2, rank, family=family.name, linear_bytes=size
                )
                print(
                    f"{preset} tp {tp} rank {rank} {weights}: engine {ours / 1e9:.3f} GB, diffusers {today / 1e9:.3f} GB"
                )
                assert ours <= today


@pytest.mark.parametrize("layout", ["tp 2", "ring 2"], ids=lambda s: s.replace(" ", ""))
def test_compiled_wan_blocks_on_the_engine_equal_comfyuis_own_wan(files, groups, layout) -> None:
    """compile='aot_eager' marks the plan's blocks (ComfyUI's WanAttentionBlock); under ring 2 the token split's
    hooks on them (this rank's RoPE rows and per-frame modulation) run around the compiled block."""
    path, reference = files["wan22-ti2v"]
    inputs = call_inputs("wan22-ti2v")
    group = groups[LAYOUTS[layout]]
    out = engine_forward(group, path, layout, inputs, compile="aot_eager")
    diff = (out - comfy_forward(reference, inputs)).abs().max().item()
    print(f"compiled Wan {layout}: max |diff| {diff:.2e}; {group.compiles[-1:]}")
    assert group.compiles and "compiled the repeated blocks" in group.compiles[0]
    assert diff <= TOL
