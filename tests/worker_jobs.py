"""Methods the worker-group tests run inside the workers (`WorkerGroup(methods=["worker_jobs"])`,
imported there through tests/ on the workers' sys.path)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from rocm_parallel.backend.worker import handler


@handler("steps")
def steps(ctx, n: int, seconds: float = 0.0) -> dict:
    """A job of n steps that needs every rank at every step (like a denoising loop)."""
    total = torch.zeros(1)
    for step in range(1, n + 1):
        time.sleep(seconds)
        t = torch.ones(1)
        dist.all_reduce(t)
        total += t
        ctx.step_done(step, n)
    return {"rank": ctx.rank, "steps": n, "sum": float(total)}


@handler("scale")
def scale(ctx, tensor: torch.Tensor) -> dict:
    return {"rank": ctx.rank, "scaled": tensor * (ctx.rank + 1), "files": sorted(os.listdir(ctx.shm_dir))}


@handler("out_of_memory")
def out_of_memory(ctx, rank: int) -> None:
    if ctx.rank == rank:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")


@handler("pid")
def pid(ctx) -> int:
    return os.getpid()
