"""Worker method `measure_link`: what the planner's cost model needs about this machine, measured once.

Times all-reduces over the group (bus bandwidth from a few MB, latency from a few bytes), a bf16 matmul
on the device (sustained TFLOPS) and reads the device's memory. nccl-tests' definition of bus
bandwidth: an all-reduce of P bytes on N ranks moves 2(N-1)/N x P per rank.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from .parallel.comm import synchronize
from .worker import WorkerContext, handler


def _timed(fn: Any, device: torch.device, repeats: int) -> float:
    fn()  # warm-up: first collectives set up connections, first matmul picks kernels
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best  # the least disturbed run: other work only ever adds time


def _device_memory(ctx: WorkerContext) -> int:
    if ctx.device.type == "cuda":
        return torch.cuda.mem_get_info(ctx.device)[1]
    import psutil

    return psutil.virtual_memory().total // ctx.world_size  # CPU workers share the host's memory


@handler("measure_link")
def measure_link(ctx: WorkerContext, megabytes: float = 8.0, repeats: int = 5) -> dict[str, Any]:
    """Every rank runs this together (it all-reduces); each returns its own figures."""
    device = ctx.device
    n = ctx.world_size
    result: dict[str, Any] = {"rank": ctx.rank, "device": str(device), "world_size": n}
    if n > 1:
        big = torch.ones(int(megabytes * 1e6) // 4, dtype=torch.float32, device=device)
        tiny = torch.ones(1, dtype=torch.float32, device=device)
        latency = _timed(lambda: dist.all_reduce(tiny), device, repeats)
        seconds = _timed(lambda: dist.all_reduce(big), device, repeats)
        moved = 2 * (n - 1) / n * big.numel() * 4
        result.update(gbps=moved / max(seconds - latency, 1e-9) / 1e9, latency_us=latency * 1e6)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    side = 4096 if device.type == "cuda" else 512
    a = torch.randn(side, side, dtype=dtype, device=device)
    seconds = _timed(lambda: a @ a, device, repeats)
    result["tflops"] = 2 * side**3 / seconds / 1e12
    result["memory_bytes"] = _device_memory(ctx)
    return result
