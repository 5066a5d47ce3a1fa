"""Every LoRA adapter kind, ComfyUI's own LoraLoaderModelOnly against the ROCm Parallel LoRA, through a real
ComfyUI server (opt-in: COMFYUI_PATH; run it against 0.3.75 and 0.33).

For each kind (LoRA, LoHa, LoKr in its three layouts, DoRA on LoRA / LoHa / LoKr on both axes, .diff with
.diff_b) in a key format ComfyUI maps (BFL, kohya, PEFT, LyCORIS; FLUX.2: BFL and kohya, the ones ComfyUI
maps for it), one /prompt runs three branches on the same random file: ComfyUI's own model (its loader,
comfy.sd.load_diffusion_model, through the test node RPTestTinyUNETLoader: ComfyUI's detection hard-codes
the released models' head count and RoPE axes, so it is told the small model's) -> ComfyUI's
LoraLoaderModelOnly -> its sampler, and ROCm Parallel Loader -> ROCm Parallel LoRA -> ROCm Parallel Model
(TP 2, and context: ring 2) -> the same sampler on 2 CPU workers. The three saved latents must agree
within 1e-4, the LoRA must have moved ComfyUI's own result, and ComfyUI must have logged no key it did not
apply, so nothing is compared against a reference written by hand.

The models are the comfy tier's own small FLUX.1 [dev] and FLUX.2 (tests/comfy/comfy_server.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from comfy_server import FLUX2_CASES, FLUX2_CHECKPOINT, Comfy, loader_node
from safetensors.torch import load_file
from test_sampling import FLUX2_MODELS
from test_sampling import MODELS as FLUX1_MODELS

from rocm_parallel.testing.models import tiny_flux2_config, tiny_flux_config
from rocm_parallel.testing.writers import write_random_lora

pytestmark = [pytest.mark.comfy, pytest.mark.timeout(3000)]

# Conditioning comes from the reference file's cases (RPTestReferenceConditioning): dev_4steps holds FLUX.1
# [dev]'s text and pooled vector, flux2_4steps FLUX.2's text.
MODELS: dict[str, dict[str, Any]] = {
    "flux1": {
        "file": "tiny-flux-dev.safetensors",
        "config": tiny_flux_config(**FLUX1_MODELS["dev"]["config"]),
        "case": "dev_4steps",
    },
    "flux2": {
        "file": FLUX2_CHECKPOINT,
        "config": tiny_flux2_config(**FLUX2_MODELS["flux2"]["config"]) if FLUX2_MODELS else {},
        "case": "flux2_4steps",
    },
}
# name -> (family, key format, kind, DoRA axis, bias differences, strength)
ADAPTERS: dict[str, tuple[str, str, str, str | None, bool, float]] = {
    "flux1-lora-kohya": ("flux1", "kohya", "lora", None, False, 0.8),
    "flux1-loha-bfl": ("flux1", "bfl", "loha", None, False, 0.8),
    "flux1-lokr-lycoris": ("flux1", "lycoris", "lokr", None, False, 1.0),
    "flux1-lokr_full-bfl": ("flux1", "bfl", "lokr_full", None, False, 0.8),
    "flux1-lokr_both-peft": ("flux1", "peft", "lokr_both", None, False, -0.7),
    "flux1-diff-bias-bfl": ("flux1", "bfl", "diff", None, True, 0.8),
    "flux1-diff-bias-peft": ("flux1", "peft", "diff", None, True, 1.0),
    "flux1-dora_output-lora-bfl": ("flux1", "bfl", "lora", "output", False, 0.8),
    "flux1-dora_input-lora-lycoris": ("flux1", "lycoris", "lora", "input", False, 1.0),
    "flux1-dora_input-loha-kohya": ("flux1", "kohya", "loha", "input", False, 0.8),
    "flux1-dora_output-lokr-peft": ("flux1", "peft", "lokr", "output", False, 0.8),
    "flux1-dora_input-lokr_both-bfl": ("flux1", "bfl", "lokr_both", "input", False, 0.6),
    "flux2-lora-bfl": ("flux2", "bfl", "lora", None, False, 0.8),
    "flux2-loha-kohya": ("flux2", "kohya", "loha", None, False, 0.8),
    "flux2-lokr-bfl": ("flux2", "bfl", "lokr", None, False, 1.0),
    "flux2-diff-kohya": ("flux2", "kohya", "diff", None, False, 0.8),
    "flux2-dora_input-lora-kohya": ("flux2", "kohya", "lora", "input", False, 0.8),
    "flux2-dora_output-lokr_both-bfl": ("flux2", "bfl", "lokr_both", "output", False, 1.0),
}
LAYOUTS = {"tp": ("tp", 0, 0), "ring": ("context", 2, 0)}
# ComfyUI's log lines when it maps a key to nothing (comfy/lora.py, comfy/sd.py) or an adapter fails
# (comfy/weight_adapter/*.py "ERROR <name> <key> <error>").
NOT_APPLIED = (
    "lora key not loaded",
    "NOT LOADED",
    "ERROR lora",
    "ERROR loha",
    "ERROR lokr",
    "WEIGHT NOT MERGED",
)


def _needs_flux2(comfy: Comfy) -> None:
    if not FLUX2_CASES or "EmptyFlux2LatentImage" not in comfy.get("/object_info/EmptyFlux2LatentImage"):
        pytest.skip("this ComfyUI has no FLUX.2")


@pytest.fixture(scope="module")
def lora_files(comfy: Comfy) -> Iterator[Path]:
    """The adapters in models/loras, removed afterwards."""
    loras = comfy.base / "models" / "loras"
    loras.mkdir(parents=True, exist_ok=True)
    written = []
    for seed, (name, (family, fmt, kind, dora, bias, _)) in enumerate(sorted(ADAPTERS.items())):
        if family == "flux2" and not FLUX2_MODELS:
            continue
        path = loras / f"rp-{name}.safetensors"
        config = MODELS[family]["config"]
        write_random_lora(path, config, fmt, kind=kind, dora=dora, bias=bias, seed=seed, family=family)
        written.append(path)
    yield loras
    for path in written:
        path.unlink()


def _conditioning(family: str) -> dict[str, Any]:
    case = MODELS[family]["case"]
    guidance = 3.5 if family == "flux1" else FLUX2_CASES[case]["guidance"]
    return {
        "c1": {"class_type": "RPTestReferenceConditioning", "inputs": {"case": case}},
        "c2": {"class_type": "FluxGuidance", "inputs": {"conditioning": ["c1", 0], "guidance": guidance}},
    }


def _sampler(family: str, model: list, prefix: str, tag: str) -> dict[str, Any]:
    """The family's sampling graph on `model`, saved under `prefix` (node ids prefixed with `tag`)."""
    if family == "flux1":
        return {
            f"{tag}l": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
            f"{tag}k": {"class_type": "KSampler", "inputs": {
                "model": model, "positive": ["c2", 0], "negative": ["c2", 0], "latent_image": [f"{tag}l", 0],
                "seed": 42, "steps": 3, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
            f"{tag}s": {"class_type": "SaveLatent", "inputs": {"samples": [f"{tag}k", 0], "filename_prefix": prefix}},
        }  # fmt: skip
    case = FLUX2_CASES[MODELS["flux2"]["case"]]
    size = {"width": case["width"], "height": case["height"]}
    return {
        f"{tag}g": {"class_type": "BasicGuider", "inputs": {"model": model, "conditioning": ["c2", 0]}},
        f"{tag}n": {"class_type": "RandomNoise", "inputs": {"noise_seed": case["seed"]}},
        f"{tag}x": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}},
        f"{tag}h": {"class_type": "Flux2Scheduler", "inputs": {"steps": 3, **size}},
        f"{tag}l": {"class_type": "EmptyFlux2LatentImage", "inputs": {**size, "batch_size": 1}},
        f"{tag}k": {"class_type": "SamplerCustomAdvanced", "inputs": {
            "noise": [f"{tag}n", 0], "guider": [f"{tag}g", 0], "sampler": [f"{tag}x", 0],
            "sigmas": [f"{tag}h", 0], "latent_image": [f"{tag}l", 0]}},
        f"{tag}s": {"class_type": "SaveLatent", "inputs": {"samples": [f"{tag}k", 0], "filename_prefix": prefix}},
    }  # fmt: skip


