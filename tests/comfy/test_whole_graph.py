"""The whole FLUX.1 graph on ONE worker group through a real ComfyUI server's `/prompt`, queued once.

The graph the pack is built for: the pack's Text Encoder Loader (T5-XXL sharded on the workers, CLIP-L in
ComfyUI) under ComfyUI's CLIPTextEncode and FluxGuidance, the ROCm Parallel Loader and Model under ComfyUI's
KSampler, and ROCm Parallel VAE Decode, all on the same devices (`cpu x2`), so the encoder, the diffusion
model and the VAE are resident side by side on one group. Queued ONCE and it must succeed: its first run is
the one a user sees (the first VAE decode on a group holding a pack text encoder once failed with
"'VaeLoadRequest' object has no attribute 'layout'", and only a second queue worked).

ComfyUI's own graph runs on the same files: its DualCLIPLoader's loader (comfy.sd.load_clip, type flux, told
the small T5's config), its UNETLoader's loader (told the small heads and RoPE axes), KSampler, its VAELoader
and VAEDecode. The files are built with ComfyUI's OWN classes: a small T5-XXL (`comfy.text_encoders.t5.T5`), the
released CLIP-L (`comfy.clip_model.CLIPTextModel`: the pack's loader leaves ComfyUI its own CLIP-L config), a
small FLUX.1-dev (tests/tools/comfy_models.py: ComfyUI's Flux, written by its ModelSave) and the released
FLUX.1 VAE (`AutoencodingEngine`, as test_comfy_vae.py builds it), all with random weights. The decoded
images agree within 1e-4.

    COMFYUI_PATH=/path/to/ComfyUI python -m pytest -q -s -m comfy tests/comfy/test_whole_graph.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from comfy_server import COMFYUI_PATH, Comfy, run_prompt, status_prompt
from safetensors.torch import load_file, save_file

pytestmark = [pytest.mark.comfy, pytest.mark.timeout(1800)]

TOLERANCE = 1e-4  # pixel values in 0..1
PROMPT = "a lighthouse on a cliff at dusk, oil painting"
DEVICES = "cpu x2"
T5, CLIP_L, MODEL, VAE = (
    "graph-t5xxl.safetensors",
    "graph-clip-l.safetensors",
    "graph-flux1-dev.safetensors",
    "graph-flux1-vae.safetensors",
)
# ComfyUI's detection reads the text and pooled widths from the shapes: T5's (small) and CLIP-L's (768)
MODEL_SPEC = {"family": "flux", "in": 64, "text": 32, "pooled": 768, "guidance": True, "seed": 53}


def _save_files(base: Path) -> dict[str, Any]:
    """The four files in the server's model folders, built with ComfyUI's classes in this process; the small
    T5's config (ComfyUI's own loader must be told it)."""
    import comfy_models
    from make_comfy_references import import_comfy
    from test_comfy_encoders import TINY_T5, _randomize
    from test_comfy_vae import _comfy_model

    from rocm_parallel.testing.vae_files import random_weights

    import_comfy(COMFYUI_PATH)
    tool = comfy_models.import_comfy(COMFYUI_PATH)
    import comfy.clip_model
    import comfy.ops
    import comfy.text_encoders.t5

    folders = {name: base / "models" / name for name in ("text_encoders", "diffusion_models", "vae")}
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
    ops = comfy.ops.manual_cast
    t5 = comfy.text_encoders.t5.T5(TINY_T5, torch.float32, "cpu", ops)
    save_file(_randomize(t5, 31), str(folders["text_encoders"] / T5))
    del t5
    with open(Path(COMFYUI_PATH) / "comfy" / "sd1_clip_config.json") as f:
        clip_l = comfy.clip_model.CLIPTextModel(json.load(f), torch.float32, "cpu", ops)
    save_file(_randomize(clip_l, 32), str(folders["text_encoders"] / CLIP_L))
    del clip_l
    with torch.no_grad():
        comfy_models.model_save(
            tool, comfy_models.build(tool, MODEL_SPEC, torch.float32), folders["diffusion_models"] / MODEL
        )
    shapes = {k: tuple(v.shape) for k, v in _comfy_model("flux1-vae").state_dict().items()}
    save_file(random_weights(shapes), str(folders["vae"] / VAE))
    return {"t5": TINY_T5, "widths": comfy_models.widths(MODEL_SPEC)}


def _graph(
    prefix: str, clip: dict[str, Any], model: dict[str, Any], decode: dict[str, Any]
) -> dict[str, Any]:
    """FLUX.1-dev's text-to-image graph around the given loaders and decode (node ids "1", "4"/"5", "8"):
    CLIPTextEncode, FluxGuidance 3.5, a 64 x 48 latent, KSampler (euler, simple, 3 steps, cfg 1.0), the image
    saved as a tensor under `prefix`."""
    graph: dict[str, Any] = {
        "1": clip,
        "2": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 0], "text": PROMPT}},
        "3": {"class_type": "FluxGuidance", "inputs": {"conditioning": ["2", 0], "guidance": 3.5}},
        **model,
        "6": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 48, "batch_size": 1}},
        "7": {
            "class_type": "KSampler",
            "inputs": {
                "model": ["5", 0],
                "positive": ["3", 0],
                "negative": ["3", 0],
                "latent_image": ["6", 0],
                "seed": 7,
                "steps": 3,
                "cfg": 1.0,
                "sampler_name": "euler",
                "scheduler": "simple",
                "denoise": 1.0,
            },
        },
        **decode,
        "9": {
            "class_type": "RPTestSaveImageTensor",
            "inputs": {"images": ["8", 0], "filename_prefix": prefix},
        },
    }
    return graph


def _own_graph(files: dict[str, Any]) -> dict[str, Any]:
    widths = files["widths"]
    return _graph(
        "graph-own",
        {
            "class_type": "RPTestTinyCLIPLoader",
            "inputs": {
                "clip_name": f"{T5},{CLIP_L}",
                "type": "flux",
                "options": json.dumps({"t5xxl_model_config": files["t5"]}),
            },
        },
        {
            "5": {
                "class_type": "RPTestTinyUNETLoader",
                "inputs": {
                    "unet_name": MODEL,
                    "num_heads": widths["num_heads"],
                    "axes_dim": json.dumps(widths["axes_dim"]),
                },
            }
        },
        {
            "10": {"class_type": "VAELoader", "inputs": {"vae_name": VAE}},
            "8": {"class_type": "VAEDecode", "inputs": {"samples": ["7", 0], "vae": ["10", 0]}},
        },
    )


def _pack_graph() -> dict[str, Any]:
    """The pack's nodes where the graph loads and decodes, every one on DEVICES (the loader's defaults
    otherwise: preload none, the dtype a CPU worker computes in)."""
    return _graph(
        "graph-pack",
        {
            "class_type": "RocmParallelTextEncoderLoader",
            "inputs": {"clip_name1": T5, "clip_name2": CLIP_L, "type": "flux", "devices": DEVICES},
        },
        {
            "4": {
                "class_type": "RocmParallelLoader",
                "inputs": {
                    "checkpoint": MODEL,
                    "devices": DEVICES,
                    "dtype": "default",
                    "preload": "none",
                    "weight_dtype": "default",
                },
            },
            "5": {
                "class_type": "RocmParallelModel",
                "inputs": {"parallel_flux": ["4", 0], "layout": "tp", "ring_degree": 0, "ulysses_degree": 0},
            },
        },
        {
            "8": {
                "class_type": "RocmParallelVAEDecode",
                "inputs": {"parallel_flux": ["4", 0], "samples": ["7", 0], "vae_name": VAE},
            }
        },
    )


def _image(comfy: Comfy, prefix: str) -> torch.Tensor:
    return load_file(str(comfy.base / "output" / f"{prefix}.safetensors"))["image"]


def _group_status(comfy: Comfy) -> dict[str, Any]:
    """The pack's status route: the group's panel state (what the loader's panel draws)."""
    return comfy.get("/rocm_parallel/status")


@pytest.mark.comfy_quick
def test_encoder_model_and_vae_decode_on_one_group_run_the_first_time(comfy: Comfy) -> None:
    files = _save_files(comfy.base)
    run_prompt(comfy, _own_graph(files), "graph-own")
    expected = _image(comfy, "graph-own")
    # a fresh group, whatever earlier tests of the session left resident: this is the graph's first run
    run_prompt(comfy, status_prompt("close"), "graph-close")
    # queued once: a failure here is what a user sees on the first run
    run_prompt(comfy, _pack_graph(), "graph-pack")
    got = _image(comfy, "graph-pack")
    diff = (got - expected).abs().max().item()
    print(f"\nthe whole graph on {DEVICES}, /prompt: {list(got.shape)}, max |pack - ComfyUI| {diff:.2e}")
    assert got.shape == expected.shape == (1, 48, 64, 3)
    assert expected.std() > 0.01  # an image, not a constant
    assert diff < TOLERANCE
    # the encoder, the model and the VAE were resident side by side on the one group of DEVICES
    children = psutil.Process(comfy.proc.pid).children(recursive=True)
    assert len([c for c in children if "backend.runtime.worker" in " ".join(c.cmdline())]) == 2
    state = _group_status(comfy)
    layouts = sorted(m["layout"] for m in state["models"])
    assert len(layouts) == 3 and layouts[0].startswith("VAE") and layouts[1].startswith("text encoder")
    assert state.get("error") is None
