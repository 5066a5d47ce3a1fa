"""Starting the workers and making a checkpoint resident for the nodes: the loader's preload, the
planner's 'auto', LoRAs, and the panel's 'loading' phase. The checkpoint's header is read once per node
run (`CheckpointInfo`) and carried to ParallelModel and the workers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..backend.config import ConfigError, ParallelLayout
from .inputs import PRELOAD_LAYOUTS, ParallelHandle, tp_layout
from .registry import Registry

if TYPE_CHECKING:
    from ..backend.checkpoint import CheckpointInfo
    from ..backend.diffusion.api import ParallelModel
    from ..backend.diffusion.group import LoadOptions


def needs_gpu_memory(devices: Sequence[str]) -> bool:
    """ComfyUI's own models must leave the GPUs before the workers load theirs."""
    return any(d.startswith("cuda") for d in devices)


def read_checkpoint(handle: ParallelHandle) -> CheckpointInfo:
    """The handle's checkpoint header: read once per node run, then carried (a file changed on disk is
    seen by the next run)."""
    from ..backend.checkpoint import inspect_checkpoint

    return inspect_checkpoint(handle.checkpoint)


def load(
    registry: Registry,
    handle: ParallelHandle,
    preload: str,
    ring: int = 0,
    ulysses: int = 0,
    interrupted: Callable[[], None] | None = None,
) -> ParallelModel:
    """Start (or reuse) the group for the handle's devices and, unless preload is 'none', load the model."""
    if preload not in PRELOAD_LAYOUTS:
        raise ConfigError(f"preload={preload!r} is not offered; use one of {', '.join(PRELOAD_LAYOUTS)}")
    model = registry.group_for(handle.devices)
    if preload == "none":
        start_workers(registry, model)  # now, so the first sampler run only loads weights
        return model
    info = None  # a fixed layout reads the header in the 'loading' phase, so a bad file shows there
    if preload == "auto":
        info = read_checkpoint(handle)
        layout = auto_layout(registry, model, handle, info, 1024, 1024, 1, context_only=False)
    else:
        registry.update(auto=None)
        layout = (
            tp_layout(len(handle.devices))
            if preload == "tp"
            else ParallelLayout.make("context", len(handle.devices), ring, ulysses)
        )
    ensure_loaded(registry, model, handle, info, layout, interrupted)
    return model


def start_workers(registry: Registry, model: ParallelModel) -> None:
    """Start the worker processes if they are not running, showing 'starting' meanwhile."""
    if not model.started:
        with registry.phase("starting workers"):
            model.start()


def auto_layout(
    registry: Registry,
    model: ParallelModel,
    handle: ParallelHandle,
    info: CheckpointInfo,
    width: int,
    height: int,
    batch: int,
    context_only: bool,
    reference_tokens: int = 0,
    fixed: dict[str, int] | None = None,
    frames: int = 1,
) -> ParallelLayout:
    """The planner's layout for this image (link and memory measured once per group); its reason is shown.
    `batch`: the model call's batch (cond + uncond at cfg > 1). `reference_tokens`: the tokens of
    reference latents (ReferenceLatent) each step carries too. `fixed`: degrees auto keeps. `frames`: a
    video's frames."""
    from ..backend.checkpoint import planned_weight_dtype

    choice = model.auto_layout(
        info.dims, width, height, batch, handle.dtype, context_only=context_only,
        weight_dtype=planned_weight_dtype(handle.weight_dtype, info), family=info.family,
        reference_tokens=reference_tokens, fixed=fixed, frames=frames,
    )  # fmt: skip
    registry.update(auto=choice.explanation)
    return choice.layout


def ensure_loaded(
    registry: Registry,
    model: ParallelModel,
    handle: ParallelHandle,
    info: CheckpointInfo | None,
    layout: ParallelLayout,
    interrupted: Callable[[], None] | None = None,
) -> None:
    """Make the handle's checkpoint resident in `layout` (a no-op on the workers when it already is).
    `info`: its header as this run read it (None: read here).

    `interrupted()` runs between tensors and raises on a pending Cancel: the load stops there on every
    rank. The panel names the file being loaded as such, and the resident one only once it is.
    """

    def check(done: int, total: int) -> None:
        registry.update(step=done, total=total)
        if interrupted is not None:
            interrupted()

    with registry.phase("loading", loading=handle.name, step=0, total=0):
        try:
            info = info if info is not None else read_checkpoint(handle)
            options = load_options(handle, layout)
            model.check_load(info, options)
            if not model.started:  # started only once the load is known to be valid
                registry.update(phase="starting workers")
                model.start()
                registry.update(phase="loading")
            reports = model.load(info, options, progress=check)
        finally:
            registry.update(loading=None)
            registry.record_resident(model)
    registry.record_ranks(reports)


def add_lora(handle: ParallelHandle, path: str, strength: float) -> ParallelHandle:
    """The ROCm Parallel LoRA node: `handle` plus this LoRA, after the backend checked from the file's
    header against the handle's checkpoint (no worker starts) that every key fits this model."""
    from ..backend.checkpoint import check_loras
    from ..backend.checkpoint.lora.parse import refuse_foreign_lora

    refuse_foreign_lora(path)  # an SDXL LoRA or a checkpoint: refused before the checkpoint is read
    check_loras([(path, strength)], read_checkpoint(handle))
    return handle.with_lora(path, strength)


def load_options(handle: ParallelHandle, layout: ParallelLayout) -> LoadOptions:
    """The backend's LoadOptions for the handle's model in `layout` (ParallelModel.load / check_load)."""
    from ..backend.diffusion.group import LoadOptions

    return LoadOptions(
        layout=layout, dtype=handle.dtype, weight_dtype=handle.weight_dtype, loras=handle.loras,
        compile=handle.compile, slot=handle.slot,
    )  # fmt: skip
