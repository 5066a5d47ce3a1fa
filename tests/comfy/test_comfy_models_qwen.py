"""Qwen-Image on the model engine through `/prompt`: ComfyUI's own model against the ROCm Parallel Model.

One API prompt holds both branches on the same ComfyUI-built file (tests/tools/comfy_models.py: ComfyUI's
own classes and ModelSave): ComfyUI's own loader (RPTestTinyUNETLoader, its detection told the small heads,
head width, text width and RoPE axes) and the ROCm Parallel Loader -> RPTestComfyEngine (engine 'comfy', the
same values) -> ROCm Parallel Model in each layout. Both run ComfyUI's KSampler with cfg > 1 and a negative
prompt whose last tokens are padding (a text mask, as Qwen-Image's text encoder gives one); Edit-2511 with a
reference latent on both prompts (ComfyUI's own ReferenceLatent node). The latents must agree within 1e-4.

    COMFYUI_PATH=<ComfyUI checkout> PYTHONPATH=<stand-ins>:<pack parent> \\
        python -m pytest -q tests/comfy/test_comfy_models_qwen.py
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
import torch
from comfy_server import COMFYUI_PATH, TESTS_DIR, Comfy, run_prompt, saved_latent
from test_comfy_models import LAYOUTS, saving

pytestmark = [pytest.mark.comfy, pytest.mark.timeout(3000)]

TOL = 1e-4
MODELS = ("qwen-image", "qwen-image-edit-2511")


def checkpoint(name: str) -> str:
    return f"engine-{name}.safetensors"


@pytest.fixture(scope="module")
def widths(comfy: Comfy) -> dict[str, dict[str, Any]]:
    """Each model built and saved by this ComfyUI's own classes in the server's diffusion_models; name ->
    what both sides' detection is told."""
    sys.path.insert(0, str(TESTS_DIR / "tools"))
    import comfy_models

    own = comfy_models.import_comfy(COMFYUI_PATH)
    out = {}
    for name in MODELS:
        spec = dict(comfy_models.MODELS[name])
        path = comfy.base / "models" / "diffusion_models" / checkpoint(name)
        comfy_models.model_save(own, comfy_models.build(own, spec, torch.float32), path)
        out[name] = comfy_models.widths(spec)
    return out


def prompt(name: str, widths: dict[str, Any], layout: str, devices: str, seed: int) -> dict[str, Any]:
    """ComfyUI's own model (node 10) and the pack's in `layout` (nodes 20-), the same KSampler on each."""
    told = json.dumps(widths)
    sampler = {
        "seed": seed, "steps": 3, "cfg": 2.5, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0,
        "positive": ["1", 0], "negative": ["2", 0], "latent_image": ["5", 0],
    }  # fmt: skip
    nodes: dict[str, Any] = {
        "1": {"class_type": "RPTestSeededConditioning", "inputs": {"seed": 9, "tokens": 7, "width": 32}},
        "2": {"class_type": "RPTestSeededConditioning", "inputs": {"seed": 10, "tokens": 7, "width": 32, "padding": 2}},
        "5": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 80, "height": 112, "batch_size": 1}},
        "10": {"class_type": "RPTestTinyUNETLoader", "inputs": {
            "unet_name": checkpoint(name), "num_heads": 0, "axes_dim": "[]", "overrides": told}},
        "20": {"class_type": "RocmParallelLoader", "inputs": {
            "checkpoint": checkpoint(name), "devices": devices, "dtype": "float32", "preload": "none",
            "weight_dtype": "default"}},
        "21": {"class_type": "RPTestComfyEngine", "inputs": {"parallel_flux": ["20", 0], "detection": told}},
        "30": {"class_type": "RocmParallelModel", "inputs": {
            "parallel_flux": ["21", 0], "layout": layout, "ring_degree": 0, "ulysses_degree": 0}},
    }  # fmt: skip
    if (
        name == "qwen-image-edit-2511"
    ):  # a reference latent [1, 16, 1, 5, 7] (12 tokens, padded) on both prompts
        nodes["6"] = {
            "class_type": "RPTestReferenceLatent",
            "inputs": {"case": "kontext_2steps", "index": 0, "frame_axis": True},
        }
        for cond, source in (("3", "1"), ("4", "2")):
            nodes[cond] = {
                "class_type": "ReferenceLatent",
                "inputs": {"conditioning": [source, 0], "latent": ["6", 0]},
            }
        sampler |= {"positive": ["3", 0], "negative": ["4", 0]}
    nodes["40"] = {"class_type": "KSampler", "inputs": {"model": ["10", 0], **sampler}}
    nodes["41"] = {"class_type": "KSampler", "inputs": {"model": ["30", 0], **sampler}}
    return {**nodes, **saving(f"{name}_{layout.replace(' ', '')}")}


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=lambda s: s.replace(" ", ""))
@pytest.mark.parametrize("name", MODELS)
def test_qwen_image_on_the_engine_through_prompt_equals_comfyuis_own_model(
    comfy: Comfy, widths, name: str, layout: str
) -> None:
    run_prompt(comfy, prompt(name, widths[name], layout, LAYOUTS[layout], seed=51), f"engine-{name}-{layout}")
    tag = f"{name}_{layout.replace(' ', '')}"
    own, pack = saved_latent(comfy, f"engine/comfy_{tag}"), saved_latent(comfy, f"engine/pack_{tag}")
    diff = (own - pack).abs().max().item()
    print(f"engine {name} {layout}: max |diff| {diff:.2e}, |latent| {own.abs().max().item():.2f}")
    assert diff <= TOL
