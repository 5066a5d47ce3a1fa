"""The model engine through `/prompt`: ComfyUI's own model against the ROCm Parallel Model on engine 'comfy'.

One API prompt holds both branches on the same ComfyUI-built file (tests/tools/comfy_models.py: ComfyUI's
own classes and ModelSave): ComfyUI's own loader (RPTestTinyUNETLoader: comfy.sd.load_diffusion_model, its
detection told the small head count and RoPE axes) with ComfyUI's LoraLoaderModelOnly, and the ROCm Parallel
Loader -> RPTestComfyEngine (the handle on engine 'comfy', the same detection values) -> ROCm Parallel LoRA ->
ROCm Parallel Model in each layout. Both run ComfyUI's KSampler with cfg > 1 and a negative prompt; the
latents must agree within 1e-4.

    COMFYUI_PATH=<ComfyUI checkout> PYTHONPATH=<stand-ins>:<pack parent> \\
        python -m pytest -q tests/comfy/test_comfy_models.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from comfy_server import COMFYUI_PATH, TESTS_DIR, Comfy, run_prompt, saved_latent
from test_engine import write_loras

pytestmark = [pytest.mark.comfy, pytest.mark.timeout(3000)]

TOL = 1e-4
LAYOUTS = {"tp": "cpu x2", "ring 2": "cpu x2", "ulysses 2": "cpu x2", "ring 2 x tp 2": "cpu x4"}
# model -> (its reference case's prompt, negative prompt node, empty latent node, latent size); FLUX.2's
# negative is another case's prompt (0.3.75's Flux2 reads `pooled_output` from every cond: None there)
MODELS = {
    "flux1-dev": ("cfg_negative", {"class_type": "RPTestReferenceConditioning", "inputs": {"case": "cfg_negative:neg"}},
                  "EmptySD3LatentImage", (48, 40)),
    "flux2-dev": ("flux2_4steps", {"class_type": "RPTestReferenceConditioning", "inputs": {"case": "flux2_ref_2steps"}},
                  "EmptyFlux2LatentImage", (80, 48)),
}  # fmt: skip


def checkpoint(name: str) -> str:
    return f"engine-{name}.safetensors"


@pytest.fixture(scope="module")
def files(comfy: Comfy) -> dict[str, Any]:
    """FLUX.1 [dev] and FLUX.2 [dev] built and saved by this ComfyUI's own classes in the server's
    diffusion_models, and LoRAs for each in its loras folder."""
    sys.path.insert(0, str(TESTS_DIR / "tools"))
    import comfy_models

    own = comfy_models.import_comfy(COMFYUI_PATH)
    loras = comfy.base / "models" / "loras"
    loras.mkdir(parents=True, exist_ok=True)
    out = {}
    for name in MODELS:
        spec = dict(comfy_models.MODELS[name])
        path = comfy.base / "models" / "diffusion_models" / checkpoint(name)
        comfy_models.model_save(own, comfy_models.build(own, spec, torch.float32), path)
        written = write_loras(loras, str(path))
        out[name] = {"widths": comfy_models.widths(spec), "loras": [(Path(p).name, s) for p, s in written]}
    return out


def prompt(name: str, files: dict[str, Any], layout: str, devices: str, seed: int) -> dict[str, Any]:
    """ComfyUI's own model (nodes 10-) and the pack's in `layout` (nodes 20-), the same KSampler on each."""
    widths, loras = files[name]["widths"], files[name]["loras"]
    case, negative, empty, (width, height) = MODELS[name]
    sampler = {
        "seed": seed, "steps": 3, "cfg": 2.5, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0,
        "positive": ["2", 0], "negative": ["4", 0], "latent_image": ["5", 0],
    }  # fmt: skip
    nodes: dict[str, Any] = {
        "1": {"class_type": "RPTestReferenceConditioning", "inputs": {"case": case}},
        "2": {"class_type": "FluxGuidance", "inputs": {"conditioning": ["1", 0], "guidance": 3.5}},
        "3": negative,
        "4": {"class_type": "FluxGuidance", "inputs": {"conditioning": ["3", 0], "guidance": 3.5}},
        "5": {"class_type": empty, "inputs": {"width": width, "height": height, "batch_size": 1}},
        "10": {"class_type": "RPTestTinyUNETLoader", "inputs": {
            "unet_name": checkpoint(name), "num_heads": widths["num_heads"], "axes_dim": json.dumps(widths["axes_dim"])}},
        "20": {"class_type": "RocmParallelLoader", "inputs": {
            "checkpoint": checkpoint(name), "devices": devices, "dtype": "float32", "preload": "none",
            "weight_dtype": "default"}},
        "21": {"class_type": "RPTestComfyEngine", "inputs": {"parallel_flux": ["20", 0], "detection": json.dumps(widths)}},
    }  # fmt: skip
    own, parallel = ["10", 0], ["21", 0]
    for i, (lora, strength) in enumerate(loras):
        nodes[str(11 + i)] = {"class_type": "LoraLoaderModelOnly",
                              "inputs": {"model": own, "lora_name": lora, "strength_model": strength}}  # fmt: skip
        nodes[str(22 + i)] = {"class_type": "RocmParallelLoRA",
                              "inputs": {"parallel_flux": parallel, "lora_name": lora, "strength_model": strength}}  # fmt: skip
        own, parallel = [str(11 + i), 0], [str(22 + i), 0]
    nodes["30"] = {"class_type": "RocmParallelModel",
                   "inputs": {"parallel_flux": parallel, "layout": layout, "ring_degree": 0, "ulysses_degree": 0}}  # fmt: skip
    nodes["40"] = {"class_type": "KSampler", "inputs": {"model": own, **sampler}}
    nodes["41"] = {"class_type": "KSampler", "inputs": {"model": ["30", 0], **sampler}}
    return {**nodes, **saving(f"{name}_{layout.replace(' ', '')}")}


def saving(tag: str) -> dict[str, Any]:
    """SaveLatent nodes for ComfyUI's KSampler (node 40) and the pack's (41): engine/{comfy,pack}_<tag>."""
    return {
        node: {
            "class_type": "SaveLatent",
            "inputs": {"samples": [sampler, 0], "filename_prefix": f"engine/{side}_{tag}"},
        }
        for node, sampler, side in (("50", "40", "comfy"), ("51", "41", "pack"))
    }


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=lambda s: s.replace(" ", ""))
@pytest.mark.parametrize("name", list(MODELS))
def test_the_engine_through_prompt_equals_comfyuis_own_model(
    comfy: Comfy, files, name: str, layout: str
) -> None:
    """The pack's branch is on the engine: the default engine's LoRA node would refuse the norm's `.diff`."""
    log = run_prompt(comfy, prompt(name, files, layout, LAYOUTS[layout], seed=51), f"engine-{name}-{layout}")
    tag = f"{name}_{layout.replace(' ', '')}"
    own, pack = saved_latent(comfy, f"engine/comfy_{tag}"), saved_latent(comfy, f"engine/pack_{tag}")
    diff = (own - pack).abs().max().item()
    print(f"engine {name} {layout}: max |diff| {diff:.2e}, |latent| {own.abs().max().item():.2f}")
    assert "lora key not loaded" not in log  # ComfyUI's own branch applied every key too
    assert diff <= TOL
