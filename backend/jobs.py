"""The jobs a worker runs for users: load a checkpoint in a layout, unload it, report status.

A load takes the caller's `LoadRequest`: the checkpoint's header as the caller read it, the layout, the
LoRAs and the slot: a rank keeps several models resident, one per slot (a graph that uses two models, such
as Wan 2.2's two experts, keeps both), each with its own layout, shards, LoRA state and conditioning. The layout's device mesh (parallel/mesh.py) is built once per layout and kept: each rank reads
the slices of its rank in the tp group, and context parallelism runs on the ring x ulysses sub-mesh.
Sampling is not a job: the caller's loop (`ParallelModel.sample`) sends one `model_call` request per
step (serve.py, which splits each call's batch over the mesh's batch dimension).
"""

from __future__ import annotations

import gc
import time

import torch
import torch.distributed as dist

from .checkpoint import CheckpointInfo, apply_loras, inspect_lora, load_model, resolve_dtype
from .compile import compile_repeated_blocks
from .messages import (
    DEFAULT_SLOT,
    DeviceMemory,
    LoadReport,
    LoadRequest,
    Lora,
    RankStatus,
    ResidentModel,
    Unloaded,
    UnloadRequest,
)
from .models.engine import EngineModel, detection_of, load_engine_model
from .parallel.mesh import ParallelGroups, parallel_groups, parallelize
from .parallel.tensor import parameter_bytes
from .parallel.weights import resident_bytes_by_dtype
from .worker import Resident, WorkerContext, handler

# Attribute of a resident model: the parameters that currently hold LoRA deltas.
LORA_PATCHED = "_rocm_parallel_lora_patched"
# Attribute of a resident module parked in host memory (backend/parking.py; set by the module's park method)
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


def _report(ctx: WorkerContext, **what_the_load_did: float | int | bool) -> LoadReport:
    return LoadReport(**vars(status(ctx)), **what_the_load_did)


def _free(ctx: WorkerContext) -> None:
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()


@handler("unload")
def unload(ctx: WorkerContext) -> Unloaded:
    """Drop every resident model and give their memory back to the device."""
    had = [r.clear() for r in ctx.residents.values()]
    _free(ctx)
    return Unloaded(rank=ctx.rank, unloaded=any(had))


@handler("unload_slot", UnloadRequest)
def unload_slot(ctx: WorkerContext, request: UnloadRequest) -> Unloaded:
    """Drop the model resident in one slot; the others stay."""
    had = ctx.model(request.slot).clear()
    _free(ctx)
    return Unloaded(rank=ctx.rank, unloaded=had)


def _apply_loras(
    ctx: WorkerContext,
    model: torch.nn.Module,
    info: CheckpointInfo,
    loras: tuple[Lora, ...],
    groups: ParallelGroups,
) -> dict[str, float | int]:
    """Set the model's weights to the checkpoint plus `loras`; undo what the previous set patched.

    What is patched now is kept on the model (`LORA_PATCHED`), so the next change restores exactly
    those parameters, even if a LoRA file changed on disk meanwhile.
    """
    started = time.perf_counter()
    if isinstance(model, EngineModel):  # ComfyUI's own LoRA code on this rank's slices (models/lora.py)
        count = model.set_loras(loras, ctx.load_progress)
        ctx.synchronize()
        return {"lora_tensors": count, "lora_seconds": time.perf_counter() - started}
    previous = getattr(model, LORA_PATCHED, frozenset())
    parsed = [(inspect_lora(path, info), strength) for path, strength in loras]
    tp = groups.layout.tp
    rank, degree = (dist.get_rank(groups.tp_group), tp) if tp > 1 else (0, 1)  # this rank's TP shard
    patched = apply_loras(
        model, info, parsed, restore=previous, rank=rank, degree=degree, progress=ctx.load_progress
    )
    setattr(model, LORA_PATCHED, patched)
    ctx.synchronize()
    return {"lora_tensors": len(patched | previous), "lora_seconds": time.perf_counter() - started}


@handler("load", LoadRequest)
def load(ctx: WorkerContext, request: LoadRequest) -> LoadReport:
    """Make the request's checkpoint resident in its layout with its LoRAs applied; a no-op when it
    already is. When only the LoRAs differ, only the affected tensors are re-read.

    A failure or cancel while LoRAs are applied leaves some tensors patched and others not: the model is
    dropped then, so no rank keeps weights that no record describes.
    """
    resident = ctx.model(request.slot)
    wanted, held = request.loaded(), resident.key
    info, layout = request.info, request.layout
    family = info.model_family
    if wanted.same_weights(held):
        if held == wanted:
            return _report(ctx, reused=True)
        model = resident.model
        resident.clear()  # until the new set is on every tensor, this rank holds no described model
        try:
            lora = _apply_loras(ctx, model, info, request.loras, parallel_groups(layout, ctx.device))
        except BaseException:
            del model
            _free(ctx)
            raise
        resident.set(model, wanted, family)
        return _report(ctx, reused=True, **lora)
    resident.clear()
    _free(ctx)
    started = time.perf_counter()
    groups = parallel_groups(layout, ctx.device)
    if request.engine == "comfy":  # ComfyUI's own model, sharded by its plan (backend/models/)
        model = load_engine_model(
            info, comfyui=request.comfyui, detection=detection_of(request.detection), groups=groups,
            device=ctx.device, compute=resolve_dtype(request.dtype, ctx.device), weight_dtype=request.weight_dtype,
            attention=request.attention, progress=ctx.load_progress,
        )  # fmt: skip
        lora = _apply_loras(ctx, model, info, request.loras, groups) if request.loras else {}
    else:
        model = load_model(
            info, device=ctx.device, dtype=request.dtype, weight_dtype=request.weight_dtype, tp=layout.tp,
            group=groups.tp_group, progress=ctx.load_progress,
        )  # fmt: skip
        lora = _apply_loras(ctx, model, info, request.loras, groups) if request.loras else {}
        parallelize(
            model, groups, family, attention=request.attention
        )  # context parallelism; TP is the loader's
    compile_repeated_blocks(model, request.compile)  # marks the blocks; they compile at the first call
    ctx.synchronize()
    resident.set(model, wanted, family)
    return _report(ctx, reused=False, seconds=time.perf_counter() - started, **lora)
