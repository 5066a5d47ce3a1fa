"""Composed layouts through a real ComfyUI (imported in this process, as test_parallel_model.py does): cfg
with a negative prompt on `batch 2 x tp 2` over 4 CPU workers equals what ComfyUI sampled with its own model
(tests/data/comfy_references.safetensors, made by tools/make_comfy_references.py) within 1e-4, cond and
uncond going to the workers as one batch that the batch dimension splits over the two TP pairs; and the
parallel MODEL keeps them in one call when ComfyUI thinks memory is short.

    COMFYUI_PATH=/path/to/ComfyUI python -m pytest -q -s -p no:cacheprovider -m comfy tests/comfy/test_composed_layouts.py
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from comfy_server import COMFYUI_PATH, TESTS_DIR
from test_sampling import ALL_CASES as CASES
from test_sampling import flux_model, reference

from rocm_parallel.backend.checkpoint import save_checkpoint
from rocm_parallel.backend.config import ParallelLayout
from rocm_parallel.backend.diffusion.api import ParallelModel
from rocm_parallel.nodes.inputs import LayoutRequest, ParallelHandle
from rocm_parallel.nodes.registry import Registry

pytestmark = [pytest.mark.comfy, pytest.mark.timeout(1800)]

COMPOSED = ParallelLayout(batch=2, tp=2)
CFG_CASES = ["cfg_negative", "custom_advanced_cfg_guider"]  # KSampler cfg 2.5; CFGGuider cfg 2.0


@pytest.fixture(scope="module")
def comfy() -> dict[str, Any]:
    if not COMFYUI_PATH:
        pytest.skip("set COMFYUI_PATH to a ComfyUI checkout to run the comfy tier")
    sys.path.insert(0, str(TESTS_DIR / "tools"))
    from make_comfy_references import import_comfy

    return import_comfy(COMFYUI_PATH)


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    made = Registry(factory=lambda devices: ParallelModel(list(devices), threads=1))
    yield made
    made.close()


@pytest.fixture(scope="module")
def handle(tmp_path_factory: pytest.TempPathFactory) -> ParallelHandle:
    path = tmp_path_factory.mktemp("models") / "tiny-dev.safetensors"
    save_checkpoint(flux_model("dev"), path)
    return ParallelHandle(str(path), path.name, ("cpu",) * 4, "float32")


def run_case(comfy: dict[str, Any], model: Any, name: str) -> torch.Tensor:
    """The case as tools/make_comfy_references.py ran it with ComfyUI's own model, `model` in its place."""
    from make_comfy_references import run_case as reference_run_case

    with torch.no_grad(), tempfile.TemporaryDirectory() as folder:
        return reference_run_case(comfy, {"dev": model}, name, CASES[name], Path(folder))[f"{name}.output"]


class CallBatches:
    """Records the batch of every model call the parallel MODEL's runner makes."""

    def __init__(self, runner: Any) -> None:
        self.batches: list[int] = []
        forward = runner.forward

        def recording(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.batches.append(int(x.shape[0]))
            return forward(x, *args, **kwargs)

        runner.forward = recording


@pytest.mark.parametrize("name", CFG_CASES)
def test_cfg_with_a_negative_on_batch2_tp2_matches_comfyui(comfy, registry, handle, name):
    from rocm_parallel.nodes import comfy_model

    model = comfy_model.parallel_model(handle, LayoutRequest(COMPOSED), registry)
    runner = model.model.diffusion_model.runner
    calls = CallBatches(runner)
    out = run_case(comfy, model, name)
    diff = (out - reference(name)["output"]).abs().max().item()
    print(f"{name} {COMPOSED} on ComfyUI {comfy_model.comfyui_version()}: max |diff| {diff:.2e}")
    assert diff <= 1e-4
    assert registry.current.resident.layout == COMPOSED
    assert registry.snapshot()["layout"] == "batch 2 x tp 2" and registry.snapshot()["note"] is None
    steps = CASES[name]["steps"]
    # cond and uncond in one call per model evaluation: one group of the batch dimension each
    assert calls.batches == [2] * len(calls.batches) and len(calls.batches) >= steps


def _short_of_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """ComfyUI sees 1 MB free wherever it asks (0.3.75: model_management; 0.33.0: the patcher)."""
    import comfy.model_management as mm
    import comfy.model_patcher

    monkeypatch.setattr(mm, "get_free_memory", lambda *a, **k: 1024 * 1024)
    if hasattr(comfy.model_patcher.ModelPatcher, "get_free_memory"):
        monkeypatch.setattr(comfy.model_patcher.ModelPatcher, "get_free_memory", lambda self, *a: 1024 * 1024)


def test_cond_and_uncond_stay_in_one_call_when_comfyui_is_short_of_memory(
    comfy, registry, handle, monkeypatch
):
    """ComfyUI halves a cond batch whose `memory_required` x 1.5 exceeds its free memory
    (comfy/samplers.py `_calc_cond_batch`): on a busy machine, two calls per step and a batch degree
    that idles. The parallel MODEL's memory lives in the workers (its estimate is 0): one call. The
    second run is the mechanism broken on purpose: ComfyUI's own estimate back, two calls per step."""
    from rocm_parallel.nodes import comfy_model

    _short_of_memory(monkeypatch)
    model = comfy_model.parallel_model(handle, LayoutRequest(COMPOSED), registry)
    calls = CallBatches(model.model.diffusion_model.runner)
    out = run_case(comfy, model, "cfg_negative")
    steps = CASES["cfg_negative"]["steps"]
    assert calls.batches == [2] * steps
    assert (out - reference("cfg_negative")["output"]).abs().max().item() <= 1e-4

    without = comfy_model.parallel_model(handle, LayoutRequest(COMPOSED), registry)
    del without.model.memory_required  # ComfyUI's own (class) estimate again
    calls = CallBatches(without.model.diffusion_model.runner)
    out = run_case(comfy, without, "cfg_negative")
    assert calls.batches == [1] * (2 * steps)
    # each call of 1 leaves one TP pair idle: slower, still ComfyUI's result
    assert (out - reference("cfg_negative")["output"]).abs().max().item() <= 1e-4
