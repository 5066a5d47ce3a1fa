"""The ROCm Parallel Text Encoder Loader through a real ComfyUI server's `/prompt` (comfy_server.py).

Two graphs on the same small Qwen2.5-VL file (built with ComfyUI's own `Llama2_` and `Qwen25_7BVLI_Config`,
saved as ComfyUI's qwen_2.5_vl_7b file keys it) in the server's models/text_encoders/, each queued with
`/prompt`: ComfyUI's own CLIPLoader (type qwen_image; a test node that calls the same comfy.sd.load_clip,
told the file's small config), and the pack's loader (type qwen_image, CPU workers), each under ComfyUI's
CLIPTextEncode and under TextEncodeQwenImageEditPlus with two reference images (ComfyUI's LoadImage; the
file holds ComfyUI's own vision tower too). A test node saves each conditioning; the pack's equals ComfyUI's
own within 1e-4, on 1, 2 and 4 workers. The same for FLUX.2 [dev]'s text encoder (type flux2: a small file of
ComfyUI's pruned Mistral Small 3 with its tekken tokenizer, tests/comfy/mistral_fixture.py) under
CLIPTextEncode (0.33.0; 0.3.75 cannot read Mistral's tokenizer with its venv's transformers: skipped, saying so).

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
EDIT = "put the cat from picture 1 on the sofa from picture 2"
FILE = "tiny-qwen25-vl-prompt.safetensors"


def _save_tiny_qwen(folder: Path) -> dict[str, Any]:
    """The small Qwen2.5-VL language model (test_comfy_encoders' shapes and weights) with ComfyUI's own vision
    tower beside it (`visual.*`, full size: its class takes no config; random bf16 weights), as Comfy-Org's
    qwen_2.5_vl_7b file holds both; ComfyUI's classes imported in this process. Returns the language model's
    config, which ComfyUI's own loader must be told."""
    from make_comfy_references import import_comfy
    from test_comfy_encoders import TINY_QWEN25, _randomize

    import_comfy(COMFYUI_PATH)
    import comfy.ops
    import comfy.text_encoders.llama as llama
    from comfy.text_encoders import qwen_vl

    ops = comfy.ops.manual_cast
    model = llama.Llama2_(
        llama.Qwen25_7BVLI_Config(**TINY_QWEN25), device="cpu", dtype=torch.float32, ops=ops
    )
    sd = {f"model.{k}": v for k, v in _randomize(model, 6).items()}
    del model
    tower = qwen_vl.Qwen2VLVisionTransformer(
        hidden_size=1280, output_hidden_size=TINY_QWEN25["hidden_size"], device="cpu", dtype=torch.float32, ops=ops
    )  # fmt: skip
    sd.update({f"visual.{k}": v.to(torch.bfloat16) for k, v in _randomize(tower, 7).items()})
    del tower
    folder.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(folder / FILE))
    return TINY_QWEN25


def _save_images(folder: Path) -> list[str]:
    """Two reference pictures of different sizes in the server's input/ folder, for ComfyUI's LoadImage."""
    from PIL import Image

    g = torch.Generator().manual_seed(8)
    names = []
    for i, (h, w) in enumerate(((48, 64), (72, 40))):
        pixels = (torch.rand(h, w, 3, generator=g) * 255).to(torch.uint8).numpy()
        names.append(f"te-reference-{i}.png")
        Image.fromarray(pixels).save(folder / names[-1])
    return names


def _encode_graph(loader: dict[str, Any], prefix: str, images: list[str]) -> dict[str, Any]:
    """The loader under ComfyUI's CLIPTextEncode and TextEncodeQwenImageEditPlus with two reference images
    (LoadImage; ComfyUI's vision tower in its process), each conditioning saved as <prefix>-<node>."""
    graph: dict[str, Any] = {
        "1": loader,
        "2": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 0], "text": PROMPT}},
        "3": {
            "class_type": "TextEncodeQwenImageEditPlus",
            "inputs": {"clip": ["1", 0], "prompt": EDIT, "image1": ["4", 0], "image2": ["5", 0]},
        },
        "4": {"class_type": "LoadImage", "inputs": {"image": images[0]}},
        "5": {"class_type": "LoadImage", "inputs": {"image": images[1]}},
    }
    for node in ("2", "3"):
        graph[f"{node}0"] = {
            "class_type": "RPTestSaveConditioning",
            "inputs": {"conditioning": [node, 0], "filename_prefix": f"{prefix}-{node}"},
        }
    return graph


def _saved(comfy: Comfy, prefix: str) -> list[dict[str, torch.Tensor]]:
    return [load_file(str(comfy.base / "output" / f"{prefix}-{node}.safetensors")) for node in ("2", "3")]


def _workers(comfy: Comfy) -> list[int]:
    """The pack's worker processes under the ComfyUI server."""
    children = psutil.Process(comfy.proc.pid).children(recursive=True)
    return [c.pid for c in children if "backend.runtime.worker" in " ".join(c.cmdline())]


