"""Every kind of hang a rank can be in, named with the right rank on a quiet machine and beside more CPU
burners than cores, and the group closed without blocking its caller (issue 56).

Rank 1 hangs in step 3 of `hang_at` (tests/worker_jobs.py) while rank 0 waits for it in the step's
all-reduce: in Python (a sleep while a thread of it uses a fifth of a core, as gloo's threads do a little;
a lock), in a native call that keeps the interpreter, in the kernel (state D, its reports going on: a stuck
driver call), stopped (SIGSTOP) or frozen by its cgroup (v1: D, SIGKILL held until the thaw; v2: asleep).
The windows are the suite's (tests/bounds.py `SCALED`); `python -m rocm_parallel bench hangs` runs the
same kinds with the default watchdog, 20 times each way.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import replace
from pathlib import Path

import freezers
import psutil
import pytest
from bounds import CLOSE_WITHIN, HANG_NAMED_WITHIN, SCALED
from test_contention import burning
from worker_jobs import OnRank

from rocm_parallel.backend.runtime.client import WorkerError, WorkerGroup

TESTS_DIR = str(Path(__file__).resolve().parent)
# The D window shortened further: the test shows a rank in D is named after its own window, longer than
# `idle` (the Python hangs' window), not how long 12 s is.
WATCHDOG = replace(SCALED, uninterruptible=2 * SCALED.idle)

# kind -> (OnRank options, how the error goes on after "worker rank 1 (cpu, pid N) ", the window it waits)
KINDS = {
    "sleep": ({"kind": "sleep", "seconds": 3600.0, "noise": 0.2}, "does no work while", WATCHDOG.idle),
    "lock": ({"kind": "lock"}, "does no work while", WATCHDOG.idle),
    "native": ({"kind": "native"}, "stopped reporting", WATCHDOG.idle),
    "kernel": ({"kind": "kernel"}, "has been in uninterruptible sleep (D) for", WATCHDOG.uninterruptible),
    "stop": ({"kind": "stop"}, "is stopped (SIGSTOP or a debugger) while", WATCHDOG.stopped),
    "freeze v1": ({"kind": "freeze"}, "is frozen by its cgroup's freezer (", WATCHDOG.stopped),
    "freeze v2": ({"kind": "freeze2"}, "is frozen by its cgroup's freezer (", WATCHDOG.stopped),
}


def _group() -> WorkerGroup:
    return WorkerGroup(
        ["cpu", "cpu"], threads=1, extra_sys_path=[TESTS_DIR], methods=["worker_jobs"], watchdog=WATCHDOG
    )


def _freezer(kind: str) -> int:
    """The cgroup version a kind freezes with (0: none); the test is skipped where it cannot."""
    version = {"freeze v1": 1, "freeze v2": 2}.get(kind, 0)
    if version and (why := freezers.unusable(version)):
        pytest.skip(why)
    return version


def _left(pids: list[int]) -> list[int]:
    """The workers, and the processes they started (their process groups), still running."""
    left = []
    for proc in psutil.process_iter(["pid", "status"]):
        with contextlib.suppress(psutil.Error, OSError):
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(proc.pid) in pids:
                left.append(proc.pid)
    return left


def _gone(pids: list[int], within: float = 10.0) -> bool:
    """Every worker and every process a worker started is gone (a vfork child that never exec'd, a
    compiler): `launch.reap` kills a worker's process group when it exits. Mutation tried: `reap` as a plain
    `poll()` left the kernel kind's child waiting on its FIFO when the death pipe ended its worker."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not _left(pids):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("burners", [False, True], ids=["quiet", "beside burners"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_of_hang_is_named_and_the_group_closes(kind: str, burners: bool, tmp_path: Path) -> None:
    """The error names rank 1 alone, by its kind, after that kind's window and within the bound, and the
    caller gets it without waiting for a process SIGKILL cannot end (frozen v1: left to the OS, said in
    the error). Mutations tried: counting every thread's CPU again kept the sleeping rank 'working'
    (the caller's time limit ended the job naming rank 0); without the D rule the kernel kind was never
    named; the old `proc.kill(); proc.wait()` kept 'freeze v1' from ever returning."""
    options, named, window = KINDS[kind]
    version = _freezer(kind)
    stamp = tmp_path / "hung"
    with burning() if burners else contextlib.nullcontext():
        group = _group()
        victim = group.pids[1]
        try:
            with pytest.raises(WorkerError) as err:
                group.call("hang_at", OnRank(rank=1, at_step=3, stamp=str(stamp), **options), timeout=60)
            raised = time.monotonic()
            took = raised - float(stamp.read_text())
            started = time.monotonic()
            group.close()
            closed = time.monotonic() - started
        finally:
            if version:
                freezers.thaw(version, victim)
    assert str(err.value).startswith(f"worker rank 1 (cpu, pid {victim}) {named}"), str(err.value)
    assert err.value.rank == 1 and "worker rank 0" not in str(err.value)
    assert window < took < HANG_NAMED_WITHIN, took
    assert closed < CLOSE_WITHIN and not group.alive
    if kind == "freeze v1":  # SIGKILL waited for the thaw: the caller was told, and did not wait
        assert "SIGKILL did not end worker rank 1" in str(err.value) and "left to the OS" in str(err.value)
    assert _gone(group.pids)


@pytest.mark.parametrize("version", [1, 2])
def test_close_returns_with_a_rank_frozen_between_jobs(version: int) -> None:
    """A rank frozen while the group is idle: `close()` asks every rank to leave, sees the frozen one cannot
    (its peers wait for it in the leaving barrier), and returns within the bound; a v1-frozen rank is left to
    the OS and ends when thawed. Mutation tried: without the early end of the grace when a rank cannot run
    (`stop_early`), close() took the whole 15 s grace."""
    if why := freezers.unusable(version):
        pytest.skip(why)
    group = _group()
    victim = group.pids[1]
    group.call("ping")
    try:
        freezers.freeze(version, victim)
        started = time.monotonic()
        group.close()
        closed = time.monotonic() - started
    finally:
        freezers.thaw(version, victim)
    assert closed < CLOSE_WITHIN, closed
    assert not group.alive and _gone(group.pids)
