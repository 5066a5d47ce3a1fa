"""The jobs a worker runs for users: load a checkpoint in a layout, unload it, report status.

A load takes the caller's `LoadRequest`: the checkpoint's header as the caller read it, the layout and
the LoRAs. The layout's device mesh (parallel/mesh.py) is built once per layout and kept: each rank reads
the slices of its rank in the tp group, and context parallelism runs on the ring x ulysses sub-mesh.
Sampling is not a job: the caller's loop (`ParallelFlux.sample`) sends one `flux_forward` request per
step (serve.py, which splits each call's batch over the mesh's batch dimension).
"""

from __future__ import annotations

import gc
import time

import torch
import torch.distributed as dist

from .checkpoint import CheckpointInfo, apply_loras, inspect_lora, load_model
from .compile import compile_repeated_blocks
from .messages import DeviceMemory, LoadReport, LoadRequest, Lora, RankStatus, Unloaded
from .parallel.mesh import ParallelGroups, parallel_groups, parallelize
from .parallel.tensor import parameter_bytes
from .parallel.weights import resident_bytes_by_dtype
from .worker import WorkerContext, handler

# Attribute of a resident model: the parameters that currently hold LoRA deltas.
LORA_PATCHED = "_rocm_parallel_lora_patched"


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


@handler("status")
def status(ctx: WorkerContext) -> RankStatus:
    model = ctx.resident.model
    return RankStatus(
        rank=ctx.rank,
        device=str(ctx.device),
        loaded=ctx.resident.key,
        parameter_bytes=parameter_bytes(model) if model is not None else 0,
        parameter_bytes_by_dtype=resident_bytes_by_dtype(model) if model is not None else {},
        memory=_memory(ctx.device),
    )


def _report(ctx: WorkerContext, **what_the_load_did: float | int | bool) -> LoadReport:
    return LoadReport(**vars(status(ctx)), **what_the_load_did)


@handler("unload")
def unload(ctx: WorkerContext) -> Unloaded:
    """Drop the resident model and give its memory back to the device."""
    had = ctx.resident.clear()
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
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
    wanted, held = request.loaded(), ctx.resident.key
    info, layout = request.info, request.layout
    if wanted.same_weights(held):
        if held == wanted:
            return _report(ctx, reused=True)
        model = ctx.resident.model
        ctx.resident.clear()  # until the new set is on every tensor, this rank holds no described model
        try:
            lora = _apply_loras(ctx, model, info, request.loras, parallel_groups(layout, ctx.device))
        except BaseException:
            del model
            unload(ctx)
            raise
        ctx.resident.set(model, wanted)
        return _report(ctx, reused=True, **lora)
    unload(ctx)
    started = time.perf_counter()
    groups = parallel_groups(layout, ctx.device)
    model = load_model(
        info, device=ctx.device, dtype=request.dtype, weight_dtype=request.weight_dtype, tp=layout.tp,
        group=groups.tp_group, progress=ctx.load_progress,
    )  # fmt: skip
    lora = _apply_loras(ctx, model, info, request.loras, groups) if request.loras else {}
    parallelize(model, groups, attention=request.attention)  # context parallelism; TP is the loader's
    compile_repeated_blocks(model, request.compile)  # marks the blocks; they compile at the first call
    ctx.synchronize()
    ctx.resident.set(model, wanted)
    return _report(ctx, reused=False, seconds=time.perf_counter() - started, **lora)
