"""ComfyUI core's own multi-GPU nodes and its dynamic VRAM beside the ROCm Parallel workers.

ComfyUI 0.33 has MultiGPU CFG Split (`MultiGPU_WorkUnits`), Select Model / CLIP / VAE Device
(comfy_extras/nodes_multigpu.py) and dynamic VRAM (comfy-aimdo, on by default on a GPU); 0.3.75 has none
of them. What the pack does beside each (docs/nodes.md, "Beside ComfyUI's own multi-GPU nodes"):

- MultiGPU CFG Split, and Select Model Device onto another GPU, copy the MODEL per GPU with
  `ModelPatcher.deepclone_multigpu`. The ROCm Parallel Model's transformer lives in its workers, which
  already split every call over the loader's GPUs, so the copy is refused by name (`CFG_SPLIT_MESSAGE`,
  pointing to `batch 2`). Where ComfyUI sees one device there is nothing to copy and both pass it through.
- ComfyUI's own models (a CLIP or VAE put there by Select CLIP / VAE Device, or any model ComfyUI left on
  its GPU) on a GPU a worker uses: unloaded from every worker GPU before the workers load (0.3.75's
  `unload_all_models` freed only ComfyUI's main device), and named on the panel (`free_worker_gpus`).
- Dynamic VRAM on a GPU a worker shares: it fits ComfyUI's models into the memory the workers leave
  free, measured as it loads; the panel shows that budget per shared GPU (`dynamic_vram_lines`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .registry import Registry, size_text

CFG_SPLIT_MESSAGE = (
    "ComfyUI's MultiGPU CFG Split and Select Model Device cannot copy the ROCm Parallel Model to another GPU: "
    "its transformer lives in the ROCm Parallel workers, which already split every model call over the "
    "loader's GPUs. To run cond and uncond on two groups of GPUs at once, give the ROCm Parallel Model a "
    "'batch 2' layout (e.g. 'batch 2 x tp 2'); take MultiGPU CFG Split / Select Model Device off this MODEL"
)
_VRAM_LINE = "ComfyUI's dynamic VRAM"
# Instance attributes read from ComfyUI's loaded-model records (checked by tests/comfy_uses.py).
_USES = (
    ("comfy.model_management", "LoadedModel.device"),
    ("comfy.model_management", "LoadedModel.model"),
    ("comfy.model_management", "LoadedModel.model_loaded_memory"),
)


def worker_gpus(devices: Sequence[str]) -> list[str]:
    """The accelerators among the workers' devices (CPU workers share the host's memory: nothing to free)."""
    return sorted({d for d in devices if not d.startswith("cpu")})


def comfy_models_on(devices: Sequence[str], loaded: Sequence[Any] | None = None) -> list[str]:
    """ComfyUI's own loaded models (comfy.model_management.current_loaded_models) that sit on a worker GPU,
    as 'FluxClipModel 9.80 GB on cuda:1'."""
    import comfy.model_management as mm

    gpus = set(worker_gpus(devices))
    out = []
    for entry in mm.current_loaded_models if loaded is None else loaded:
        patcher = entry.model
        device = str(entry.device)
        if patcher is None or device not in gpus:
            continue
        out.append(f"{type(patcher.model).__name__} {size_text(entry.model_loaded_memory())} on {device}")
    return out


def free_worker_gpus(registry: Registry, devices: Sequence[str]) -> None:
    """Unload ComfyUI's models from every worker GPU before the workers load; the panel names them."""
    import comfy.model_management as mm
    import torch

    found = comfy_models_on(devices)
    for device in worker_gpus(devices):
        mm.free_memory(1e30, torch.device(device))
    registry.update(
        beside=[
            f"ComfyUI's {', '.join(found)} unloaded for the workers (Select CLIP / VAE Device onto a GPU "
            "without a worker keeps them there)"
        ]
        if found
        else []
    )


def dynamic_vram() -> bool:
    """ComfyUI's dynamic VRAM (comfy-aimdo) is on (ComfyUI 0.33 on a GPU, unless --disable-dynamic-vram)."""
    try:
        import comfy.memory_management

        return bool(comfy.memory_management.aimdo_enabled)
    except (ImportError, AttributeError):  # ComfyUI before dynamic VRAM (0.3.75)
        return False


def dynamic_vram_lines(ranks: Sequence[Mapping[str, Any]], enabled: bool) -> list[str]:
    """Per GPU a worker shares with ComfyUI's dynamic VRAM: the memory left for ComfyUI's models once the
    workers loaded (each rank's `free_gb`, which counts every process on that GPU)."""
    if not enabled:
        return []
    return [
        f"{_VRAM_LINE} shares {r['device']} with rank {r['rank']}: {r['free_gb']:.1f} GB of "
        f"{r['total_gb']:.1f} GB left for ComfyUI's models"
        for r in ranks
        if r.get("total_gb") and "free_gb" in r
    ]


def show_dynamic_vram(registry: Registry) -> None:
    """After the workers loaded: the budget dynamic VRAM has on each shared GPU, on the panel."""
    lines = dynamic_vram_lines(registry.state.get("ranks", []), dynamic_vram())
    kept = [line for line in registry.state.get("beside", []) if not line.startswith(_VRAM_LINE)]
    if lines or kept != registry.state.get("beside", []):
        registry.update(beside=[*kept, *lines])
