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


@handler("steps_logged")
def steps_logged(ctx, n: int, log: str, seconds: float = 0.0) -> dict:
    """`steps`, writing how many steps this rank finished to `log`.rank<k>: a test reads what the
    workers did, not what the client relayed."""
    path = f"{log}.rank{ctx.rank}"
    for step in range(1, n + 1):
        time.sleep(seconds)
        t = torch.ones(1)
        dist.all_reduce(t)
        with open(path, "w") as f:
            f.write(str(step))
        ctx.step_done(step, n)
    return {"rank": ctx.rank, "steps": n}


@handler("fail_in_collective")
def fail_in_collective(ctx, rank: int, at_step: int, n: int = 100) -> dict:
    """One rank runs out of memory at `at_step` while its peers enter that step's all-reduce: the most
    common multi-GPU fault, and the one that leaves the peers blocked."""
    for step in range(1, n + 1):
        if ctx.rank == rank and step == at_step:
            raise torch.OutOfMemoryError("HIP out of memory. Tried to allocate 2.00 GiB")
        t = torch.ones(1)
        dist.all_reduce(t)
        ctx.step_done(step, n)
    return {"rank": ctx.rank}


@handler("send_stale_reply")
def send_stale_reply(ctx, value: int) -> dict:
    """Before its real reply, rank 0 sends a reply of the previous job id (a late reply of a cancelled
    job looks like this): the client must not take it for this job's."""
    from rocm_parallel.backend.transport import Reply, send

    if ctx.rank == 0:
        send(ctx.conn, Reply(job=ctx.job - 1, rank=0, ok=True, result={"value": -1}))
    return {"value": value}


def _fail_once(method: str, at: int, stop: bool = False) -> None:
    """Patch WorkerContext.<method> (step_done or load_progress) in this worker so that its call for
    step/tensor `at` runs out of memory once (after SIGSTOPping this process when `stop`)."""
    import signal

    from rocm_parallel.backend.worker import WorkerContext

    original = getattr(WorkerContext, method)

    def failing(self, done: int, total: int) -> None:
        if done == at:
            setattr(WorkerContext, method, original)
            if stop:
                os.kill(os.getpid(), signal.SIGSTOP)
            raise torch.OutOfMemoryError("HIP out of memory. Tried to allocate 2.00 GiB")
        original(self, done, total)

    setattr(WorkerContext, method, failing)


@handler("arm_failure")
def arm_failure(ctx, rank: int, at_step: int, kind: str = "oom") -> bool:
    """Make `rank` fail at step `at_step` of the NEXT sampling job (out of memory, or SIGSTOP itself),
    the way a real GPU fails in the middle of a denoising loop."""
    if ctx.rank == rank:
        _fail_once("step_done", at_step, stop=kind == "stop")
    return ctx.rank == rank


@handler("hang_at")
def hang_at(ctx, rank: int, at_step: int, n: int = 100) -> dict:
    """`rank` stops answering at `at_step` (alive, not stopped: as if stuck in a driver call)."""
    for step in range(1, n + 1):
        if ctx.rank == rank and step == at_step:
            time.sleep(3600)
        t = torch.ones(1)
        dist.all_reduce(t)
        ctx.step_done(step, n)
    return {"rank": ctx.rank}


@handler("arm_load_failure")
def arm_load_failure(ctx, rank: int, at_tensor: int) -> bool:
    """Make `rank` run out of memory at tensor `at_tensor` of the NEXT load (its peers load in full)."""
    if ctx.rank == rank:
        _fail_once("load_progress", at_tensor)
    return ctx.rank == rank


@handler("uneven_load")
def uneven_load(ctx, tensors: int, seconds: float, hang_after: int = 0) -> dict:
    """A load (no collectives) where rank 0 is fast and every other rank takes `seconds` per tensor;
    with `hang_after`, the other ranks stop answering after that many tensors (a stuck disk read)."""
    for done in range(1, tensors + 1):
        if ctx.rank:
            time.sleep(3600 if hang_after and done > hang_after else seconds)
        ctx.load_progress(done, tensors)
    return {"rank": ctx.rank}


@handler("load_then_fail")
def load_then_fail(ctx, failing: int, tensors: int, seconds: float) -> dict:
    """`failing` runs out of memory at once; the others load `tensors` tensors, `seconds` each."""
    if ctx.rank == failing:
        raise torch.OutOfMemoryError("HIP out of memory. Tried to allocate 2.00 GiB")
    for done in range(1, tensors + 1):
        time.sleep(seconds)
        ctx.load_progress(done, tensors)
    return {"rank": ctx.rank}


@handler("forget_caches")
def forget_caches(ctx) -> None:
    """Drop what jobs keep for the resident model (as a restarted worker would have nothing)."""
    ctx.resident.caches.clear()
