"""Methods the worker-group tests run inside the workers (`WorkerGroup(methods=["worker_jobs"])`,
imported there through tests/ on the workers' sys.path), with their request and reply records (the test
process imports this module too, so both sides know them by name)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rocm_parallel.backend.transport import record
from rocm_parallel.backend.worker import HANDLERS, Handler, handler


@record
@dataclass(frozen=True)
class Steps:
    """A job of `n` steps of `seconds` each; with `log`, each rank writes how many steps it finished to
    `log`.rank<k> (a test reads what the workers did, not what the client relayed)."""

    n: int
    seconds: float = 0.0
    log: str = ""


@record
@dataclass(frozen=True)
class StepsDone:
    rank: int
    steps: int
    sum: float


@record
@dataclass(frozen=True)
class Scale:
    tensor: torch.Tensor


@record
@dataclass(frozen=True)
class Scaled:
    rank: int
    scaled: torch.Tensor
    files: tuple[str, ...]  # what the worker saw in the shared directory


@record
@dataclass(frozen=True)
class OnRank:
    """Something `rank` does (fail, hang) at step `at_step` of `n`; `kind`: 'oom' or 'stop' (SIGSTOP)."""

    rank: int
    at_step: int = 0
    n: int = 100
    kind: str = "oom"


@record
@dataclass(frozen=True)
class Rank:
    rank: int


@record
@dataclass(frozen=True)
class Value:
    value: int


@record
@dataclass(frozen=True)
class Load:
    """A load (no collectives): `tensors` tensors, `seconds` each on every rank but rank 0 (or on every
    rank but `failing`, which runs out of memory at once); with `hang_after`, the slow ranks stop
    answering after that many tensors (a stuck disk read)."""

    tensors: int
    seconds: float
    hang_after: int = 0
    failing: int = -1


@handler("steps", Steps)
def steps(ctx, request: Steps) -> StepsDone:
    """A job of n steps that needs every rank at every step (like a denoising loop)."""
    total = torch.zeros(1)
    for step in range(1, request.n + 1):
        time.sleep(request.seconds)
        t = torch.ones(1)
        dist.all_reduce(t)
        total += t
        if request.log:
            with open(f"{request.log}.rank{ctx.rank}", "w") as f:
                f.write(str(step))
        ctx.step_done(step, request.n)
    return StepsDone(rank=ctx.rank, steps=request.n, sum=float(total))


@handler("scale", Scale)
def scale(ctx, request: Scale) -> Scaled:
    return Scaled(ctx.rank, request.tensor * (ctx.rank + 1), tuple(sorted(os.listdir(ctx.shm_dir))))


@handler("out_of_memory", OnRank)
def out_of_memory(ctx, request: OnRank) -> None:
    if ctx.rank == request.rank:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")


@handler("fail_in_collective", OnRank)
def fail_in_collective(ctx, request: OnRank) -> Rank:
    """One rank runs out of memory at `at_step` while its peers enter that step's all-reduce: the most
    common multi-GPU fault, and the one that leaves the peers blocked."""
    for step in range(1, request.n + 1):
        if ctx.rank == request.rank and step == request.at_step:
            raise torch.OutOfMemoryError("HIP out of memory. Tried to allocate 2.00 GiB")
        t = torch.ones(1)
        dist.all_reduce(t)
        ctx.step_done(step, request.n)
    return Rank(ctx.rank)


@handler("send_stale_reply", Value)
def send_stale_reply(ctx, request: Value) -> Value:
    """Before its real reply, rank 0 sends a reply of the previous job id (a late reply of a cancelled
    job looks like this): the client must not take it for this job's."""
    from rocm_parallel.backend.transport import Reply, pack, send

    if ctx.rank == 0:
        stale = pack(Value(-1), ctx.shm_dir, "stale")
        send(ctx.conn, Reply(job=ctx.job - 1, rank=0, ok=True, result=stale))
    return request


