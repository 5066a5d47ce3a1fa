"""The worker side of the forward service: one transformer forward per request, the way ComfyUI's
samplers call a model (forward_client.py is the caller's side).

Where a step runs: ComfyUI's sampler calls the proxy MODEL's diffusion model (`nodes/comfy_model.py`),
or `ParallelModel.sample` runs its Euler loop; either calls `ParallelModel.forward` (backend/diffusion/api.py),
which sends one `model_call` request to every rank. Each rank runs its family's model call
(`ModelFamily.call`, on the inputs the family's `CallSpec` declares) on its shard in the resident layout and
rank 0 returns the full output. Under a batch degree
(`batch 2 x tp 2`) each group of tp x ring x ulysses ranks computes its share of the call's batch (cond and
uncond at cfg > 1 go to different groups) and the outputs are gathered over the batch dimension
(parallel/mesh.py `BatchSplit`).

A prompt's inputs (the family's held inputs: text features, a pooled vector, reference latents, a text mask)
are the same for every step of a job, often megabytes: the client sends them once under a key and every rank
keeps them on its device (`messages.ConditioningSlots`: both sides evict alike), so a step moves only the latent. A
rank that lacks a key says so (`ConditioningMissing`) and gets the tensors again.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..compile import note_compiles, repeated_blocks
from ..family import ModelFamily, family_of
from ..parallel.mesh import BatchSplit, groups_of
from ..parallel.weights import compute_dtype
from ..runtime.cancel_points import cancellable
from ..runtime.worker import Resident, WorkerContext, handler
from .finite import all_finite
from .messages import ConditioningSlots, ForwardReply, ForwardRequest


class ConditioningMissing(KeyError):
    """A rank does not hold the conditioning the client named (evicted, or the worker restarted)."""


def _slots(resident: Resident) -> ConditioningSlots:
    return resident.caches.setdefault("conditioning", ConditioningSlots())


def _on_device(value: Any, cast: bool, device: torch.device, dtype: torch.dtype) -> Any:
    """An input value on this rank's device: floating tensors in the compute dtype when `cast`."""
    if torch.is_tensor(value):
        return value.to(device, dtype) if cast and value.is_floating_point() else value.to(device)
    if isinstance(value, list | tuple):
        return tuple(_on_device(v, cast, device, dtype) for v in value)
    return value


def _take(split: BatchSplit, value: Any) -> Any:
    """This batch group's share of an input (each tensor of a sequence)."""
    if isinstance(value, tuple):
        return tuple(split.take(v) for v in value)
    return split.take(value) if torch.is_tensor(value) else value


def _family(resident: Resident, model: torch.nn.Module) -> ModelFamily:
    """The resident model's family, as its load named it (a test's own resident: by the model's class)."""
    return resident.family if resident.family is not None else family_of(model)


@handler("model_call", ForwardRequest)
def forward(ctx: WorkerContext, request: ForwardRequest) -> ForwardReply:
    """One model call on the model resident in the request's slot: ComfyUI's `diffusion_model(x, timestep,
    **inputs)`, run by its family (`ModelFamily.call` with the inputs its `CallSpec` declares).

    Rank 0 returns the output (x's shape) in the model's dtype; the others return none.
    """
    resident = ctx.model(request.slot)
    model = resident.require()
    family = _family(resident, model)
    spec = family.call_spec
    dtype = compute_dtype(model)
    slots = _slots(resident)
    cond = request.cond
    if cond is not None:
        held = {i.name: _on_device(cond.inputs.get(i.name), i.cast, ctx.device, dtype) for i in spec.held()}
        slots.put(request.cond_key, held)
    conditioning = slots.get(request.cond_key)
    if conditioning is None:
        raise ConditioningMissing(f"conditioning {request.cond_key} is not held on rank {ctx.rank}")
    per_call = {
        i.name: _on_device(request.inputs.get(i.name), i.cast, ctx.device, dtype) for i in spec.per_call()
    }
    inputs = {**conditioning, **per_call}
    x = request.x.to(ctx.device, dtype)
    started = time.perf_counter()
    first_text = next((t for t in inputs.values() if torch.is_tensor(t)), x)
    with torch.inference_mode(), note_compiles(ctx.rank, (x, first_text)) as compiled:
        split = BatchSplit(groups_of(model), x.shape[0])
        out = None
        if split.runs:  # a group without entries (a call smaller than the batch degree) only gathers
            mine = {
                i.name: _take(split, inputs[i.name]) if i.batched else inputs[i.name] for i in spec.inputs
            }
            model_fn = cancellable(
                ctx, model, family.model_fn(model), repeated_blocks(model), every_group_runs=all(split.sizes)
            )
            out = family.call(model_fn, split.take(x), split.take(request.timestep.to(ctx.device)), **mine)
        entry = (family.latent_channels(model.config), *x.shape[2:])
        out = split.gather(out, entry, dtype, ctx.device)
        out = out.cpu() if ctx.rank == 0 else None
    said = compiled[0] if compiled else None
    finite = out is None or all_finite(out)
    seconds = time.perf_counter() - started
    return ForwardReply(rank=ctx.rank, out=out, seconds=seconds, compiled=said, finite=finite)
