"""The worker methods of a resident text encoder: load it into its slot, run it on a batch of prompts, move
its shard to host memory and back (every rank its tensor-parallel shard; rank 0 returns the result).

The encoder is a resident module like a diffusion model (runtime/worker.py `Resident`, one slot): it is loaded by
the job skeleton every resident model shares (resident/jobs.py `load_slot`), `status`, `unload` and
`unload_slot` see it, and the caller's `ResidentGroup` evicts it by the same rule.
"""

from __future__ import annotations

import time

import torch

from ..resident.jobs import ON_HOST, free_memory, held, load_slot, report
from ..resident.messages import LoadReport
from ..runtime.worker import WorkerContext, handler
from .load import load_encoder
from .messages import EncodeReply, EncodeRequest, EncoderLoadRequest, EncoderPlacement


@handler("encoder_load", EncoderLoadRequest)
def load(ctx: WorkerContext, request: EncoderLoadRequest) -> LoadReport:
    """Make the request's text encoder resident in its slot (a no-op when it already is)."""
    return load_slot(
        ctx,
        request.slot,
        request,
        lambda: (load_encoder(request, ctx.device, progress=ctx.load_progress), {}),
    )


def _encoder(ctx: WorkerContext, slot: str) -> torch.nn.Module:
    return held(ctx, slot, EncoderLoadRequest, "text encoder")[0]


@handler("encoder_run", EncodeRequest)
def run(ctx: WorkerContext, request: EncodeRequest) -> EncodeReply:
    """ComfyUI's transformer stack on the request's prompts; rank 0 returns the hidden states (float32)."""
    model = _encoder(ctx, request.slot)
    started = time.perf_counter()
    device = ctx.device
    with torch.inference_mode():
        ids = request.ids.to(device)
        x = model.embed(ids.clamp(min=0))  # every rank gets every row (vocabulary-parallel: one all-reduce)
        if request.external is not None and request.external_at is not None:
            flat = x.view(-1, x.shape[-1])
            flat[request.external_at.to(device)] = request.external.to(device, x.dtype)
        mask = request.attention_mask.to(device) if request.attention_mask is not None else None
        positions = request.position_ids.to(device) if request.position_ids is not None else None
        out, intermediate = model(
            x, mask, request.intermediate_output, request.final_layer_norm_intermediate, positions
        )
        ctx.synchronize()
    seconds = time.perf_counter() - started
    if ctx.rank != 0:
        return EncodeReply(rank=ctx.rank, out=None, intermediate=None, seconds=seconds)
    return EncodeReply(
        rank=0,
        out=out.cpu(),
        intermediate=intermediate.cpu() if intermediate is not None else None,
        seconds=seconds,
    )


@handler("encoder_offload", EncoderPlacement)
def place(ctx: WorkerContext, request: EncoderPlacement) -> LoadReport:
    """Move the encoder's shard to pinned host memory (`on_device=False`) or back to this rank's device."""
    model = _encoder(ctx, request.slot)
    target = ctx.device if request.on_device else torch.device("cpu")
    pin = not request.on_device and ctx.device.type == "cuda"
    started = time.perf_counter()
    with torch.no_grad():
        for param in model.parameters():
            if param.device == target:
                continue
            moved = param.data.to(target, non_blocking=False)
            param.data = moved.pin_memory() if pin else moved
    ctx.synchronize()
    setattr(model, ON_HOST, not request.on_device)
    free_memory(ctx)
    return report(ctx, reused=True, seconds=time.perf_counter() - started)
