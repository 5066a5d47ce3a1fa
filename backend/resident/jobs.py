"""The job skeleton every resident model shares, whatever its kind (a diffusion model, a text encoder, a
VAE): load into a slot, find the slot's model, report status, unload every slot or one.

A rank keeps several models resident, one per slot (runtime/worker.py `Resident`): a graph that uses two
models, such as Wan 2.2's two experts, or a text encoder and a VAE beside a diffusion model, keeps each in
its own. Each kind's load method (diffusion/jobs.py, encoders/jobs.py, vae/jobs.py) builds its model and
hands it to `load_slot`, which clears the slot, frees the memory, times the load and reports; its other
methods find their model with `held`. `status` and the unloads see every slot alike.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import torch

from ..config import DEFAULT_SLOT
from ..parallel.tensor import parameter_bytes
from ..parallel.weights import resident_bytes_by_dtype
from ..runtime.worker import Resident, WorkerContext, handler
from .messages import DeviceMemory, LoadReport, RankStatus, ResidentModel, Unloaded, UnloadRequest

# Attribute of a resident module parked in host memory (backend/resident/parking.py; set by the module's park method)
ON_HOST = "_rocm_parallel_on_host"


def _memory(device: torch.device) -> DeviceMemory | None:
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(
        allocated_gb=torch.cuda.memory_allocated(device) / 1e9,
        peak_gb=torch.cuda.max_memory_allocated(device) / 1e9,
        free_gb=free / 1e9,
        total_gb=total / 1e9,
    )


def _model_status(slot: str, resident: Resident) -> ResidentModel:
    model = resident.model
    return ResidentModel(
        slot=slot,
        loaded=resident.key,
        parameter_bytes=parameter_bytes(model) if model is not None else 0,
        parameter_bytes_by_dtype=resident_bytes_by_dtype(model) if model is not None else {},
        on_host=bool(getattr(model, ON_HOST, False)),
    )


@handler("status")
def status(ctx: WorkerContext) -> RankStatus:
    """This rank's device, memory and every resident model (slots that hold none are left out)."""
    models = tuple(_model_status(slot, r) for slot, r in ctx.residents.items() if r.model is not None)
    by_dtype: dict[str, int] = {}
    for m in models:
        for dtype, n in m.parameter_bytes_by_dtype.items():
            by_dtype[dtype] = by_dtype.get(dtype, 0) + n
    main = next((m for m in models if m.slot == DEFAULT_SLOT), models[0] if len(models) == 1 else None)
    return RankStatus(
        rank=ctx.rank,
        device=str(ctx.device),
        loaded=main.loaded if main is not None else None,
        parameter_bytes=sum(m.parameter_bytes for m in models),
        parameter_bytes_by_dtype=by_dtype,
        memory=_memory(ctx.device),
        models=models,
    )


def report(ctx: WorkerContext, **what_the_load_did: float | int | bool) -> LoadReport:
    """This rank's status after a load, and what the load did (`LoadReport`'s fields)."""
    return LoadReport(**vars(status(ctx)), **what_the_load_did)


Built = tuple[
    torch.nn.Module, dict[str, float | int]
]  # a model and what its load did besides (report fields)


def load_slot(
    ctx: WorkerContext, slot: str, key: Any, build: Callable[[], Built], family: Any = None
) -> LoadReport:
    """Make the model `key` describes resident in `slot`: a no-op when the slot holds it already; otherwise the
    slot is emptied and its memory freed first (never two models in one slot), `build()` makes the model on
    this rank, and the slot names it only once the device finished (`Resident.set`)."""
    resident = ctx.model(slot)
    if resident.key == key:
        return report(ctx, reused=True)
    resident.clear()
    free_memory(ctx)
    started = time.perf_counter()
    model, what = build()
    ctx.synchronize()
    resident.set(model, key, family)
    return report(ctx, reused=False, seconds=time.perf_counter() - started, **what)


def held(ctx: WorkerContext, slot: str, kind: type, what: str) -> tuple[torch.nn.Module, Any]:
    """The model resident in `slot` and its key, which must be a `kind` (a `what`: "VAE", "text encoder")."""
    resident = ctx.model(slot)
    model = resident.require()
    if not isinstance(resident.key, kind):
        raise TypeError(f"slot {slot!r} holds no {what} on rank {ctx.rank}")
    return model, resident.key


def free_memory(ctx: WorkerContext) -> None:
    """Give what was dropped back to the device (a GPU's cached blocks too)."""
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()


@handler("unload")
def unload(ctx: WorkerContext) -> Unloaded:
    """Drop every resident model and give their memory back to the device."""
    had = [r.clear() for r in ctx.residents.values()]
    free_memory(ctx)
    return Unloaded(rank=ctx.rank, unloaded=any(had))


@handler("unload_slot", UnloadRequest)
def unload_slot(ctx: WorkerContext, request: UnloadRequest) -> Unloaded:
    """Drop the model resident in one slot; the others stay."""
    had = ctx.model(request.slot).clear()
    free_memory(ctx)
    return Unloaded(rank=ctx.rank, unloaded=had)