@pytest.fixture(scope="module")
def comfys_own(comfy: Comfy) -> dict[str, Any]:
    """The small file in the server's models/text_encoders/ and ComfyUI's own graph's conditionings."""
    config = _save_tiny_qwen(comfy.base / "models" / "text_encoders")
    images = _save_images(comfy.base / "input")
    own = {
        "class_type": "RPTestTinyCLIPLoader",
        "inputs": {
            "clip_name": FILE,
            "type": "qwen_image",
            "options": json.dumps({"qwen25_7b_model_config": config}),
        },
    }
    run_prompt(comfy, _encode_graph(own, "te-own", images), "encoder-own")
    return {"config": config, "images": images, "saved": _saved(comfy, "te-own")}


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_the_loader_node_through_the_prompt_api_equals_comfyuis_cliploader(
    comfy: Comfy, comfys_own: dict[str, Any], workers: int
) -> None:
    ours = {
        "class_type": "RocmParallelTextEncoderLoader",
        "inputs": {
            "clip_name1": FILE,
            "clip_name2": "none",
            "type": "qwen_image",
            "devices": f"cpu x{workers}",
        },
    }
    graph = _encode_graph(ours, f"te-pack{workers}", comfys_own["images"])
    run_prompt(comfy, graph, f"encoder-pack{workers}")
    # the encode ran on the pack's workers: the server holds a group of that many (the last loader's devices)
    assert len(_workers(comfy)) >= workers
    text, edit = comfys_own["saved"]
    assert edit["cond"].shape[1] > text["cond"].shape[1] + 100  # the two images' tokens are in the prompt
    for expected, got in zip(comfys_own["saved"], _saved(comfy, f"te-pack{workers}"), strict=True):
        _assert_equal_conditioning(
            got, expected, comfys_own["config"]["hidden_size"], f"qwen_image, {workers}"
        )


def _assert_equal_conditioning(
    got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], width: int, label: str
) -> None:
    """A saved conditioning equals ComfyUI's own: the same keys, `cond` of `width` within 1e-4, the rest
    (attention masks) exactly."""
    assert sorted(got) == sorted(expected)
    assert got["cond"].shape == expected["cond"].shape and got["cond"].shape[-1] == width
    diff = (got["cond"] - expected["cond"]).abs().max().item()
    print(f"\n{label} worker(s), /prompt: max |pack - ComfyUI| {diff:.2e}, shape {tuple(got['cond'].shape)}")
    assert diff < TOLERANCE
    for key in set(expected) - {"cond"}:
        assert torch.equal(got[key], expected[key]), key


FLUX2_DEV_FILE = "tiny-mistral3-flux2-pruned-prompt.safetensors"


def _save_flux2_dev(folder: Path) -> dict[str, Any]:
    """FLUX.2 [dev]'s small pruned Mistral Small 3 with its tekken tokenizer (tests/comfy/mistral_fixture.py:
    ComfyUI's own class, imported in this process) in `folder`; the config ComfyUI's own loader is told."""
    from make_comfy_references import import_comfy
    from mistral_fixture import MISTRAL3_PRUNED, save_pruned_mistral
    from test_comfy_encoders import _flux2_dev_available

    import_comfy(COMFYUI_PATH)
    import comfy.ops
    import comfy.text_encoders.llama

    _flux2_dev_available(comfy)
    folder.mkdir(parents=True, exist_ok=True)
    save_pruned_mistral(comfy, folder / FLUX2_DEV_FILE, [PROMPT], seed=15)
    return MISTRAL3_PRUNED


@pytest.fixture(scope="module")
def comfys_own_flux2_dev(comfy: Comfy) -> dict[str, torch.Tensor]:
    """The file in the server's models/text_encoders/ and ComfyUI's own CLIPLoader's (type flux2)
    CLIPTextEncode of PROMPT."""
    config = _save_flux2_dev(comfy.base / "models" / "text_encoders")
    options = json.dumps({"mistral3_24b_model_config": config})
    own = {"class_type": "RPTestTinyCLIPLoader", "inputs": {"clip_name": FLUX2_DEV_FILE, "type": "flux2", "options": options}}  # fmt: skip
    run_prompt(comfy, _flux2_dev_graph(own, "dev-own"), "flux2-dev-own")
    return load_file(str(comfy.base / "output" / "dev-own.safetensors"))


def _flux2_dev_graph(loader: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {
        "1": loader,
        "2": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 0], "text": PROMPT}},
        "3": {"class_type": "RPTestSaveConditioning", "inputs": {"conditioning": ["2", 0], "filename_prefix": prefix}},
    }  # fmt: skip


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_the_flux2_dev_loader_through_the_prompt_api_equals_comfyuis_cliploader(
    comfy: Comfy, comfys_own_flux2_dev: dict[str, torch.Tensor], workers: int
) -> None:
    """FLUX.2 [dev]'s text encoder (type flux2) on `cpu x1/x2/x4` through `/prompt`: ComfyUI's own tokenizer
    read from the file, its template and three stacked layers, the language model on the workers."""
    ours = {
        "class_type": "RocmParallelTextEncoderLoader",
        "inputs": {"clip_name1": FLUX2_DEV_FILE, "clip_name2": "none", "type": "flux2", "devices": f"cpu x{workers}"},
    }  # fmt: skip
    run_prompt(comfy, _flux2_dev_graph(ours, f"dev-pack{workers}"), f"flux2-dev-pack{workers}")
    assert len(_workers(comfy)) >= workers
    got = load_file(str(comfy.base / "output" / f"dev-pack{workers}.safetensors"))
    _assert_equal_conditioning(got, comfys_own_flux2_dev, 3 * 5120, f"flux2 (Mistral), {workers}")
