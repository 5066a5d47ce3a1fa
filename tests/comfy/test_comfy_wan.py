"""Wan 2.1 and Wan 2.2 graphs on the ROCm Parallel Model against ComfyUI's own Wan, in a real ComfyUI.

The models are ComfyUI's own: tiny Wan transformers (2 heads x 128, 2 blocks, FFN 512, umt5's 4096-wide
text) built by ComfyUI's detection and model classes (`detect_unet_config` on the shapes of each variant ->
supported_models WAN21_T2V / WAN21_I2V / WAN22_T2V -> model_base.WAN21 / WAN22 around
comfy/ldm/wan/model.py `WanModel`), filled with seeded random weights and written by ComfyUI's ModelSave
node into the server's models/diffusion_models. ComfyUI's stock UNETLoader loads them as they are (the
tiny widths are the ones its detection reads); the pack's loader reads the same files.

Each /prompt holds every case twice, once on ComfyUI's UNETLoader and once on the ROCm Parallel Loader ->
ROCm Parallel Model, with the same ComfyUI nodes around both (stand-ins only where weights are missing:
rp_wan_test_nodes.py), and each pair of saved latents must agree within 1e-4:

* Wan 2.1 T2V: EmptyHunyuanLatentVideo (9 frames -> 3 latent frames, 72 x 40: odd latent sizes, 45 tokens:
  padded for every context-parallel degree), ModelSamplingSD3 8, KSampler uni_pc / simple, cfg 5 with a
  negative prompt, a LoRA (ComfyUI's LoraLoaderModelOnly against the pack's LoRA node);
* Wan 2.1 I2V: WanImageToVideo with a start image and a CLIP vision output (36 input channels via
  concat_cond, clip_fea), KSampler uni_pc;
* Wan 2.2 I2V A14B: ComfyUI's template graph: two loaders (the high- and low-noise experts, two slots of one
  worker group), ModelSamplingSD3 5 on each, KSamplerAdvanced 0 -> 2 with leftover noise, then 2 -> 4;
* Wan 2.2 TI2V 5B: Wan22ImageToVideoLatent with a start image (48 channels, 1/16, a noise mask: WAN22's
  per-frame timesteps), KSampler uni_pc.

In TP 2, ring 2, Ulysses 2 (2 CPU workers) and TP 2 x ring 2 (4). Beside the prompts, in this process: the
two experts stay resident through both KSamplerAdvanced runs (no reload), `ParallelModel.sample` equals
ComfyUI's KSampler (euler, cfg 1) on ModelSamplingSD3, and the proxy is ComfyUI's own WAN21 / WAN22.

    COMFYUI_PATH=/path/to/ComfyUI python -m pytest -q -s -m comfy tests/comfy/test_comfy_wan.py
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from comfy_server import COMFYUI_PATH, Comfy
from safetensors.torch import load_file

from rocm_parallel.backend.checkpoint import inspect_checkpoint
from rocm_parallel.backend.config import ParallelLayout
from rocm_parallel.backend.diffusion.api import ParallelModel
from rocm_parallel.nodes.inputs import LayoutRequest, ParallelHandle
from rocm_parallel.nodes.registry import Registry

pytestmark = [pytest.mark.comfy, pytest.mark.timeout(3000)]

TOLERANCE = 1e-4
DIM, FFN, BLOCKS = 256, 512, 2  # 2 heads of 128: ComfyUI reads heads as dim // 128
# name -> input / output channels, CLIP image embedder, seed; ComfyUI's model class is detected from these
MODELS: dict[str, dict[str, Any]] = {
    "wan21-t2v": {"in": 16, "out": 16, "image": False, "seed": 4101},
    "wan21-i2v": {"in": 36, "out": 16, "image": True, "seed": 4102},
    "wan22-i2v-high": {"in": 36, "out": 16, "image": False, "seed": 4103},
    "wan22-i2v-low": {"in": 36, "out": 16, "image": False, "seed": 4104},
    "wan22-ti2v": {"in": 48, "out": 48, "image": False, "seed": 4105},
}
LORA = "tiny-wan21-t2v-lora.safetensors"
LAYOUTS = {  # the ROCm Parallel Model's layout -> the loader's devices
    "tp": "cpu x2",
    "ring 2": "cpu x2",
    "ulysses 2": "cpu x2",
    "tp 2 x ring 2": "cpu x4",
}
QUICK_LAYOUT = "tp 2 x ring 2"  # the quick tier's (comfy_quick): a composed layout


def file_name(model: str) -> str:
    return f"tiny-{model}.safetensors"


# --------------------------------------------------------------------------------------------------
# ComfyUI's own tiny Wan models


@pytest.fixture(scope="module")
def comfy_modules() -> dict[str, Any]:
    if not COMFYUI_PATH:
        pytest.skip("set COMFYUI_PATH to a ComfyUI checkout to run the comfy tier")
    import comfy_models
    import make_comfy_references

    return {**make_comfy_references.import_comfy(COMFYUI_PATH), **comfy_models.import_comfy(COMFYUI_PATH)}


def header_like(spec: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The keys and shapes comfy/model_detection.py reads for a Wan (meta tensors: a header, abridged)."""
    t = lambda *shape: torch.empty(shape, device="meta")  # noqa: E731
    sd = {
        "head.modulation": t(1, 2, DIM),
        "head.head.weight": t(4 * spec["out"], DIM),
        "patch_embedding.weight": t(DIM, spec["in"], 1, 2, 2),
        **{f"blocks.{i}.ffn.0.weight": t(FFN, DIM) for i in range(BLOCKS)},
    }
    if spec["image"]:
        sd["img_emb.proj.0.bias"] = t(1280)
    return sd


