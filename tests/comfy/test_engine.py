"""The model engine (backend/models/) against ComfyUI's own model: the same file, every layout, on gloo.

A tiny FLUX.1 [dev] (and FLUX.2) is built and saved by ComfyUI's own classes and ModelSave
(tests/tools/comfy_models.py); ComfyUI's own loader (`comfy.sd.load_diffusion_model_state_dict`) loads it in
this process and its `diffusion_model.forward` is the reference. The pack loads the same file with
`engine='comfy'` through the public API (`ParallelModel.load` / `forward`) on CPU workers: every rank builds
ComfyUI's class on the meta device, applies the plan and reads its slices. Both sides' detection is told the
small model's head count and RoPE axes (ComfyUI hard-codes the released ones), nothing else.

    COMFYUI_PATH=<ComfyUI checkout> PYTHONPATH=<stand-ins>:<pack parent> \\
        python -m pytest -q tests/comfy/test_engine.py
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from comfy_server import COMFYUI_PATH, TESTS_DIR
from safetensors.torch import save_file

from rocm_parallel.backend.api import ParallelModel
from rocm_parallel.backend.config import ConfigError

pytestmark = [pytest.mark.comfy, pytest.mark.timeout(3000)]

TOL = 1e-5  # float32 on gloo: ComfyUI's attention on CPU (sub-quadratic) vs the pack's CPU flash kernel
LAYOUTS = {  # layout -> workers
    "tp 2": 2,
    "ring 2": 2,
    "ulysses 2": 2,
    "ring 2 x tp 2": 4,
    "batch 2 x tp 2": 4,
}


def import_comfy() -> dict[str, Any]:
    """ComfyUI imported in this process (tests/tools/comfy_models.py import_comfy); skips without one."""
    if not COMFYUI_PATH:
        pytest.skip("set COMFYUI_PATH to a ComfyUI checkout to run the comfy tier")
    sys.path.insert(0, str(TESTS_DIR / "tools"))
    import comfy_models

    return comfy_models.import_comfy(COMFYUI_PATH)


@pytest.fixture(scope="module")
def comfy() -> dict[str, Any]:
    return import_comfy()


def tiny(name: str) -> dict[str, Any]:
    import comfy_models

    return dict(comfy_models.MODELS[name])


@pytest.fixture(scope="module")
def files(comfy: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, Any]]:
    return saved_models(comfy, tmp_path_factory.mktemp("engine"), ("flux1-dev", "flux2-dev"))


def saved_models(comfy: dict[str, Any], folder: Path, names: Sequence[str]) -> dict[str, tuple[str, Any]]:
    """name -> (a file ComfyUI's ModelSave wrote, ComfyUI's own diffusion model loaded from it)."""
    import comfy_models

    out = {}
    for name in names:
        path = folder / f"{name}.safetensors"
        spec = tiny(name)
        comfy_models.model_save(comfy, comfy_models.build(comfy, spec, torch.float32), path)
        out[name] = (str(path), comfy_models.load_in_comfy(comfy, path, spec).model.diffusion_model)
    return out


@pytest.fixture(scope="module")
def groups(comfy: dict[str, Any]) -> Iterator[dict[int, ParallelModel]]:
    """One group of CPU workers per size, their own (their ComfyUI import stays in them); none without a
    ComfyUI (`comfy` skips)."""
    made = {n: ParallelModel(["cpu"] * n, threads=1) for n in (2, 4)}
    yield made
    for model in made.values():
        model.close()


def detection(name: str) -> dict[str, Any]:
    import comfy_models

    return comfy_models.widths(tiny(name))


def call_inputs(name: str, height: int, width: int, tokens: int, seed: int = 0) -> dict[str, Any]:
    """A CFG-like call of model `name`: two latents, each with its own prompt (odd sizes: uneven splits,
    padded). FLUX.2 takes 128 channels at one latent pixel per token and no pooled vector."""
    spec = tiny(name)
    g = torch.Generator().manual_seed(seed)
    inputs = {
        "x": torch.randn(2, spec["in"] // 4 if "pooled" in spec else spec["in"], height, width, generator=g),
        "timestep": torch.tensor([0.7, 0.7]),
        "context": torch.randn(2, tokens, spec["text"], generator=g),
        "guidance": torch.full((2,), 3.5),
    }
    if "pooled" in spec:
        inputs["y"] = torch.randn(2, spec["pooled"], generator=g)
    return inputs


def comfy_forward(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs)


def engine_forward(
    group: ParallelModel, path: str, name: str, layout: str, inputs: dict[str, Any]
) -> torch.Tensor:
    group.load(
        path, layout=layout, dtype="float32", engine="comfy", comfyui=COMFYUI_PATH, detection=detection(name)
    )
    return group.forward(**inputs)


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=lambda s: s.replace(" ", ""))
@pytest.mark.parametrize("size", [(10, 14, 7), (8, 8, 8)], ids=["uneven", "even"])
@pytest.mark.parametrize("name", ["flux1-dev", "flux2-dev"])
def test_the_engine_equals_comfyuis_own_model(files, groups, name, layout, size) -> None:
    """FLUX.1 at 2 x 2 patches (odd sizes padded circularly by ComfyUI), FLUX.2 at one pixel per token; an
    uneven case (35 image and 7 text tokens over 2 ranks: padded keys dropped) and an even one."""
    path, reference = files[name]
    height, width, tokens = size if name == "flux1-dev" else (size[0] // 2, size[1] // 2, size[2])
    inputs = call_inputs(name, height, width, tokens)
    expected = comfy_forward(reference, inputs)
    out = engine_forward(groups[LAYOUTS[layout]], path, name, layout, inputs)
    assert out.shape == expected.shape
    diff = (out - expected).abs().max().item()
    print(f"{name} {layout} {tuple(inputs['x'].shape)}: max |diff| {diff:.2e}")
    assert diff <= TOL


def test_the_engine_refuses_what_it_does_not_read_before_any_worker_starts(files) -> None:
    path, _ = files["flux1-dev"]
    model = ParallelModel(["cpu", "cpu"], threads=1)
    try:
        with pytest.raises(ConfigError, match="engine='turbo' is not an engine; use 'diffusers' or 'comfy'"):
            model.check_load(path, engine="turbo")
        with pytest.raises(ConfigError, match="is not a ComfyUI checkout"):
            model.check_load(path, engine="comfy", comfyui=str(Path(path).parent))
        with pytest.raises(ConfigError, match="comfyui= and detection= go with engine='comfy' only"):
            model.check_load(path, detection={"num_heads": 4})
        assert not model.started
    finally:
        model.close()


def write_loras(folder: Path, checkpoint: str) -> list[tuple[str, float]]:
    """LoRAs on a FLUX.1 or FLUX.2 file: every adapter kind ComfyUI reads (LoRA, LoHa, LoKr, full difference,
    DoRA, bias differences where the model has biases) under BFL keys; for FLUX.1 plain LoRA under diffusers'
    names too (ComfyUI maps them onto row ranges of the fused qkv / linear1); differences on the patch
    embedding and on a q/k norm (ComfyUI applies `.diff` to any weight; its key is the norm's name in this
    ComfyUI's model: `*_norm` for 0.33's `*_norm.weight`, `*_norm.scale` for 0.3.75's)."""
    from safetensors import safe_open

    from rocm_parallel.backend.checkpoint import inspect_checkpoint
    from rocm_parallel.testing.writers import LORA_KINDS, write_random_lora

    info = inspect_checkpoint(checkpoint)
    tag = Path(checkpoint).stem
    with safe_open(checkpoint, "pt") as f:
        keys = list(f.keys())
        embedding = f.get_slice(next(k for k in keys if k.endswith("img_in.weight"))).get_shape()
        norm = f.get_slice(next(k for k in keys if "img_attn.norm.query_norm" in k)).get_shape()
    scale = any(k.endswith("query_norm.scale") for k in keys)
    bias = any(k.endswith("img_attn.proj.bias") for k in keys)
    kinds = write_random_lora(
        folder / f"{tag}-kinds.safetensors", info.config, "bfl", kind=list(LORA_KINDS),
        dora=[None, "output", "input"], bias=bias, seed=1, relative=0.3, family=info.family,
    )  # fmt: skip
    out = [(kinds, 0.8)]
    if info.family == "flux1":
        peft = write_random_lora(
            folder / f"{tag}-peft.safetensors", info.config, "peft", seed=2, relative=0.3
        )
        out.append((peft, -0.6))
    g = torch.Generator().manual_seed(3)
    query = "diffusion_model.double_blocks.0.img_attn.norm.query_norm" + (".scale" if scale else "")
    diffs = {
        "diffusion_model.img_in.diff": 0.02 * torch.randn(*embedding, generator=g),
        f"{query}.diff": 0.1 * torch.randn(*norm, generator=g),
    }
    save_file(diffs, str(folder / f"{tag}-diffs.safetensors"))
    return [*out, (str(folder / f"{tag}-diffs.safetensors"), 1.0)]


@pytest.fixture(scope="module")
def loras(files, tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, float]]:
    return write_loras(tmp_path_factory.mktemp("loras"), files["flux1-dev"][0])


