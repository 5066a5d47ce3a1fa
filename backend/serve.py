"""The worker side of the forward service: one transformer forward per request, the way ComfyUI's
samplers call a model (forward_client.py is the caller's side).

Where a step runs: ComfyUI's sampler calls the proxy MODEL's diffusion model (`nodes/comfy_model.py`),
or `ParallelFlux.sample` runs its Euler loop; either calls `ParallelFlux.forward` (backend/api.py),
which sends one `flux_forward` request to every rank. Each rank runs its family's model call
(`flux.forward.flux_call` for FLUX.1, `flux2.forward.flux2_call` for FLUX.2, `qwen_image.forward.qwen_call`
for Qwen-Image) on its shard in the resident layout and rank 0 returns the full output. Under a batch degree
(`batch 2 x tp 2`) each group of tp x ring x ulysses ranks computes its share of the call's batch (cond and
uncond at cfg > 1 go to different groups) and the outputs are gathered over the batch dimension
(parallel/mesh.py `BatchSplit`).

Conditioning (the text features, FLUX.1's CLIP pooled vector, reference latents, Qwen-Image's text mask)
is the same for every step of a job, often megabytes: the client sends it once under a key and every rank
keeps it on its device (`messages.ConditioningSlots`: both sides evict alike), so a step moves only the latent. A
rank that lacks a key says so (`ConditioningMissing`) and gets the tensors again.
"""

from __future__ import annotations

import time

import torch

from .cancel_points import cancellable
from .compile import note_compiles
from .family import family_of
from .finite import all_finite
from .messages import ConditioningSlots, ForwardReply, ForwardRequest
from .parallel.mesh import BatchSplit, groups_of
from .parallel.weights import compute_dtype
from .worker import WorkerContext, handler


class ConditioningMissing(KeyError):
    """A rank does not hold the conditioning the client named (evicted, or the worker restarted)."""


def _slots(ctx: WorkerContext) -> ConditioningSlots:
    return ctx.resident.caches.setdefault("conditioning", ConditioningSlots())


@handler("flux_forward", ForwardRequest)
def forward(ctx: WorkerContext, request: ForwardRequest) -> ForwardReply:
    """One model call on the resident model: ComfyUI's Flux.forward(x, timestep, context, y, guidance,
    ref_latents, ref_latents_method=ref_method), run by the resident model's family (backend/family.py).

    Rank 0 returns the output (x's shape: [B, C, H, W], or Qwen-Image's [B, C, 1, H, W]) in the model's
    dtype; the others return none.
    """
    model = ctx.resident.require()
    family = family_of(model)
    dtype = compute_dtype(model)
    slots = _slots(ctx)
    cond = request.cond
    if cond is not None:
        held = tuple(t.to(ctx.device, dtype) for t in (cond.context, cond.pooled, *cond.ref_latents))
        mask = None if cond.attention_mask is None else cond.attention_mask.to(ctx.device)
        slots.put(request.cond_key, (mask, *held))
    conditioning = slots.get(request.cond_key)
    if conditioning is None:
        raise ConditioningMissing(f"conditioning {request.cond_key} is not held on rank {ctx.rank}")
    mask, context, pooled, *refs = conditioning
    x = request.x.to(ctx.device, dtype)
    guidance = request.guidance.to(ctx.device, dtype) if request.guidance is not None else None
    started = time.perf_counter()
    with torch.inference_mode(), note_compiles(ctx.rank, (x, conditioning[1])) as compiled:
        split = BatchSplit(groups_of(model), x.shape[0])
        out = None
        if split.runs:  # a group without entries (a call smaller than the batch degree) only gathers
            take = split.take
            # the text mask only for a family whose text takes one (backend/family.py `TextInputs.mask`)
            masked = {} if mask is None else {"attention_mask": take(mask)}
            model_fn = cancellable(ctx, model, family.model_fn(model), every_group_runs=all(split.sizes))
            out = family.call(
                model_fn, take(x), take(request.timestep.to(ctx.device)), take(context),
                take(pooled), take(guidance), ref_latents=[take(r) for r in refs], ref_method=request.ref_method,
                **masked,
            )  # fmt: skip
        entry = (family.latent_channels(model.config), *x.shape[2:])
        out = split.gather(out, entry, dtype, ctx.device)
        out = out.cpu() if ctx.rank == 0 else None
    said = compiled[0] if compiled else None
    finite = out is None or all_finite(out)
    seconds = time.perf_counter() - started
    return ForwardReply(rank=ctx.rank, out=out, seconds=seconds, compiled=said, finite=finite)