def fill_random(module: torch.nn.Module, seed: int) -> None:
    """Seeded weights, one generator per tensor: linear and conv weights N(0, 1/fan_in), norm scales
    1 + N(0, 0.05^2), biases and modulation tables N(0, 0.05^2)."""
    with torch.no_grad():
        for key, tensor in module.state_dict().items():
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
            x = torch.randn(tuple(tensor.shape), generator=g)
            norm = "norm" in key.rsplit(".", 2)[-2] or key.startswith("img_emb.proj.0.") or ".4." in key
            if tensor.ndim >= 2 and not key.endswith("modulation"):
                x = x / tensor[0].numel() ** 0.5
            elif norm and key.endswith(".weight"):
                x = 1.0 + 0.05 * x
            else:
                x = 0.05 * x
            tensor.copy_(x.to(tensor.dtype))


def build_and_save(comfy: dict[str, Any], spec: dict[str, Any], path: Path) -> str:
    """ComfyUI's detection, its supported model and WanModel, random weights, ModelSave; the class name."""
    from comfy_models import model_save

    detection = comfy["detection"]
    probe = header_like(spec)
    unet_config = detection.detect_unet_config(probe, "")
    config = detection.model_config_from_unet_config(unet_config, probe)
    config.set_inference_dtype(torch.float32, None)
    model = config.get_model({}, "")
    fill_random(model.diffusion_model, spec["seed"])
    cpu = torch.device("cpu")
    model_save(comfy, comfy["patcher"].ModelPatcher(model, load_device=cpu, offload_device=cpu), path)
    return type(config).__name__


