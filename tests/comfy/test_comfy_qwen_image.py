"""Qwen-Image and Qwen-Image-Edit graphs on the ROCm Parallel Model, in a real ComfyUI imported in this process.

Each case of tests/tools/make_qwen_references.py (ComfyUI's Qwen-Image templates: ModelSamplingAuraFlow,
CFGNorm, ReferenceLatent, the reference-method node, KSampler with cfg > 1 and a negative prompt, a text mask
where a prompt has padding, a LoRA in one of the key formats ComfyUI maps for QwenImage) runs again with the
pack's MODEL (nodes/comfy_model.py: ComfyUI's own QwenImage around the proxy) over real CPU workers, the
LoRA applied by the pack, and must equal what the same ComfyUI version sampled with its own model
(tests/data/qwen_references_<version>.safetensors) within 1e-4, in TP 2, ring 2, Ulysses 2,
ring 2 x Ulysses 2 and, for the cases at cfg > 1, batch 2 x tp 2 (cond and uncond split over two TP pairs).

    COMFYUI_PATH=/path/to/ComfyUI python -m pytest -q -s -m comfy tests/comfy/test_comfy_qwen_image.py
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from comfy_server import COMFYUI_PATH, TESTS_DIR

from rocm_parallel.backend.config import ParallelLayout
from rocm_parallel.backend.diffusion.api import ParallelModel
from rocm_parallel.nodes.inputs import LayoutRequest, ParallelHandle
from rocm_parallel.nodes.registry import Registry

pytestmark = [pytest.mark.comfy, pytest.mark.timeout(3000)]

sys.path.insert(0, str(TESTS_DIR / "tools"))
from make_qwen_references import CASES, MODELS, lora_file, references_path, run_case, write_model  # noqa: E402

LAYOUTS = {
    "tp2": (2, ParallelLayout(tp=2)),
    "ring2": (2, ParallelLayout(ring=2)),
    "ulysses2": (2, ParallelLayout(ulysses=2)),
    "ring2_ulysses2": (4, ParallelLayout(ring=2, ulysses=2)),
    "batch2_tp2": (4, ParallelLayout(batch=2, tp=2)),
}
# The batch degree splits one model call's batch: only the cases at cfg > 1 (cond + uncond, one call of 2)
# give both TP pairs an entry; at cfg 1 one pair would idle and the case would test nothing new.
QUICK_RUN = (
    "batch2_tp2",
    "qwen_t2i",
)  # the quick tier's (comfy_quick): composed, cfg 2.5 with a negative, a LoRA
RUNS = [
    pytest.param(layout, name, marks=pytest.mark.comfy_quick)
    if (layout, name) == QUICK_RUN
    else (layout, name)
    for name in sorted(CASES)
    for layout in sorted(LAYOUTS)
    if LAYOUTS[layout][1].batch == 1 or CASES[name].get("cfg", 1.0) > 1
]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def comfy() -> dict[str, Any]:
    if not COMFYUI_PATH:
        pytest.skip("set COMFYUI_PATH to a ComfyUI checkout to run the comfy tier")
    from make_comfy_references import comfy_version, import_comfy

    return {**import_comfy(COMFYUI_PATH), "version": comfy_version(COMFYUI_PATH)}


@pytest.fixture(scope="module")
def references(comfy: dict[str, Any]) -> dict[str, Any]:
    """This ComfyUI version's references (each version's own: 0.3.75 never hands the model a text mask)."""
    from safetensors import safe_open

    path = references_path(comfy["version"])
    assert path.is_file(), (
        f"no Qwen-Image references for ComfyUI {comfy['version']}: run {Path(__file__).parents[1]}/tools/make_qwen_references.py with it"
    )
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert meta["comfyui_version"] == comfy["version"]
    return {"cases": json.loads(meta["cases"]), "models": json.loads(meta["models"]), "tensors": tensors}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("qwen-models")
    return {name: write_model(name, folder) for name in MODELS}


@pytest.fixture(scope="module")
def registries() -> Iterator[dict[int, Registry]]:
    made = {n: Registry(factory=lambda devices: ParallelModel(list(devices), threads=1)) for n in (2, 4)}
    yield made
    for registry in made.values():
        registry.close()


def parallel_model(checkpoint: str, registries: dict[int, Registry], layout: str, loras=()) -> Any:
    from rocm_parallel.nodes import comfy_model

    devices, parallel = LAYOUTS[layout]
    handle = ParallelHandle(checkpoint, Path(checkpoint).name, ("cpu",) * devices, "float32", tuple(loras))
    return comfy_model.parallel_model(handle, LayoutRequest(parallel), registries[devices])


@pytest.mark.parametrize(("layout", "name"), RUNS)
def test_qwen_image_graphs_on_the_parallel_model_match_comfyui(
    comfy, references, checkpoints, registries, tmp_path, layout, name
):
    if name not in references["cases"]:
        pytest.skip(f"{name} needs a newer ComfyUI than {comfy['version']} (no reference recorded with it)")
    case = references["cases"][name]
    assert case == json.loads(json.dumps(CASES[name]))  # the tool's cases are what was recorded
    loras = [(lora_file(case, tmp_path), case["lora"]["strength"])] if "lora" in case else []
    model = parallel_model(checkpoints[case["model"]], registries, layout, loras)
    runner = model.model.diffusion_model.runner
    with torch.no_grad():
        out = run_case(comfy, model, name, case)[f"{name}.output"]
    want = references["tensors"][f"{name}.output"]
    diff = (out - want).abs().max().item()
    print(
        f"ComfyUI {comfy['version']} {name} {layout}: max |diff| {diff:.2e} (max |out| {want.abs().max():.1f})"
    )
    assert out.shape == want.shape  # ComfyUI's 5-D latent [1, 16, 1, h, w]
    assert diff <= TOLERANCE
    assert runner.calls >= case["steps"]


def test_the_parallel_model_is_comfyuis_qwen_image(comfy, checkpoints, registries):
    """ComfyUI's own QwenImage around the proxy: its model type (FLUX: ModelSamplingFlux 1.15 by default),
    its latent format (Wan21, 3 latent dimensions) and, for an Edit-2511 file, its default placement."""
    import comfy.latent_formats
    import comfy.model_base

    model = parallel_model(checkpoints["qwen"], registries, "tp2")
    assert isinstance(model.model, comfy.model_base.QwenImage)
    assert model.model.model_type == comfy.model_base.ModelType.FLUX
    assert model.model.model_sampling.shift == pytest.approx(1.15)
    assert isinstance(model.model.latent_format, comfy.latent_formats.Wan21)
    assert model.model.latent_format.latent_dimensions == 3
    proxy = model.model.diffusion_model
    inputs = {item.name for item in proxy.runner.info.model_family.call_spec.inputs}
    assert ("y" in inputs, "attention_mask" in inputs, proxy.default_ref_method) == (False, True, "index")
    edit_2511 = parallel_model(checkpoints["qwen_2511"], registries, "tp2")
    assert edit_2511.model.diffusion_model.default_ref_method == "index_timestep_zero"
