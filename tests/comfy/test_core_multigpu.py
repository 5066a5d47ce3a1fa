# ruff: noqa: F401, F811  (the module-scoped fixtures of test_parallel_model.py, imported by name)
"""The ROCm Parallel Model beside ComfyUI core's own multi-GPU nodes and dynamic VRAM, in a real ComfyUI
imported in this process (nodes/comfy_beside.py; the outcomes are documented in docs/nodes.md).

ComfyUI 0.33 has MultiGPU CFG Split (`MultiGPU_WorkUnits`), Select Model / CLIP / VAE Device and dynamic
VRAM (comfy-aimdo); 0.3.75 has none of them, so their tests skip there naming what is missing. This
machine has no GPU: where a test needs ComfyUI to see a second GPU, `comfy.model_management.
get_all_torch_devices` (the one function ComfyUI's nodes ask) answers two devices, and where it needs a
model ComfyUI placed on a GPU, a model ComfyUI really loaded has its record's device set to that GPU.

    COMFYUI_PATH=<ComfyUI checkout> PYTHONPATH=<pack parent>:<comfy shims>:<comfy deps> \\
        python -m pytest -q -s -m comfy tests/comfy/test_core_multigpu.py
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType
from typing import Any

import pytest
import torch
from comfy_server import COMFYUI_VERSION, reference
from test_parallel_model import CASES, checkpoints, comfy, parallel_model, registries, run_case

from rocm_parallel.backend.resident.messages import DeviceMemory, RankStatus
from rocm_parallel.nodes import comfy_beside, comfy_model
from rocm_parallel.nodes.registry import Registry, size_text
from rocm_parallel.nodes.status import format_state

pytestmark = [pytest.mark.comfy, pytest.mark.timeout(1500)]
CASE = "cfg_negative"  # cfg > 1: ComfyUI's cond and uncond, what MultiGPU CFG Split would split


@pytest.fixture(scope="module")
def multigpu(comfy) -> ModuleType:
    try:
        return importlib.import_module("comfy_extras.nodes_multigpu")
    except ModuleNotFoundError:
        pytest.skip(
            f"ComfyUI {COMFYUI_VERSION} has no comfy_extras/nodes_multigpu.py (MultiGPU CFG Split and Select "
            "Model / CLIP / VAE Device came with ComfyUI 0.33)"
        )


@pytest.fixture
def second_gpu(monkeypatch: pytest.MonkeyPatch) -> torch.device:
    """ComfyUI sees this machine's device and a second GPU."""
    import comfy.model_management as mm

    gpu = torch.device("cuda", 1)
    monkeypatch.setattr(mm, "get_all_torch_devices", lambda exclude_current=False: [torch.device("cpu"), gpu])
    return gpu


def test_multigpu_cfg_split_refuses_the_parallel_model_pointing_to_batch_2(
    comfy,
    multigpu,
    checkpoints,
    registries,
    second_gpu,
):
    """Mutation tried: without ParallelModelPatcher.deepclone_multigpu, ComfyUI's own message came ('Cannot
    create multigpu deepclone of Flux: the loader that produced this model does not support multigpu ...
    Use a core loader'), which sends the user to a loader that cannot run the model in parallel."""
    model = parallel_model(comfy, checkpoints, registries, "dev", "tp2")
    with pytest.raises(RuntimeError) as err:
        multigpu.MultiGPUCFGSplitNode.execute(model, max_gpus=2)
    assert str(err.value) == comfy_beside.CFG_SPLIT_MESSAGE
    assert "'batch 2' layout" in str(err.value)


def test_multigpu_cfg_split_on_one_device_leaves_the_parallel_model_exact(
    comfy,
    multigpu,
    checkpoints,
    registries,
):
    """Where ComfyUI sees one device the node has nothing to copy: the MODEL it returns samples exactly
    as ComfyUI's own model did (this version's reference), cond and uncond in one call per step."""
    model = parallel_model(comfy, checkpoints, registries, CASES[CASE]["variant"], "tp2")
    split = multigpu.MultiGPUCFGSplitNode.execute(model, max_gpus=2)[0]
    assert split.get_additional_models_with_key("multigpu") == []
    runner = split.model.diffusion_model.runner
    out = run_case(comfy, split, CASE)
    assert (out - reference(CASE)["output"]).abs().max().item() <= 1e-4
    assert runner.calls == CASES[CASE]["steps"]


