"""The worker method `bench gpu` runs in worker 0 (`WorkerGroup(methods=[...gpu_methods])`): hold a share of
the device's memory, as a worker holding its TP shard does, and say what the device has left."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..backend.runtime.transport import record
from ..backend.runtime.worker import handler


@record
@dataclass(frozen=True)
class HoldShare:
    bytes: int  # 0: let go of what is held


@record
@dataclass(frozen=True)
class ShareHeld:
    rank: int
    device: str
    held: int
    free: int | None  # the device's free bytes as this worker's torch sees them (None on CPU)
    total: int | None


_HELD: list[torch.Tensor] = []


@handler("hold_share", HoldShare)
def hold_share(ctx: Any, request: HoldShare) -> ShareHeld:
    _HELD.clear()
    if request.bytes:
        _HELD.append(torch.ones(request.bytes, dtype=torch.uint8, device=ctx.device))  # touched: resident
    ctx.synchronize()
    free = total = None
    if ctx.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(ctx.device)
    return ShareHeld(ctx.rank, str(ctx.device), sum(t.numel() for t in _HELD), free, total)
