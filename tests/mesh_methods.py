"""Methods the composed-layout tests run inside the workers (`WorkerGroup(methods=["mesh_methods"])`): one
model call of the forward service with its collectives counted per mesh dimension, and diffusers' old ring
merge (<= 0.37 on torch >= 2.9, the ROCm LSE failure) switched on and off. Test-only: not in the package.
"""

from __future__ import annotations

import inspect
import re
import textwrap
from dataclasses import dataclass
from typing import Any

import torch

from rocm_parallel.backend.diffusion import serve
from rocm_parallel.backend.diffusion.messages import ForwardRequest
from rocm_parallel.backend.parallel.comm import CountCollectives
from rocm_parallel.backend.parallel.context import cp_group
from rocm_parallel.backend.parallel.mesh import groups_of
from rocm_parallel.backend.runtime.transport import record
from rocm_parallel.backend.runtime.worker import WorkerContext, handler


@record
@dataclass(frozen=True)
class CountedForward:
    """What one `model_call` did on a rank: its mesh coordinate, its collectives ('dim:kind' -> count),
    the LSE layout its ring guard probed, and (rank 0) the output."""

    rank: int
    coordinate: dict[str, int]
    counts: dict[str, int]
    lse_shape: str | None
    out: torch.Tensor | None


@handler("counted_forward", ForwardRequest)
def counted_forward(ctx: WorkerContext, request: ForwardRequest) -> CountedForward:
    """`serve.forward` itself, under CountCollectives keyed by the resident model's mesh dimensions."""
    model = ctx.resident.require()
    groups = groups_of(model)
    with CountCollectives(groups.dimension_names(cp_group(model))) as counter:
        reply = serve.forward(ctx, request)
    counts = {f"{d}:{k}": n for (d, k), n in sorted(counter.log.dimension_counts.items())}
    state = getattr(model, "_rp_context_state", None)
    return CountedForward(ctx.rank, groups.coordinate, counts, state and state.lse_shape, reply.out)


@record
@dataclass(frozen=True)
class OldRingMerge:
    on: bool


_ORIGINAL: dict[str, Any] = {}


@handler("old_ring_merge_on_mesh", OldRingMerge)
def old_ring_merge(ctx: WorkerContext, request: OldRingMerge) -> None:
    """diffusers 0.37's ring merge on torch >= 2.9 (the LSE's unsqueeze removed from
    `TemplatedRingAttention.forward`): the merge then needs a [B, S, H, 1] LSE, and a flash kernel's
    [B, S, H] fails as on ROCm. Set before a load: the LSE guard probes the merge that will run."""
    from diffusers.models import attention_dispatch as ad

    ring = ad.TemplatedRingAttention
    _ORIGINAL.setdefault("attribute", ring.__dict__["forward"])  # the staticmethod, to restore
    _ORIGINAL.setdefault("function", ring.forward)
    if not request.on:
        ring.forward = _ORIGINAL["attribute"]
        return
    source = textwrap.dedent(inspect.getsource(_ORIGINAL["function"]))
    patched, n = re.subn(r"if lse\.ndim == 3:\n(\s+)lse = lse\.unsqueeze\(-1\)", r"if False:\n\1pass", source)
    if n != 1:
        raise RuntimeError("the ring merge's LSE unsqueeze was not found: diffusers changed")
    scope = dict(ad.__dict__)
    exec(compile(patched, ad.__file__, "exec"), scope)
    ring.forward = scope["forward"]  # `@staticmethod def forward` compiled again: a staticmethod