def test_select_model_device_passes_the_parallel_model_through_saying_why(
    comfy,
    multigpu,
    checkpoints,
    registries,
    second_gpu,
    caplog,
):
    model = parallel_model(comfy, checkpoints, registries, "dev", "tp2")
    with caplog.at_level(logging.WARNING):
        out = multigpu.SelectModelDeviceNode.execute(model, device="gpu:1")[0]
    assert out.load_device == torch.device("cpu")
    assert out.model.diffusion_model is model.model.diffusion_model  # the same workers, nothing copied
    assert any(comfy_beside.CFG_SPLIT_MESSAGE in r.getMessage() for r in caplog.records)


def _loaded_on(gpu: torch.device) -> tuple[Any, Any]:
    """A model ComfyUI really loaded (`load_models_gpu`), recorded as placed on `gpu` (where Select CLIP /
    VAE Device would put a text encoder or VAE on a machine with that GPU), and its patcher: ComfyUI's record
    holds it weakly, a CLIP or VAE node output holds it."""
    import comfy.model_management as mm
    import comfy.model_patcher

    module = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    patcher = comfy.model_patcher.ModelPatcher(
        module, load_device=mm.get_torch_device(), offload_device="cpu"
    )
    mm.load_models_gpu([patcher])
    entry = next(e for e in mm.current_loaded_models if e.model is patcher)
    entry.device = gpu
    return entry, patcher


def test_comfyuis_models_on_a_worker_gpu_are_unloaded_and_named_on_the_panel(comfy, monkeypatch):
    """Every worker GPU is freed, not only ComfyUI's main device (0.3.75's unload_all_models freed that one
    alone), and the panel and the Status node name what was there. Mutation tried: freeing only through
    unload_all_models left cuda:1 unfreed here."""
    import comfy.model_management as mm

    entry, _patcher = _loaded_on(torch.device("cuda", 1))
    size = entry.model_loaded_memory()
    freed: list[str] = []
    real_free = mm.free_memory

    def free_memory(memory_required: float, device: torch.device, *args: Any, **kwargs: Any) -> Any:
        if device.type != "cpu":  # this CPU torch cannot measure a GPU: the call is what is checked
            freed.append(str(device))
            return []
        return real_free(memory_required, device, *args, **kwargs)

    monkeypatch.setattr(mm, "free_memory", free_memory)
    registry = Registry()
    try:
        comfy_model.free_comfy_models(("cuda:0", "cuda:1"), registry)
    finally:
        mm.current_loaded_models.remove(entry)
    assert sorted(set(freed)) == ["cuda:0", "cuda:1"]
    line = (
        f"ComfyUI's Sequential {size_text(size)} on cuda:1 unloaded for the workers (Select CLIP / VAE Device "
        "onto a GPU without a worker keeps them there)"
    )
    assert registry.state["beside"] == [line]
    registry.update(devices=["cuda:0", "cuda:1"], phase="idle")
    assert line in format_state(registry.snapshot()).splitlines()
    # Models on other GPUs, or CPU workers, are none of the workers' business.
    assert comfy_beside.comfy_models_on(("cuda:0",), [entry]) == []
    assert comfy_beside.comfy_models_on(("cpu", "cpu"), [entry]) == []


def test_dynamic_vram_is_off_here_and_its_budget_is_on_the_panel_when_on(comfy, monkeypatch):
    """This ComfyUI runs with --cpu: dynamic VRAM is off (0.33 turns it off on CPU; 0.3.75 has none) and the
    panel says nothing of it. On a GPU, 0.33 turns it on (comfy.memory_management.aimdo_enabled, set by
    main.py): the panel then shows what each shared GPU leaves for ComfyUI's models once the workers loaded."""
    assert comfy_beside.dynamic_vram() is False
    registry = Registry()
    registry.record_ranks(
        [
            RankStatus(0, "cuda:0", memory=DeviceMemory(6.2, 7.0, 17.3, 24.0)),
            RankStatus(1, "cuda:1", memory=DeviceMemory(6.2, 7.0, 16.9, 24.0)),
        ]
    )
    comfy_beside.show_dynamic_vram(registry)
    assert registry.state.get("beside", []) == []
    try:
        import comfy.memory_management
    except ModuleNotFoundError:
        pytest.skip(f"ComfyUI {COMFYUI_VERSION} has no dynamic VRAM (comfy/memory_management.py came later)")
    monkeypatch.setattr(comfy.memory_management, "aimdo_enabled", True)
    comfy_beside.show_dynamic_vram(registry)
    comfy_beside.show_dynamic_vram(registry)  # once per sampling run: replaced, never repeated
    assert registry.state["beside"] == [
        "ComfyUI's dynamic VRAM shares cuda:0 with rank 0: 17.3 GB of 24.0 GB left for ComfyUI's models",
        "ComfyUI's dynamic VRAM shares cuda:1 with rank 1: 16.9 GB of 24.0 GB left for ComfyUI's models",
    ]
