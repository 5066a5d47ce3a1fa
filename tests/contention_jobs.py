"""Worker methods of the contention test (tests/test_contention.py): a load and a model call in miniature,
with what makes them hard to judge on a busy machine: ranks that take turns being slow, collectives of
several kinds (and so recorders that lag), progress reports between tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from rocm_parallel.backend.runtime.transport import record
from rocm_parallel.backend.runtime.worker import handler


@record
@dataclass(frozen=True)
class Miniature:
    """`index`: the job's number (which rank is slow this time); `tensors`: a load's tensors; `size`: the
    side of the matrices multiplied between collectives."""

    index: int
    tensors: int = 12
    size: int = 96


@record
@dataclass(frozen=True)
class MiniatureDone:
    rank: int
    checksum: float


def _work(size: int, rounds: int) -> torch.Tensor:
    a = torch.ones(size, size) / size
    for _ in range(rounds):
        a = a @ a + 1.0 / size
    return a


@handler("mini_load", Miniature)
def mini_load(ctx, request: Miniature) -> MiniatureDone:
    """Read `tensors` tensors (rank `index % world` twice as slowly), reporting each, then one all-gather of
    what each rank read (a load's mesh or LSE probe)."""
    slow = request.index % ctx.world_size == ctx.rank
    total = torch.zeros(1)
    for done in range(request.tensors):
        ctx.load_progress(done, request.tensors)
        total += _work(request.size, 4 if slow else 2).sum()
    ctx.load_progress(request.tensors, request.tensors)
    gathered = torch.zeros(ctx.world_size)
    dist.all_gather_into_tensor(gathered, total)
    return MiniatureDone(ctx.rank, float(gathered.sum()))


@handler("mini_call", Miniature)
def mini_call(ctx, request: Miniature) -> MiniatureDone:
    """A model call's pattern: compute, all-reduce, all-gather, compute, broadcast; one rank slower."""
    slow = request.index % ctx.world_size == ctx.rank
    x = _work(request.size, 3 if slow else 1)
    dist.all_reduce(x)
    pieces = torch.zeros(ctx.world_size * 8)
    dist.all_gather_into_tensor(pieces, x[0, :8].contiguous())
    y = _work(request.size, 2 if slow else 1) + pieces.sum()
    dist.broadcast(y, src=request.index % ctx.world_size)
    return MiniatureDone(ctx.rank, float(y.sum()))
