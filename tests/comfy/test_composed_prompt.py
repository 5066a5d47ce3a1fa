"""A composed layout through a real ComfyUI server's /prompt, with the nodes as a user wires them: the ROCm
Parallel Model with layout 'batch 2 x tp 2' under ComfyUI's KSampler, and the TP Sampler with
batch_degree 2, on 4 CPU workers, cfg 2.5 with a negative prompt: both saved latents equal what ComfyUI
sampled with its own model (tests/data/comfy_references.safetensors), and the panel shows the layout.
"""

from __future__ import annotations

import pytest
import torch
from comfy_server import Comfy, loader_node, model_prompt
from safetensors.torch import load_file
from test_sampling import reference

pytestmark = pytest.mark.comfy


def _saved(comfy: Comfy, prefix: str) -> torch.Tensor:
    files = sorted((comfy.base / "output").glob(f"{prefix}_*.latent"))
    assert len(files) == 1, files
    return load_file(str(files[0]))["latent_tensor"]


@pytest.mark.comfy_quick
def test_cfg_and_negative_on_batch2_tp2_through_the_prompt_api(comfy: Comfy) -> None:
    case = "cfg_negative"
    prompt = model_prompt(case)
    prompt["4"] = {
        **loader_node(devices="cpu x4"),
        "inputs": {**loader_node(devices="cpu x4")["inputs"], "preload": "none"},
    }
    prompt["5"]["inputs"]["layout"] = "batch 2 x tp 2"
    prompt["7"]["inputs"]["filename_prefix"] = "composed/model"
    ks = prompt["6"]["inputs"]
    prompt["20"] = {
        "class_type": "RocmParallelTPSampler",
        "inputs": {
            "parallel_flux": ["4", 0],
            "positive": ks["positive"],
            "negative": ks["negative"],
            "latent_image": ks["latent_image"],
            "seed": ks["seed"],
            "steps": ks["steps"],
            "cfg": ks["cfg"],
            "sampler_name": ks["sampler_name"],
            "scheduler": ks["scheduler"],
            "denoise": 1.0,
            "batch_degree": 2,
        },
    }
    prompt["21"] = {
        "class_type": "SaveLatent",
        "inputs": {"samples": ["20", 0], "filename_prefix": "composed/tp_sampler"},
    }
    entry = comfy.wait_done(comfy.post("/prompt", {"prompt": prompt, "client_id": "rp-test"})["prompt_id"])
    assert entry["status"]["status_str"] == "success", entry["status"]
    expected = reference(case)["output"]
    for name in ("model", "tp_sampler"):
        diff = (_saved(comfy, f"composed/{name}") - expected).abs().max().item()
        print(f"{case} {name} batch 2 x tp 2 via /prompt: max |diff| {diff:.2e}")
        assert diff <= 1e-4, name
    state = comfy.get("/rocm_parallel/status")
    assert state["devices"] == ["cpu"] * 4 and state["layout"] == "batch 2 x tp 2"
    assert state.get("note") is None  # cond and uncond in one call: both TP pairs busy