def comfy_with_loras(comfy: dict[str, Any], path: str, loras: list[tuple[str, float]]) -> Any:
    """ComfyUI's own model with `loras` as LoraLoaderModelOnly applies them (comfy.sd.load_lora_for_models),
    patched in place (ModelPatcher.patch_model); its diffusion model."""
    import comfy_models

    patcher = comfy_models.load_in_comfy(comfy, Path(path), tiny("flux1-dev"))
    for lora, strength in loras:
        lora_sd = comfy["utils"].load_torch_file(lora, safe_load=True)
        patcher = comfy["sd"].load_lora_for_models(patcher, None, lora_sd, strength, 0)[0]
    patcher.patch_model()
    return patcher.model.diffusion_model


@pytest.mark.parametrize("layout", ["tp 2", "ring 2 x tp 2"], ids=lambda s: s.replace(" ", ""))
def test_loras_on_the_engine_equal_comfyuis_loras(comfy, files, groups, loras, layout) -> None:
    """Each rank's slices patched by ComfyUI's own LoRA code equal ComfyUI's patched model; then the LoRAs
    off again gives the file's model back (only the patched tensors re-read)."""
    path, plain = files["flux1-dev"]
    inputs = call_inputs("flux1-dev", 10, 14, 7)
    expected = comfy_forward(comfy_with_loras(comfy, path, loras), inputs)
    group = groups[LAYOUTS[layout]]
    options = {"layout": layout, "dtype": "float32", "engine": "comfy", "comfyui": COMFYUI_PATH}
    reports = group.load(path, loras=loras, detection=detection("flux1-dev"), **options)
    assert reports[0].lora_tensors > 0
    out = group.forward(**inputs)
    diff = (out - expected).abs().max().item()
    away = (expected - comfy_forward(plain, inputs)).abs().max().item()
    print(f"LoRAs {layout}: max |diff| {diff:.2e} (the LoRAs move the output by {away:.2e})")
    assert away > 1e-2
    assert diff <= TOL
    reports = group.load(path, loras=(), detection=detection("flux1-dev"), **options)
    assert reports[0].reused and reports[0].lora_tensors > 0  # the patched tensors, read back
    assert (group.forward(**inputs) - comfy_forward(plain, inputs)).abs().max().item() <= TOL


