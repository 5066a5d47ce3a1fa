"""The ROCm Parallel Text Encoder Loader through a real ComfyUI server's `/prompt` (comfy_server.py).

Two graphs on the same small Qwen2.5-VL file (built with ComfyUI's own `Llama2_` and `Qwen25_7BVLI_Config`,
saved as ComfyUI's qwen_2.5_vl_7b file keys it) in the server's models/text_encoders/, each queued with
`/prompt`: ComfyUI's own CLIPLoader (type qwen_image; a test node that calls the same comfy.sd.load_clip,
told the file's small config) -> CLIPTextEncode, and the pack's loader (type qwen_image, 2 CPU workers) ->
CLIPTextEncode. A test node saves each conditioning; the pack's equals ComfyUI's own within 1e-4.

    source /work/comfy/env.sh 0.33.0 <pack checkout>
    python -m pytest -q -s -m comfy tests/comfy/test_comfy_encoder_prompt.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from comfy_server import COMFYUI_PATH, Comfy, run_prompt
from safetensors.torch import load_file, save_file

pytestmark = [pytest.mark.comfy, pytest.mark.timeout(1200)]

TOLERANCE = 1e-4
PROMPT = 'a neon sign that reads "ROCm" above a rainy street, night'
FILE = "tiny-qwen25-vl-prompt.safetensors"


def _save_tiny_qwen(folder: Path) -> dict[str, Any]:
    """The small Qwen2.5-VL language model (test_comfy_encoders' shapes and weights), with ComfyUI's classes
    imported in this process; returns its config, which ComfyUI's own loader must be told."""
    from make_comfy_references import import_comfy
    from test_comfy_encoders import TINY_QWEN25, _randomize

    import_comfy(COMFYUI_PATH)
    import comfy.ops
    import comfy.text_encoders.llama as llama

    model = llama.Llama2_(
        llama.Qwen25_7BVLI_Config(**TINY_QWEN25), device="cpu", dtype=torch.float32, ops=comfy.ops.manual_cast
    )
    folder.mkdir(parents=True, exist_ok=True)
    save_file({f"model.{k}": v for k, v in _randomize(model, 6).items()}, str(folder / FILE))
    return TINY_QWEN25


def _encode_graph(loader: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {
        "1": loader,
        "2": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 0], "text": PROMPT}},
        "3": {
            "class_type": "RPTestSaveConditioning",
            "inputs": {"conditioning": ["2", 0], "filename_prefix": prefix},
        },
    }


def _workers(comfy: Comfy) -> list[int]:
    """The pack's worker processes under the ComfyUI server."""
    children = psutil.Process(comfy.proc.pid).children(recursive=True)
    return [c.pid for c in children if "backend.worker" in " ".join(c.cmdline())]


def test_the_loader_node_through_the_prompt_api_equals_comfyuis_cliploader(comfy: Comfy) -> None:
    config = _save_tiny_qwen(comfy.base / "models" / "text_encoders")
    own = {
        "class_type": "RPTestTinyCLIPLoader",
        "inputs": {
            "clip_name": FILE,
            "type": "qwen_image",
            "options": json.dumps({"qwen25_7b_model_config": config}),
        },
    }
    ours = {
        "class_type": "RocmParallelTextEncoderLoader",
        "inputs": {"clip_name1": FILE, "clip_name2": "none", "type": "qwen_image", "devices": "cpu x2"},
    }
    run_prompt(comfy, _encode_graph(own, "te-own"), "encoder-own")
    run_prompt(comfy, _encode_graph(ours, "te-pack"), "encoder-pack")
    expected, got = (load_file(str(comfy.base / "output" / f"te-{n}.safetensors")) for n in ("own", "pack"))
    assert sorted(got) == sorted(expected)
    assert got["cond"].shape == expected["cond"].shape and got["cond"].shape[-1] == config["hidden_size"]
    diff = (got["cond"] - expected["cond"]).abs().max().item()
    print(
        f"\nqwen_image CLIP through /prompt: max |pack - ComfyUI| {diff:.2e}, shape {tuple(got['cond'].shape)}"
    )
    assert diff < TOLERANCE
    for key in set(expected) - {"cond"}:
        assert torch.equal(got[key], expected[key]), key
    # the encode ran on the pack's workers: the server holds a group of (at least) two
    assert len(_workers(comfy)) >= 2