def _comfyui_branch(family: str, lora: str | None, strength: float, prefix: str) -> dict[str, Any]:
    """ComfyUI's own model (its loader), with ComfyUI's own LoraLoaderModelOnly when `lora` is given."""
    config = MODELS[family]["config"]
    loader = {
        "unet_name": MODELS[family]["file"],
        "num_heads": config["num_attention_heads"],
        "axes_dim": json.dumps(list(config["axes_dims_rope"])),
    }
    nodes: dict[str, Any] = {"u": {"class_type": "RPTestTinyUNETLoader", "inputs": loader}}
    model = ["u", 0]
    if lora is not None:
        nodes["ul"] = {
            "class_type": "LoraLoaderModelOnly",
            "inputs": {"model": model, "lora_name": lora, "strength_model": strength},
        }
        model = ["ul", 0]
    return {**nodes, **_sampler(family, model, prefix, "o")}


def _pack_branch(family: str, lora: str, strength: float, layout: str, prefix: str) -> dict[str, Any]:
    """The ROCm Parallel Loader -> ROCm Parallel LoRA -> ROCm Parallel Model (`layout`) on 2 CPU workers."""
    kind, ring, ulysses = LAYOUTS[layout]
    loader = loader_node(MODELS[family]["file"])
    loader["inputs"]["preload"] = "none"
    tag = f"p{layout}"
    nodes = {
        f"{tag}a": loader,
        f"{tag}b": {"class_type": "RocmParallelLoRA",
                    "inputs": {"parallel_flux": [f"{tag}a", 0], "lora_name": lora, "strength_model": strength}},
        f"{tag}c": {"class_type": "RocmParallelModel",
                    "inputs": {"parallel_flux": [f"{tag}b", 0], "layout": kind, "ring_degree": ring,
                               "ulysses_degree": ulysses}},
    }  # fmt: skip
    return {**nodes, **_sampler(family, [f"{tag}c", 0], prefix, tag)}