def test_a_lora_comfyui_would_skip_is_refused_by_name(files, groups, tmp_path) -> None:
    """ComfyUI's loader logs 'lora key not loaded' and skips such keys; the engine refuses the file, naming one."""
    from rocm_parallel.backend.runtime.client import WorkerError

    path, _ = files["flux1-dev"]
    lora = tmp_path / "sdxl.safetensors"
    save_file({"diffusion_model.input_blocks.0.0.diff": torch.zeros(4, 4)}, str(lora))
    with pytest.raises(WorkerError, match=r"applies 1 of its keys to nothing of this Flux \(e\.g\. "
                       r"'diffusion_model\.input_blocks\.0\.0\.diff'\)"):  # fmt: skip
        groups[2].load(
            path, layout="tp 2", dtype="float32", engine="comfy", comfyui=COMFYUI_PATH,
            detection=detection("flux1-dev"), loras=[(str(lora), 1.0)],
        )  # fmt: skip


RELEASED = {  # header shapes of the released files (tests/tools/comfy_models.py header_like), by preset
    "flux1-dev": {"family": "flux", "in": 64, "text": 4096, "pooled": 768, "guidance": True, "heads": 24,
                  "head_dim": 128, "double": 19, "single": 38},
    "flux2-dev": {"family": "flux2", "in": 128, "text": 15360, "guidance": True, "heads": 48, "head_dim": 128,
                  "double": 8, "single": 48},
}  # fmt: skip


