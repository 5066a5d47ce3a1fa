"""The worker method that loads a diffusion model: a checkpoint in a layout, with its LoRAs, into a slot
(status and unloads are every resident model's: resident/jobs.py).

A load takes the caller's `LoadRequest`: the checkpoint's header as the caller read it, the layout, the
LoRAs and the slot: a rank keeps several models resident, one per slot (a graph that uses two models, such
as Wan 2.2's two experts, keeps both), each with its own layout, shards, LoRA state and conditioning. The layout's device mesh (parallel/mesh.py) is built once per layout and kept: each rank reads
the slices of its rank in the tp group, and context parallelism runs on the ring x ulysses sub-mesh.
Sampling is not a job: the caller's loop (`ParallelModel.sample`) sends one `model_call` request per
step (serve.py, which splits each call's batch over the mesh's batch dimension).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..checkpoint import CheckpointInfo, apply_loras, inspect_lora, load_model
from ..compile import compile_repeated_blocks
from ..parallel.mesh import ParallelGroups, parallel_groups, parallelize
from ..resident.jobs import Built, free_memory, load_slot, report
from ..resident.messages import LoadReport
from ..runtime.worker import WorkerContext, handler
from .messages import LoadRequest, Lora

# Attribute of a resident model: the parameters that currently hold LoRA deltas.
LORA_PATCHED = "_rocm_parallel_lora_patched"


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
    resident = ctx.model(request.slot)
    wanted, held = request.loaded(), resident.key
    info, layout = request.info, request.layout
    family = info.model_family
    if wanted.same_weights(held):
        if held == wanted:
            return report(ctx, reused=True)
        model = resident.model
        resident.clear()  # until the new set is on every tensor, this rank holds no described model
        try:
            lora = _apply_loras(ctx, model, info, request.loras, parallel_groups(layout, ctx.device))
        except BaseException:
            del model
            free_memory(ctx)
            raise
        resident.set(model, wanted, family)
        return report(ctx, reused=True, **lora)
    return load_slot(ctx, request.slot, wanted, lambda: _build(ctx, request), family)


def _build(ctx: WorkerContext, request: LoadRequest) -> Built:
    """This rank's shard of the request's model: read, LoRAs applied, context-parallel, compile marked."""
    info, layout = request.info, request.layout
    groups = parallel_groups(layout, ctx.device)
    model = load_model(
        info, device=ctx.device, dtype=request.dtype, weight_dtype=request.weight_dtype, tp=layout.tp,
        group=groups.tp_group, progress=ctx.load_progress,
    )  # fmt: skip
    lora = _apply_loras(ctx, model, info, request.loras, groups) if request.loras else {}
    parallelize(
        model, groups, info.model_family, attention=request.attention
    )  # context parallelism; TP is the loader's
    compile_repeated_blocks(model, request.compile)  # marks the blocks; they compile at the first call
    return model, lora