def _fail_once(at: int, stop: bool, method: str | None = None) -> None:
    """Make this worker run out of memory once (after SIGSTOPping itself when `stop`): at the `at`-th call
    of worker method `method`, before it runs, or else at the `at`-th `WorkerContext.load_progress`."""
    import signal

    from rocm_parallel.backend.worker import WorkerContext

    def fail() -> None:
        if stop:
            os.kill(os.getpid(), signal.SIGSTOP)
        raise torch.OutOfMemoryError("HIP out of memory. Tried to allocate 2.00 GiB")

    if method is not None:
        original, calls = HANDLERS[method], []

        def failing(ctx, *request):
            calls.append(1)
            if len(calls) == at:
                HANDLERS[method] = original
                fail()
            return original.fn(ctx, *request)

        HANDLERS[method] = Handler(failing, original.request_type)
        return
    progress = WorkerContext.load_progress

    def failing_load(self, done: int, total: int) -> None:
        if done == at:
            WorkerContext.load_progress = progress
            fail()
        progress(self, done, total)

    WorkerContext.load_progress = failing_load


@handler("arm_failure", OnRank)
def arm_failure(ctx, request: OnRank) -> None:
    """Make `rank` fail in step `at_step` of the NEXT sampling job (out of memory, or SIGSTOP itself), the
    way a real GPU fails in the middle of a denoising loop: every step is one `flux_forward`, so its
    `at_step`-th forward fails on entry while its peers run that forward and wait for it in a collective."""
    if ctx.rank == request.rank:
        _fail_once(request.at_step, stop=request.kind == "stop", method="flux_forward")


@handler("hang_at", OnRank)
def hang_at(ctx, request: OnRank) -> Rank:
    """`rank` stops answering at `at_step` (alive, not stopped: as if stuck in a driver call)."""
    for step in range(1, request.n + 1):
        if ctx.rank == request.rank and step == request.at_step:
            time.sleep(3600)
        t = torch.ones(1)
        dist.all_reduce(t)
        ctx.step_done(step, request.n)
    return Rank(ctx.rank)


@handler("arm_load_failure", OnRank)
def arm_load_failure(ctx, request: OnRank) -> None:
    """Make `rank` run out of memory at tensor `at_step` of the NEXT load (its peers load in full)."""
    if ctx.rank == request.rank:
        _fail_once(request.at_step, stop=False)


@handler("uneven_load", Load)
def uneven_load(ctx, request: Load) -> Rank:
    """A load where rank 0 is fast and every other rank takes `seconds` per tensor (see `Load`)."""
    for done in range(1, request.tensors + 1):
        if ctx.rank:
            stuck = request.hang_after and done > request.hang_after
            time.sleep(3600 if stuck else request.seconds)
        ctx.load_progress(done, request.tensors)
    return Rank(ctx.rank)


@handler("load_then_fail", Load)
def load_then_fail(ctx, request: Load) -> Rank:
    """`failing` runs out of memory at once; the others load `tensors` tensors, `seconds` each."""
    if ctx.rank == request.failing:
        raise torch.OutOfMemoryError("HIP out of memory. Tried to allocate 2.00 GiB")
    for done in range(1, request.tensors + 1):
        time.sleep(request.seconds)
        ctx.load_progress(done, request.tensors)
    return Rank(ctx.rank)


@handler("forget_caches")
def forget_caches(ctx) -> None:
    """Drop what jobs keep for the resident model (as a restarted worker would have nothing)."""
    ctx.resident.caches.clear()


@handler("returns_a_dict")
def returns_a_dict(ctx) -> dict:
    """A method that answers with a plain dict: the worker must refuse to send it."""
    return {"rank": ctx.rank}


@handler("returns_an_unknown_record")
def returns_an_unknown_record(ctx) -> object:
    """A reply record only the workers know (registered here, at run time): the caller must refuse it."""

    @record
    @dataclass(frozen=True)
    class OnlyOnTheWorkers:
        rank: int

    return OnlyOnTheWorkers(ctx.rank)