def engine_bytes(
    comfy: dict[str, Any], released: dict[str, Any], tp: int, rank: int, weight_dtype: str
) -> int:
    """Parameter bytes rank `rank` of `tp` holds of the released model on the engine: ComfyUI's own class as
    its detection configures it from the released header's shapes, built on the meta device, the plan applied
    under the fake process group, each parameter in the dtype the loader holds it in (bf16 compute)."""
    import comfy_models

    return engine_bytes_of(comfy, comfy_models.header_like(released), tp, rank, weight_dtype)


def engine_bytes_of(
    comfy: dict[str, Any], probe: dict[str, torch.Tensor], tp: int, rank: int, weight_dtype: str
) -> int:
    """`engine_bytes` for the model ComfyUI's detection configures from `probe` (a header's meta tensors)."""
    import torch.distributed as dist

    from rocm_parallel.backend.checkpoint.files import StoredTensor
    from rocm_parallel.backend.models.apply import apply_tensor_parallel
    from rocm_parallel.backend.models.load import held_dtype
    from rocm_parallel.backend.models.plans import plan_for
    from rocm_parallel.testing.fake import fake_process_group

    detection = comfy["detection"]
    config = detection.model_config_from_unet_config(detection.detect_unet_config(probe, ""), probe)
    config.set_inference_dtype(torch.bfloat16, None)
    model = config.get_model({}, "", device=torch.device("meta")).diffusion_model
    kind = type(model)
    plan = plan_for(f"{kind.__module__}.{kind.__qualname__}", config.unet_config)
    with fake_process_group(tp, rank):
        apply_tensor_parallel(model, plan, dist.group.WORLD)
    total = 0
    for name, p in model.named_parameters():
        module = model.get_submodule(name.rpartition(".")[0])
        stored = StoredTensor("", name, tuple(p.shape), "BF16")  # a bf16 release's header
        dtype = held_dtype(module, name.rpartition(".")[2], stored, weight_dtype, torch.bfloat16, p.dtype)
        total += p.numel() * dtype.itemsize
    return total


@pytest.mark.parametrize("preset", list(RELEASED))
def test_bytes_per_rank_at_the_released_configs_are_not_above_the_diffusers_engines(comfy, preset) -> None:
    """The issue's bar: bytes per GPU unchanged or lower than today's (the planner's count of the diffusers
    engine's shards, which BENCHMARKS tables), at TP 1, 2 and 4, bf16 and fp8 weights, first and last rank."""
    assert_bytes_not_above_the_diffusers_engines(comfy, preset.split("-")[0], preset, RELEASED[preset])


def assert_bytes_not_above_the_diffusers_engines(
    comfy: dict[str, Any], family_name: str, preset: str, released: dict[str, Any]
) -> None:
    """The engine's bytes on each rank (`engine_bytes` of the `released` header) against the planner's count
    of the diffusers engine's shards of the family's `preset`."""
    from rocm_parallel.backend.config import ParallelLayout
    from rocm_parallel.backend.family import get_family
    from rocm_parallel.backend.plan import weight_bytes

    family = get_family(family_name)
    dims = family.dims(family.presets[preset])
    for tp in (1, 2, 4):
        for weights, size in (("compute", 2), ("fp8_e4m3fn", 1)):
            for rank in {0, tp - 1}:
                ours = engine_bytes(comfy, released, tp, rank, weights)
                today = weight_bytes(
                    dims, ParallelLayout(tp=tp), 2, rank, family=family.name, linear_bytes=size
                )
                print(
                    f"{preset} tp {tp} rank {rank} {weights}: engine {ours / 1e9:.3f} GB, diffusers {today / 1e9:.3f} GB"
                )
                assert ours <= today