def _run(comfy: Comfy, prompt: dict[str, Any]) -> str:
    """Queue `prompt`, wait, and return what ComfyUI logged meanwhile."""
    start = comfy.log.stat().st_size
    entry = comfy.wait_done(comfy.post("/prompt", {"prompt": prompt, "client_id": "rp-lora"})["prompt_id"])
    assert entry["status"]["status_str"] == "success", entry["status"]
    with open(comfy.log, "rb") as f:
        f.seek(start)
        return f.read().decode(errors="replace")


def _saved(comfy: Comfy, prefix: str) -> torch.Tensor:
    files = sorted((comfy.base / "output").glob(f"{prefix}_*.latent"))
    assert len(files) == 1, files
    return load_file(str(files[0]))["latent_tensor"]


@pytest.fixture(scope="module")
def without_lora(comfy: Comfy) -> dict[str, torch.Tensor]:
    """ComfyUI's own result without any LoRA, per family (what every LoRA must move away from)."""
    out = {}
    for family in MODELS:
        if family == "flux2" and not FLUX2_CASES:
            continue
        _run(comfy, {**_conditioning(family), **_comfyui_branch(family, None, 0.0, f"rplora/{family}-plain")})
        out[family] = _saved(comfy, f"rplora/{family}-plain")
    return out


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_each_adapter_kind_matches_comfyuis_lora_loader(
    comfy: Comfy, lora_files: Path, without_lora: dict[str, torch.Tensor], name: str
) -> None:
    family, _, _, _, _, strength = ADAPTERS[name]
    if family == "flux2":
        _needs_flux2(comfy)
    lora = f"rp-{name}.safetensors"
    prompt = {**_conditioning(family), **_comfyui_branch(family, lora, strength, f"rplora/{name}-comfyui")}
    for layout in LAYOUTS:
        prompt.update(_pack_branch(family, lora, strength, layout, f"rplora/{name}-{layout}"))
    log = _run(comfy, prompt)
    skipped = [line for line in log.splitlines() if any(s in line for s in NOT_APPLIED)]
    assert skipped == [], f"ComfyUI did not apply all of {lora}: {skipped[:5]}"
    want = _saved(comfy, f"rplora/{name}-comfyui")
    effect = (want - without_lora[family]).abs().max().item()
    assert effect > 1e-2, f"{name}: the LoRA moved ComfyUI's own result by only {effect:.2e}"
    for layout in LAYOUTS:
        diff = (_saved(comfy, f"rplora/{name}-{layout}") - want).abs().max().item()
        print(
            f"{name} {layout}: max |diff| vs ComfyUI's LoraLoaderModelOnly {diff:.2e} (LoRA effect {effect:.2e})"
        )
        assert diff <= 1e-4, f"{name} {layout}: {diff:.2e}"