@pytest.fixture(scope="module")
def wan_files(comfy: Comfy, comfy_modules: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every model in the server's models/diffusion_models (and a LoRA in models/loras), removed afterwards."""
    from rocm_parallel.testing.writers import write_random_lora

    folder = comfy.base / "models" / "diffusion_models"
    loras = comfy.base / "models" / "loras"
    loras.mkdir(parents=True, exist_ok=True)
    written = {"classes": {}, "paths": {}}
    try:
        for name, spec in MODELS.items():
            path = folder / file_name(name)
            written["classes"][name] = build_and_save(comfy_modules, spec, path)
            written["paths"][name] = str(path)
        config = inspect_checkpoint(written["paths"]["wan21-t2v"]).config
        written["lora"] = write_random_lora(
            loras / LORA, config, "bfl", seed=77, family="wan", relative=0.5, rank=4
        )
        yield written
    finally:
        for path in [*written["paths"].values(), written.get("lora")]:
            if path:
                Path(path).unlink(missing_ok=True)


def test_comfyuis_models_are_the_released_kinds_and_the_pack_reads_them(wan_files) -> None:
    """ComfyUI's own detection picked the released models' classes; the pack's header reading agrees."""
    assert wan_files["classes"] == {
        "wan21-t2v": "WAN21_T2V",
        "wan21-i2v": "WAN21_I2V",
        "wan22-i2v-high": "WAN21_T2V",
        "wan22-i2v-low": "WAN21_T2V",
        "wan22-ti2v": "WAN22_T2V",
    }
    for name, path in wan_files["paths"].items():
        info = inspect_checkpoint(path)
        assert info.family == "wan" and info.prefix == "model.diffusion_model."
        assert info.model_family.comfy_model(info.config).config_class == wan_files["classes"][name]


# --------------------------------------------------------------------------------------------------
# The graphs through /prompt


def _text(seed: int, tokens: int) -> dict[str, Any]:
    return {"class_type": "RPTestWanText", "inputs": {"seed": seed, "tokens": tokens}}


def _sd3(model: list, shift: float) -> dict[str, Any]:
    return {"class_type": "ModelSamplingSD3", "inputs": {"model": model, "shift": shift}}


def _ksampler(
    model: list, cond: list, neg: list, latent: list, seed: int, cfg: float, steps: int = 3
) -> dict:
    return {
        "class_type": "KSampler",
        "inputs": {"model": model, "positive": cond, "negative": neg, "latent_image": latent, "seed": seed,
                   "steps": steps, "cfg": cfg, "sampler_name": "uni_pc", "scheduler": "simple", "denoise": 1.0},
    }  # fmt: skip


def _advanced(model: list, cond: list, neg: list, latent: list, first: bool) -> dict:
    """The video_wan2_2_14B_i2v template's KSamplerAdvanced pair (4 steps, split at 2)."""
    return {
        "class_type": "KSamplerAdvanced",
        "inputs": {"model": model, "add_noise": "enable" if first else "disable", "noise_seed": 33 if first else 0,
                   "steps": 4, "cfg": 3.5, "sampler_name": "euler", "scheduler": "simple",
                   "start_at_step": 0 if first else 2, "end_at_step": 2 if first else 10000,
                   "return_with_leftover_noise": "enable" if first else "disable",
                   "positive": cond, "negative": neg, "latent_image": latent},
    }  # fmt: skip


def _save(samples: list, prefix: str) -> dict[str, Any]:
    return {"class_type": "SaveLatent", "inputs": {"samples": samples, "filename_prefix": prefix}}


def _models(
    name: str, branch: str, layout: str, lora: bool = False, engine: bool = False
) -> dict[str, dict[str, Any]]:
    """`name`'s MODEL on ComfyUI's UNETLoader ('ref') or the ROCm Parallel Loader + Model (the layout's
    devices; `engine`: its handle on the model engine, ComfyUI's own WanModel on the workers), with the case's
    LoRA; the node that gives it is `<name>.<branch>.model`."""
    key = f"{name}.{branch}"
    if branch == "ref":
        nodes = {f"{key}.load": {"class_type": "UNETLoader",
                                 "inputs": {"unet_name": file_name(name), "weight_dtype": "default"}}}  # fmt: skip
        model = [f"{key}.load", 0]
        if lora:
            nodes[f"{key}.lora"] = {"class_type": "LoraLoaderModelOnly",
                                    "inputs": {"model": model, "lora_name": LORA, "strength_model": 0.8}}  # fmt: skip
            model = [f"{key}.lora", 0]
        return {**nodes, "_out": model}  # type: ignore[dict-item]
    loader = {"class_type": "RocmParallelLoader",
              "inputs": {"checkpoint": file_name(name), "devices": LAYOUTS[layout], "dtype": "float32",
                         "preload": "none", "weight_dtype": "default"}}  # fmt: skip
    nodes = {f"{key}.load": loader}
    handle = [f"{key}.load", 0]
    if engine:
        nodes[f"{key}.engine"] = {"class_type": "RPTestComfyEngine", "inputs": {"parallel_flux": handle, "detection": "{}"}}  # fmt: skip
        handle = [f"{key}.engine", 0]
    if lora:
        nodes[f"{key}.lora"] = {"class_type": "RocmParallelLoRA",
                                "inputs": {"parallel_flux": handle, "lora_name": LORA, "strength_model": 0.8}}  # fmt: skip
        handle = [f"{key}.lora", 0]
    nodes[f"{key}.model"] = {"class_type": "RocmParallelModel",
                             "inputs": {"parallel_flux": handle, "layout": layout, "ring_degree": 0, "ulysses_degree": 0}}  # fmt: skip
    return {**nodes, "_out": [f"{key}.model", 0]}  # type: ignore[dict-item]


def wan_prompt(layout: str, engine: bool = False) -> dict[str, Any]:
    """Every case on ComfyUI's own Wan ('ref', saved as wan/<case>_ref) and on the ROCm Parallel Model in
    `layout` (wan/<case>_<tag>; on the model engine with `engine`); plus the T2V case without its LoRA on
    ComfyUI's Wan (it must matter)."""
    tag = _tag(layout, engine)
    prompt: dict[str, Any] = {}

    def model(name: str, branch: str, lora: bool = False) -> list:
        nodes = _models(name, branch, layout, lora, engine)
        out = nodes.pop("_out")
        prompt.update(nodes)
        return out

    # Wan 2.1 T2V: cfg 5 with a negative prompt, a LoRA
    prompt["t2v.pos"], prompt["t2v.neg"] = _text(1, 9), _text(2, 9)
    prompt["t2v.latent"] = {"class_type": "EmptyHunyuanLatentVideo",
                            "inputs": {"width": 72, "height": 40, "length": 9, "batch_size": 1}}  # fmt: skip
    branches = (
        ("ref", model("wan21-t2v", "ref", lora=True), "ref"),
        ("pack", model("wan21-t2v", "pack", lora=True), tag),
        ("plain", ["wan21-t2v.ref.load", 0], "plain"),  # ComfyUI's UNETLoader output without the LoRA
    )
    for branch, m, saved in branches:
        prompt[f"t2v.{branch}.sd3"] = _sd3(m, 8.0)
        prompt[f"t2v.{branch}.ks"] = _ksampler([f"t2v.{branch}.sd3", 0], ["t2v.pos", 0], ["t2v.neg", 0],
                                               ["t2v.latent", 0], seed=31, cfg=5.0)  # fmt: skip
        prompt[f"t2v.{branch}.save"] = _save([f"t2v.{branch}.ks", 0], f"wan/t2v_{saved}")
    # Wan 2.1 I2V: WanImageToVideo with a start image and a CLIP vision output
    prompt["i2v.image"] = {
        "class_type": "RPTestWanImage",
        "inputs": {"seed": 3, "width": 72, "height": 40, "frames": 1},
    }
    prompt["vae21"] = {"class_type": "RPTestWanVAE", "inputs": {"channels": 16, "scale": 8, "seed": 5}}
    prompt["i2v.clip"] = {"class_type": "RPTestWanClipVision", "inputs": {"seed": 6, "tokens": 9}}
    prompt["i2v.pos"], prompt["i2v.neg"] = _text(7, 7), _text(8, 7)
    prompt["i2v.cond"] = {"class_type": "WanImageToVideo",
                          "inputs": {"positive": ["i2v.pos", 0], "negative": ["i2v.neg", 0], "vae": ["vae21", 0],
                                     "width": 72, "height": 40, "length": 9, "batch_size": 1,
                                     "clip_vision_output": ["i2v.clip", 0], "start_image": ["i2v.image", 0]}}  # fmt: skip
    for branch in ("ref", "pack"):
        prompt[f"i2v.{branch}.sd3"] = _sd3(model("wan21-i2v", branch), 8.0)
        prompt[f"i2v.{branch}.ks"] = _ksampler([f"i2v.{branch}.sd3", 0], ["i2v.cond", 0], ["i2v.cond", 1],
                                               ["i2v.cond", 2], seed=32, cfg=4.0)  # fmt: skip
        prompt[f"i2v.{branch}.save"] = _save(
            [f"i2v.{branch}.ks", 0], f"wan/i2v_{'ref' if branch == 'ref' else tag}"
        )
    # Wan 2.2 I2V A14B: the two experts, KSamplerAdvanced 0 -> 2 -> 4
    prompt["a14b.image"] = {
        "class_type": "RPTestWanImage",
        "inputs": {"seed": 13, "width": 72, "height": 40, "frames": 1},
    }
    prompt["a14b.pos"], prompt["a14b.neg"] = _text(14, 8), _text(15, 8)
    prompt["a14b.cond"] = {"class_type": "WanImageToVideo",
                           "inputs": {"positive": ["a14b.pos", 0], "negative": ["a14b.neg", 0], "vae": ["vae21", 0],
                                      "width": 72, "height": 40, "length": 9, "batch_size": 1,
                                      "start_image": ["a14b.image", 0]}}  # fmt: skip
    for branch in ("ref", "pack"):
        high, low = model("wan22-i2v-high", branch), model("wan22-i2v-low", branch)
        prompt[f"a14b.{branch}.sd3h"], prompt[f"a14b.{branch}.sd3l"] = _sd3(high, 5.0), _sd3(low, 5.0)
        cond, neg = ["a14b.cond", 0], ["a14b.cond", 1]
        prompt[f"a14b.{branch}.first"] = _advanced(
            [f"a14b.{branch}.sd3h", 0], cond, neg, ["a14b.cond", 2], True
        )
        prompt[f"a14b.{branch}.second"] = _advanced(
            [f"a14b.{branch}.sd3l", 0], cond, neg, [f"a14b.{branch}.first", 0], False
        )
        prompt[f"a14b.{branch}.save"] = _save(
            [f"a14b.{branch}.second", 0], f"wan/a14b_{'ref' if branch == 'ref' else tag}"
        )
    # Wan 2.2 TI2V 5B: Wan22ImageToVideoLatent with a start image (a noise mask: per-frame timesteps)
    prompt["ti2v.image"] = {
        "class_type": "RPTestWanImage",
        "inputs": {"seed": 9, "width": 80, "height": 80, "frames": 1},
    }
    prompt["vae22"] = {"class_type": "RPTestWanVAE", "inputs": {"channels": 48, "scale": 16, "seed": 10}}
    prompt["ti2v.latent"] = {"class_type": "Wan22ImageToVideoLatent",
                             "inputs": {"vae": ["vae22", 0], "width": 80, "height": 80, "length": 9, "batch_size": 1,
                                        "start_image": ["ti2v.image", 0]}}  # fmt: skip
    prompt["ti2v.pos"], prompt["ti2v.neg"] = _text(11, 6), _text(12, 6)
    for branch in ("ref", "pack"):
        prompt[f"ti2v.{branch}.sd3"] = _sd3(model("wan22-ti2v", branch), 8.0)
        prompt[f"ti2v.{branch}.ks"] = _ksampler([f"ti2v.{branch}.sd3", 0], ["ti2v.pos", 0], ["ti2v.neg", 0],
                                                ["ti2v.latent", 0], seed=34, cfg=5.0)  # fmt: skip
        prompt[f"ti2v.{branch}.save"] = _save(
            [f"ti2v.{branch}.ks", 0], f"wan/ti2v_{'ref' if branch == 'ref' else tag}"
        )
    return prompt


def _tag(layout: str, engine: bool) -> str:
    return layout.replace(" ", "") + ("-engine" if engine else "")


def _saved(comfy: Comfy, prefix: str) -> torch.Tensor:
    files = sorted((comfy.base / "output").glob(f"{prefix}_*.latent"))
    assert files, prefix
    return load_file(str(files[-1]))["latent_tensor"]


@pytest.mark.parametrize(
    "layout", [pytest.param(a, marks=pytest.mark.comfy_quick) if a == QUICK_LAYOUT else a for a in LAYOUTS]
)
def test_wan_graphs_through_the_prompt_api_match_comfyuis_own_wan(
    comfy: Comfy, wan_files, layout: str
) -> None:
    check_wan_prompt(comfy, layout, engine=False)


@pytest.mark.parametrize("layout", ["tp", "tp 2 x ring 2"])
def test_wan_graphs_on_the_model_engine_through_prompt_match_comfyuis_own_wan(
    comfy: Comfy, wan_files, layout: str
) -> None:
    """The same graphs with the pack's branch on the model engine (`engine='comfy'`: ComfyUI's own WanModel
    sharded by plans/wan.py on the workers; its LoRA by ComfyUI's own LoRA code): T2V with cfg 5 and a LoRA,
    I2V with CLIP vision, both A14B experts resident through the two KSamplerAdvanced, TI2V's per-frame
    timesteps."""
    check_wan_prompt(comfy, layout, engine=True)


def check_wan_prompt(comfy: Comfy, layout: str, engine: bool) -> None:
    started = time.monotonic()
    entry = comfy.wait_done(
        comfy.post("/prompt", {"prompt": wan_prompt(layout, engine), "client_id": "rp-wan"})["prompt_id"],
        timeout=2400,
    )
    assert entry["status"]["status_str"] == "success", entry["status"]
    tag = _tag(layout, engine)
    shapes = {
        "t2v": (1, 16, 3, 5, 9),
        "i2v": (1, 16, 3, 5, 9),
        "a14b": (1, 16, 3, 5, 9),
        "ti2v": (1, 48, 3, 5, 5),
    }
    for case, shape in shapes.items():
        want, got = _saved(comfy, f"wan/{case}_ref"), _saved(comfy, f"wan/{case}_{tag}")
        diff = (got - want).abs().max().item()
        print(f"Wan {case} {layout} via /prompt: max |diff| {diff:.2e} (max |out| {want.abs().max():.2f})")
        assert got.shape == want.shape == shape, case
        assert diff <= TOLERANCE, case
    assert (
        _saved(comfy, "wan/t2v_ref") - _saved(comfy, "wan/t2v_plain")
    ).abs().max().item() > 1e-2  # the LoRA
    state = comfy.get("/rocm_parallel/status")
    resident = {m["checkpoint"] for m in state["models"]}
    assert {file_name(m) for m in MODELS} <= resident and state.get("evicted") is None, state
    print(f"{layout}: {time.monotonic() - started:.0f} s")


# --------------------------------------------------------------------------------------------------
# In this process: the experts' residency, the headless sampler, the proxy's classes


@pytest.fixture(scope="module")
def registry() -> Iterator[Registry]:
    made = Registry(factory=lambda devices: ParallelModel(list(devices), threads=1))
    yield made
    made.close()


def _parallel_model(registry: Registry, path: str, layout: ParallelLayout, slot: str) -> Any:
    from rocm_parallel.nodes import comfy_model

    handle = ParallelHandle(path, Path(path).name, ("cpu", "cpu"), "float32", slot=slot)
    return comfy_model.parallel_model(handle, LayoutRequest(layout), registry)


def test_the_a14b_experts_stay_resident_through_both_samplers(comfy_modules, wan_files, registry) -> None:
    """The template's two KSamplerAdvanced on two ROCm Parallel Models of one worker group (two loaders: two
    slots): two loads for the first run, none for the second, each expert's half its own."""
    nodes = comfy_modules["nodes"]
    advanced = comfy_modules["advanced"].ModelSamplingSD3()
    high = advanced.patch(
        _parallel_model(registry, wan_files["paths"]["wan22-i2v-high"], ParallelLayout(tp=2), "loader high"),
        5.0,
    )[0]
    low = advanced.patch(
        _parallel_model(registry, wan_files["paths"]["wan22-i2v-low"], ParallelLayout(ring=2), "loader low"),
        5.0,
    )[0]
    g = torch.Generator().manual_seed(2)
    cond = [[torch.randn(1, 6, 4096, generator=g), {"pooled_output": None}]]
    image = torch.randn(1, 16, 3, 5, 9, generator=g)
    mask = torch.ones(1, 1, 3, 5, 9)
    mask[:, :, :1] = 0.0
    cond = comfy_modules["node_helpers"].conditioning_set_values(
        cond, {"concat_latent_image": image, "concat_mask": mask}
    )
    latent = {"samples": torch.zeros(1, 16, 3, 5, 9)}
    group = registry.group_for(("cpu", "cpu"))
    real = group._load_resident
    loads: list[tuple[str, bool]] = []  # (slot, whether the ranks read the checkpoint)

    def load_resident(request: Any, *args: Any, **kwargs: Any) -> Any:
        reports = real(request, *args, **kwargs)
        loads.append((request.slot, not all(r.reused for r in reports)))
        return reports

    outs = []
    with mock.patch.object(group, "_load_resident", side_effect=load_resident), torch.no_grad():
        for seed in (5, 6):
            first = nodes.KSamplerAdvanced().sample(
                high, "enable", seed, 4, 1.0, "euler", "simple", cond, cond, latent, 0, 2, "enable"
            )[0]
            outs.append(
                nodes.KSamplerAdvanced().sample(
                    low, "disable", 0, 4, 1.0, "euler", "simple", cond, cond, first, 2, 4, "disable"
                )[0]["samples"]
            )
    # each sampling run makes its model resident; only the first run of each read it from disk
    assert loads == [
        ("loader high", True),
        ("loader low", True),
        ("loader high", False),
        ("loader low", False),
    ]
    assert (outs[0] - outs[1]).abs().max().item() > 1e-2  # another seed: both runs really sampled


def test_sample_equals_comfyuis_ksampler_on_modelsamplingsd3(comfy_modules, wan_files, registry) -> None:
    """`ParallelModel.sample` (ModelSamplingSD3 8, euler / simple, cfg 1; 9 frames at 72 x 40) on ring 2
    equals ComfyUI's KSampler on its own Wan 2.1 T2V."""
    path = wan_files["paths"]["wan21-t2v"]
    g = torch.Generator().manual_seed(21)
    positive = [[torch.randn(1, 9, 4096, generator=g), {"pooled_output": None}]]
    latent = {"samples": torch.zeros(1, 16, 3, 5, 9)}
    model = comfy_modules["sd"].load_diffusion_model(path, model_options={"dtype": torch.float32})
    model = comfy_modules["advanced"].ModelSamplingSD3().patch(model, 8.0)[0]
    with torch.no_grad():
        want = comfy_modules["nodes"].common_ksampler(
            model, 61, 3, 1.0, "euler", "simple", positive, positive, latent
        )[0]["samples"]
    parallel = registry.group_for(("cpu", "cpu"))
    parallel.load(path, layout=ParallelLayout(ring=2), dtype="float32", slot="headless")
    out = parallel.sample(positive, latent, seed=61, steps=3, slot="headless")["samples"]
    print(f"sample vs ComfyUI's KSampler: max |diff| {(out - want).abs().max().item():.2e}")
    assert out.shape == want.shape == (1, 16, 3, 5, 9)
    assert (out - want).abs().max().item() <= TOLERANCE


def test_the_parallel_model_is_comfyuis_wan(wan_files, registry) -> None:
    """ComfyUI's own model classes around the proxy: WAN21 (shift 8 by default, latent format Wan21) and WAN22
    for TI2V (Wan22); WAN21.concat_cond reads the I2V model's input channels from the proxy."""
    import comfy.latent_formats
    import comfy.model_base

    i2v = _parallel_model(registry, wan_files["paths"]["wan21-i2v"], ParallelLayout(tp=2), "loader i2v")
    assert type(i2v.model) is comfy.model_base.WAN21 and i2v.model.image_to_video
    assert i2v.model.model_sampling.shift == pytest.approx(8.0)
    assert isinstance(i2v.model.latent_format, comfy.latent_formats.Wan21)
    noise = torch.zeros(1, 16, 3, 5, 9)
    concat = i2v.model.concat_cond(noise=noise, device=torch.device("cpu"))
    assert concat.shape == (1, 20, 3, 5, 9)  # 4 mask + 16 image channels: 36 - 16
    ti2v = _parallel_model(registry, wan_files["paths"]["wan22-ti2v"], ParallelLayout(tp=2), "loader ti2v")
    assert type(ti2v.model) is comfy.model_base.WAN22
    assert isinstance(ti2v.model.latent_format, comfy.latent_formats.Wan22)


CACHE_THRESHOLD = 1.0  # reuse_threshold at which the caches skip calls of the tiny model


@pytest.mark.parametrize("node", ["EasyCache", "LazyCache"])
def test_a_step_cache_on_the_parallel_wan_equals_comfyuis_own_wan_with_it(
    comfy_modules, wan_files, registry, node: str
) -> None:
    """ComfyUI's step caches (comfy_extras/nodes_easycache.py: EasyCache's diffusion_model wrapper,
    LazyCache's predict_noise wrapper) on ComfyUI's own Wan 2.1 T2V and on the ROCm Parallel Model (TP 2),
    KSampler dpmpp_2m, 24 steps, cfg 2.5 with a negative prompt on 9 frames: the same calls skipped, the
    same video within 1e-4, and the cache changed it. The nodes' default reuse_threshold 0.2 skips no call
    of this tiny random Wan (its output changes fast at every step; EasyCache skips 8 of 24 at 1.0)."""
    import comfy_extras.nodes_easycache as caches

    cls = getattr(caches, f"{node}Node")
    path = wan_files["paths"]["wan21-t2v"]
    g = torch.Generator().manual_seed(23)
    positive = [[torch.randn(1, 8, 4096, generator=g), {"pooled_output": None}]]
    negative = [[torch.randn(1, 8, 4096, generator=g), {"pooled_output": None}]]
    latent = {"samples": torch.zeros(1, 16, 3, 5, 9)}
    shift = comfy_modules["advanced"].ModelSamplingSD3()

    def sample(model: Any) -> torch.Tensor:
        with torch.no_grad():
            return (
                comfy_modules["nodes"]
                .common_ksampler(
                    shift.patch(model, 8.0)[0], 3, 24, 2.5, "dpmpp_2m", "simple", positive, negative, latent
                )[0]["samples"]
                .float()
            )

    own = comfy_modules["sd"].load_diffusion_model(path, model_options={"dtype": torch.float32})
    calls: list[int] = []
    own.model.diffusion_model.patch_embedding.register_forward_pre_hook(lambda *_: calls.append(1))
    plain = sample(own)
    assert len(calls) == 24  # one batched cond + uncond call per step without a cache
    calls.clear()
    want = sample(cls.execute(own, CACHE_THRESHOLD, 0.15, 0.95, False)[0])
    ours = _parallel_model(registry, path, ParallelLayout(tp=2), f"cache {node}")
    runner = ours.model.diffusion_model.runner
    got = sample(cls.execute(ours, CACHE_THRESHOLD, 0.15, 0.95, False)[0])
    diff, effect = (got - want).abs().max().item(), (want - plain).abs().max().item()
    print(f"{node} on Wan: max |diff| {diff:.2e}; calls {runner.calls} (ComfyUI's own {len(calls)}) of 24")
    assert len(calls) < 24 and runner.calls == len(calls)
    assert effect > 1e-3 and diff <= TOLERANCE
