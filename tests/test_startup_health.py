"""Group start-up: the health check, its retry without peer-to-peer, CPU threads shared out."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from rocm_parallel.backend.client import WorkerError, WorkerGroup
from rocm_parallel.backend.platforms import default_cpu_threads

TESTS_DIR = str(Path(__file__).resolve().parent)


def _alive(pids: list[int]) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_start_checks_collectives_and_shares_cpu_cores_out() -> None:
    """No `threads` given: each CPU worker runs cores // workers torch threads (at least one)."""
    cores = len(os.sched_getaffinity(0))
    with WorkerGroup(["cpu", "cpu"]) as group:
        assert [h.threads for h in group.health] == [max(1, cores // 2)] * 2
        assert [h.correct for h in group.health] == [True, True]
        assert [h.world_size for h in group.health] == [2, 2]
        assert group.warnings == []
        assert group.threads == max(1, cores // 2)


@pytest.mark.parametrize(("workers", "cores", "threads"), [(2, 2, 1), (2, 16, 8), (4, 2, 1), (3, 16, 5)])
def test_default_cpu_threads(workers: int, cores: int, threads: int) -> None:
    assert default_cpu_threads(workers, cores) == threads


def test_a_hung_first_collective_is_retried_without_p2p_and_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first health check hangs (tests/hang_checks.py: rank 0 stays out of the all-reduce while P2P
    is on); after `health_timeout` the group is torn down, started again with NCCL_P2P_DISABLE=1, works,
    and says what it changed and how to make it permanent.

    Mutation tried: with the retry removed from `WorkerGroup._start` (re-raising the first failure), this
    test fails with "WorkerError: health check failed: 'health_check' did not finish within 4 s ...".
    """
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    started = time.monotonic()
    group = WorkerGroup(
        ["cpu", "cpu"],
        threads=1,
        extra_sys_path=[TESTS_DIR],
        methods=["hang_checks"],
        health_timeout=4.0,
        retry_without_p2p=True,  # on by default for GPUs only; CPU workers stand in for them here
    )
    try:
        assert time.monotonic() - started >= 4.0  # it did wait for the first check
        assert [h.env["NCCL_P2P_DISABLE"] for h in group.health] == ["1", "1"]
        assert [h.correct for h in group.health] == [True, True]
        (warning,) = group.warnings
        assert warning.startswith(
            "the first collective over cpu, cpu failed with peer-to-peer transfers enabled"
        )
        assert "'health_check' did not finish within 4 s (rank 0 computing 'health_check' (" in warning
        assert "rank 1 waiting in collective #1 (all_reduce over ranks 0, 1) for " in warning
        assert "started again with NCCL_P2P_DISABLE=1 and now works" in warning
        assert "start ComfyUI with NCCL_P2P_DISABLE=1 in its environment" in warning
        assert group.call("ping").backend == "gloo"
    finally:
        group.close()
    assert not _alive(group.pids)


def test_without_the_retry_a_hung_start_fails_with_the_hang() -> None:
    """retry_without_p2p=False (the default for CPU workers): the start fails at `health_timeout`, saying
    where each rank is (rank 0 never joins the collective: it looks busy, so only the time limit can
    end it), and leaves no worker behind."""
    before = psutil.Process().children()
    with pytest.raises(WorkerError) as err:
        WorkerGroup(
            ["cpu", "cpu"],
            threads=1,
            extra_sys_path=[TESTS_DIR],
            methods=["hang_checks"],
            env={"NCCL_P2P_DISABLE": "0"},
            health_timeout=3.0,
            retry_without_p2p=False,
        )
    assert re.fullmatch(
        r"health check failed: 'health_check' did not finish within 3 s \(rank 0 computing 'health_check' "
        r"\(\d s so far\), rank 1 waiting in collective #1 \(all_reduce over ranks 0, 1\) for \d s\); the "
        r"worker group was stopped",
        str(err.value),
    ), str(err.value)
    assert not _alive([c.pid for c in psutil.Process().children() if c not in before])


def _stop_rank_when_it_starts(rank: int, stopped: list[int]) -> threading.Thread:
    """SIGSTOP this process's worker of `rank` as soon as it exists (it is importing torch then, long
    before it connects)."""

    known = {c.pid for c in psutil.Process().children()}  # the session's groups: not the one starting

    def watch() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not stopped:
            for child in (c for c in psutil.Process().children() if c.pid not in known):
                try:
                    if child.environ().get("RP_RANK") == str(rank):
                        child.send_signal(signal.SIGSTOP)
                        stopped.append(child.pid)
                        return
                except psutil.Error:
                    continue
            time.sleep(0.01)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_a_rank_stopped_before_it_connects_is_named_within_seconds() -> None:
    """Rank 1 is stopped (SIGSTOP) while it imports torch: the start fails in seconds naming rank 1, not
    after `start_timeout` naming no one. Mutation tried: without `_check_starting`'s liveness verdict the
    start waited for the whole start_timeout (60 s here) and said 'did not finish connecting'."""
    before = psutil.Process().children()
    stopped: list[int] = []
    watcher = _stop_rank_when_it_starts(1, stopped)
    started = time.monotonic()
    with pytest.raises(WorkerError) as err:
        WorkerGroup(["cpu", "cpu"], threads=1, start_timeout=60)
    took = time.monotonic() - started
    watcher.join()
    assert str(err.value).startswith(
        f"worker rank 1 (cpu, pid {stopped[0]}) is stopped (SIGSTOP or a debugger) while starting ("
    ), str(err.value)
    assert "(it had not connected yet)" in str(err.value)
    assert err.value.rank == 1 and took < 30, took  # the other rank's own start-up counts in here
    assert not _alive([c.pid for c in psutil.Process().children() if c not in before])


def _importing(what: str) -> WorkerGroup:
    return WorkerGroup(
        ["cpu", "cpu"], threads=1, start_timeout=300, extra_sys_path=[TESTS_DIR],
        methods=["worker_jobs", "startup_checks"], env={"RP_TEST_IMPORT": what},
    )  # fmt: skip


def test_a_rank_blocked_while_importing_is_named_within_seconds(tmp_path: Path) -> None:
    """Rank 1 blocks in Python while importing its methods (its reports go on: 'starting (importing its
    methods)'); rank 0 is ready and waits for it. The start fails within 15 s of the block naming rank 1,
    long before `start_timeout`. Mutation tried: without `Liveness._waiting_ahead` the start waited for the
    whole start_timeout (before this rule: 61.2 s with 60)."""
    before = psutil.Process().children()
    stamp = tmp_path / "blocked"
    with pytest.raises(WorkerError) as err:
        _importing(f"block:1:{stamp}")
    took = time.monotonic() - float(stamp.read_text())
    assert re.match(
        r"worker rank 1 \(cpu, pid \d+\) does no work while starting: it reports starting \(importing its "
        r"methods, \d+ s so far\), but for \d+ s it has used no CPU, waited for no disk and queued no GPU "
        r"work, and rank 0 is ready: it is blocked",
        str(err.value),
    ), str(err.value)
    assert "(it had connected)" in str(err.value)
    assert err.value.rank == 1 and took < 15, took
    assert not _alive([c.pid for c in psutil.Process().children() if c not in before])


def test_a_slow_import_that_works_completes() -> None:
    """Rank 1 works 40 s while importing its methods (rank 0 ready, waiting): the group starts."""
    started = time.monotonic()
    group = _importing("work:1:40")
    try:
        assert time.monotonic() - started >= 40
        assert [r.rank for r in group.call_all("ping")] == [0, 1]
    finally:
        group.close()