def test_headless_sample_on_the_engine_equals_comfyuis_references(groups, tmp_path) -> None:
    """`ParallelModel.sample` (the Euler loop in the caller, a `forward` per step) on the engine, ring 2, equals
    what this ComfyUI sampled with its own model (tests/data/comfy_references*.safetensors), on the file the
    references were made from: a BFL single file the pack wrote (BFL's `*_norm.scale` spelling)."""
    from comfy_server import ALL_CASES, reference
    from test_sampling import flux_model

    from rocm_parallel.backend.checkpoint import save_checkpoint

    path = tmp_path / "tiny-flux-dev.safetensors"
    save_checkpoint(flux_model("dev"), path)
    case, ref = ALL_CASES["dev_4steps"], reference("dev_4steps")
    group = groups[2]
    group.load(
        path, layout="ring 2", dtype="float32", engine="comfy", comfyui=COMFYUI_PATH, detection=detection("flux1-dev")
    )  # fmt: skip
    positive = [[ref["cond"], {"pooled_output": ref["pooled"], "guidance": case["guidance"]}]]
    out = group.sample(positive, {"samples": ref["latent"]}, seed=case["seed"], steps=case["steps"])[
        "samples"
    ]
    diff = (out - ref["output"]).abs().max().item()
    print(f"headless sample on the engine: max |diff| {diff:.2e}")
    assert diff <= 1e-4


def test_an_fp8_file_stays_fp8_on_the_ranks_and_equals_comfyuis_load(comfy, files, groups, tmp_path) -> None:
    """The blocks' linear weights stored fp8 (plain, no scales): 'default' keeps them fp8 on every rank, upcast
    per layer by ComfyUI's own manual_cast ops; equal to ComfyUI's own load of the file (upcast at load)."""
    import comfy_models
    from safetensors.torch import load_file

    source, _ = files["flux1-dev"]
    tensors = load_file(source)
    fp8 = {
        k: v.to(torch.float8_e4m3fn) if v.ndim == 2 and "_blocks." in k and k.endswith(".weight") else v
        for k, v in tensors.items()
    }
    path = tmp_path / "fp8.safetensors"
    save_file(fp8, str(path))
    reference = comfy_models.load_in_comfy(comfy, path, tiny("flux1-dev")).model.diffusion_model
    inputs = call_inputs("flux1-dev", 10, 14, 7)
    group = groups[2]
    reports = group.load(
        str(path), layout="tp 2", dtype="float32", engine="comfy", comfyui=COMFYUI_PATH,
        detection=detection("flux1-dev"),
    )  # fmt: skip
    # every rank holds half of each fp8 block weight, as fp8 (every block linear is split over tp 2)
    stored = sum(v.numel() for v in fp8.values() if v.dtype == torch.float8_e4m3fn)
    assert [r.parameter_bytes_by_dtype.get("float8_e4m3fn") for r in reports] == [stored // 2] * 2
    diff = (group.forward(**inputs) - comfy_forward(reference, inputs)).abs().max().item()
    print(f"fp8 file on the engine, tp 2: max |diff| {diff:.2e}")
    assert diff <= TOL


def test_compiled_blocks_on_the_engine_equal_comfyuis_own_model(files, groups) -> None:
    """compile='aot_eager' marks the plan's blocks (ComfyUI's DoubleStreamBlock / SingleStreamBlock) and they
    compile at the first call, all-reduce hooks and the attention override included (graph breaks there)."""
    path, reference = files["flux1-dev"]
    inputs = call_inputs("flux1-dev", 10, 14, 7)
    group = groups[2]
    group.load(
        path, layout="tp 2", dtype="float32", engine="comfy", comfyui=COMFYUI_PATH, detection=detection("flux1-dev"),
        compile="aot_eager",
    )  # fmt: skip
    diff = (group.forward(**inputs) - comfy_forward(reference, inputs)).abs().max().item()
    print(f"compiled: max |diff| {diff:.2e}; {group.compiles[-1:]}")
    assert group.compiles and "compiled the repeated blocks" in group.compiles[0]
    assert diff <= TOL
