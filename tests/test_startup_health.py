"""Group start-up: the health check and the transport pre-flight's ladder (peer-to-peer off, the Simple
protocol, gloo) with its probe faked to hang, fail or corrupt on CPU workers; CPU threads shared out."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
from bounds import HANG_NAMED_WITHIN, OUTLAST, SCALED

from rocm_parallel.backend import doctor
from rocm_parallel.backend.config import ConfigError
from rocm_parallel.backend.platforms import default_cpu_threads
from rocm_parallel.backend.runtime import preflight
from rocm_parallel.backend.runtime.client import WorkerError, WorkerGroup
from rocm_parallel.backend.runtime.liveness import DEFAULT_WATCHDOG, Watchdog

TESTS_DIR = str(Path(__file__).resolve().parent)


def _alive(pids: list[int]) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


@pytest.mark.torch_api
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


@pytest.mark.torch_api
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
        assert group.transport is preflight.SHM
        assert group.transport_note == (
            "collectives: NCCL/RCCL through host shared memory (peer-to-peer off) (the faster ones failed at "
            "start: Status node)"
        )
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


def _faulty_group(faults: str, **env: str) -> WorkerGroup:
    return WorkerGroup(
        ["cpu", "cpu"], threads=1, extra_sys_path=[TESTS_DIR], methods=["transport_checks"],
        env={"RP_TEST_TRANSPORT_FAULTS": faults, **env}, health_timeout=3.0, retry_without_p2p=True,
    )  # fmt: skip


@pytest.mark.slow
def test_the_ladder_falls_to_gloo_and_says_what_it_costs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every NCCL rung fails its pair probe (an NCCL error with P2P, a wrong value without, an NCCL error
    with the Simple protocol; a hang is the next test's): the group ends on gloo, works, and says each
    failure, how to keep gloo, and what gloo costs as the planner prices it over the link measured here.

    Mutation tried: with `preflight.LADDER` cut to (P2P, SHM) the start failed with the
    wrong-value error and this test failed."""
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    group = _faulty_group("nccl=error,nccl-shm=wrong,nccl-shm-simple=error")
    try:
        assert group.transport is preflight.GLOO
        assert [p.correct for p in group.pairs] == [True, True]
        assert set(group.pairs[0].pairs) == {"0-1"}
        assert group.call("ping").backend == "gloo"
        fallback, cost = group.warnings
        assert fallback.startswith(
            "the first collective over cpu, cpu failed with peer-to-peer transfers enabled"
        )
        assert re.search(  # every rank raises: whichever reply the client reads first is named
            r"\(health check failed: rank [01] \(cpu\): RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:2011",
            fallback,
        ), fallback
        assert (
            "; then with NCCL_P2P_DISABLE=1: health check failed: rank 1 (cpu) got wrong collective results "
            in fallback
        )
        assert "(from rank 0: 7 (expected 1))" in fallback
        assert "; then with NCCL_P2P_DISABLE=1 NCCL_PROTO=Simple: health check failed: " in fallback
        assert "NCCL error in: ProcessGroupNCCL.cpp:2011, unhandled system error" in fallback
        assert "the worker group was started again with backend='gloo' and now works" in fallback
        assert "start ComfyUI with ROCM_PARALLEL_BACKEND=gloo" in fallback
        found = re.search(
            r"^collectives run through gloo; the planner prices one flux1-dev 1024x1024 step at tp 2 \(100 "
            r"TFLOPS per GPU\) at (\d+\.\d\d) s over gloo as measured here \((\d+\.\d\d) GB/s, (\d+) µs per "
            r"collective\) against (\d+\.\d\d) s over PCIe 4.0 x16 peer-to-peer",
            cost,
        )
        assert found, cost
        assert float(found[1]) > float(found[4]) > 0  # a CPU's loopback is slower than 24 GB/s
        assert group.transport_why == (
            "the defaults, NCCL_P2P_DISABLE=1, NCCL_P2P_DISABLE=1 NCCL_PROTO=Simple failed the start-up probe "
            "(warnings)"
        )
        report = doctor.check_group(group.devices, group=group)
        assert doctor.transport_line(report) == (
            "transport: gloo through host memory over loopback TCP (backend='gloo'): the defaults, "
            "NCCL_P2P_DISABLE=1, NCCL_P2P_DISABLE=1 NCCL_PROTO=Simple failed the start-up probe (warnings); "
            "probe: all-reduce, all-gather, 1 pair(s) (0-1)"
        )
    finally:
        group.close()
    assert not _alive(group.pids)


@pytest.mark.slow
def test_a_hung_pair_probe_is_ended_by_its_limit_and_the_next_transport_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The group-wide all-reduce and all-gather pass; only the pair exchange hangs with P2P on (rank 0
    never joins it, as a broken link between two GPUs does): after `health_timeout` the group is stopped,
    started again with peer-to-peer off, works, and no worker of the first start is left.
    Mutation tried: with the `probe_pairs` call removed from `WorkerGroup._check_health` the group stayed
    on P2P and this test failed."""
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    before = psutil.Process().children()
    group = _faulty_group("nccl=hang")
    try:
        assert group.transport is preflight.SHM
        assert [h.correct for h in group.health] == [True, True]
        assert [p.correct for p in group.pairs] == [True, True]
        (warning,) = group.warnings
        assert warning.startswith(
            "the first collective over cpu, cpu failed with peer-to-peer transfers enabled (health check "
            "failed: 'probe_pairs' did not finish within 3 s (rank 0 computing 'probe_pairs' ("
        ), warning
        assert "started again with NCCL_P2P_DISABLE=1 and now works" in warning
        assert group.transport_why == "the defaults" + preflight.FAILED
        started = {c.pid for c in psutil.Process().children() if c not in before}
        assert set(_alive(list(started))) == set(group.pids)  # the hung first start's workers are gone
    finally:
        group.close()
    assert not _alive(group.pids)


def test_when_every_transport_fails_the_start_fails_with_each_failure() -> None:
    """The user set NCCL_P2P_DISABLE=1: the ladder starts there (P2P is never turned back on), and when
    every rung fails the start fails with the last failure, the earlier ones as notes, nothing left."""
    before = psutil.Process().children()
    with pytest.raises(WorkerError) as err:
        _faulty_group("nccl=hang,nccl-shm=error,nccl-shm-simple=error,gloo=wrong", NCCL_P2P_DISABLE="1")
    assert str(err.value) == (
        "health check failed: rank 1 (cpu) got wrong collective results (from rank 0: 7 (expected 1)); "
        "peer-to-peer transfers may corrupt data"
    )
    notes = err.value.__notes__
    assert [n.split(":")[0] for n in notes] == [
        "before that, with NCCL_P2P_DISABLE=1",
        "before that, with NCCL_P2P_DISABLE=1 NCCL_PROTO=Simple",
    ]
    assert all("unhandled system error" in n for n in notes)
    assert not _alive([c.pid for c in psutil.Process().children() if c not in before])


def test_a_users_own_settings_are_where_the_ladder_starts() -> None:
    """NCCL_P2P_DISABLE=1 set by the user: never started with P2P again; only later rungs are tried."""
    plan = preflight.plan_transports(
        ["cuda:0", "cuda:1"], None, {"NCCL_P2P_DISABLE": "1"}, retry=True, nccl_available=True
    )
    assert plan.ladder == (preflight.SHM, preflight.SIMPLE, preflight.GLOO)
    plan = preflight.plan_transports(["cuda:0", "cuda:1"], "nccl", {}, retry=True, nccl_available=True)
    assert plan.ladder == (preflight.P2P, preflight.SHM, preflight.SIMPLE)  # backend='nccl': never gloo
    plan = preflight.plan_transports(["cuda:0", "cuda:1"], None, {}, retry=False, nccl_available=True)
    assert plan.ladder == (preflight.P2P,)


def test_a_users_own_nccl_proto_is_kept_on_every_rung(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL_PROTO=LL128 set by the user: the Simple rung (which would replace it) is never tried, and the
    workers of every rung that is tried run with the user's protocol. P2P fails its probe here, so the group
    is started a second time (peer-to-peer off) and the user's NCCL_PROTO must survive that restart too.

    Mutation tried: with the `env.get("NCCL_PROTO")` filter removed from `plan_transports`, the plan kept the
    Simple rung and, with the shared-memory rung failing as well, the workers ran with NCCL_PROTO=Simple:
    this test failed."""
    plan = preflight.plan_transports(
        ["cuda:0", "cuda:1"], None, {"NCCL_PROTO": "LL128"}, retry=True, nccl_available=True
    )
    assert plan.ladder == (preflight.P2P, preflight.SHM, preflight.GLOO)
    assert [preflight.worker_env(t, {"NCCL_PROTO": "LL128"})["NCCL_PROTO"] for t in plan.ladder] == [
        "LL128"
    ] * 3
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    group = _faulty_group("nccl=error,nccl-shm=error", NCCL_PROTO="LL128")
    try:
        assert group.transport is preflight.GLOO
        assert [h.env["NCCL_PROTO"] for h in group.health] == ["LL128", "LL128"]
        assert group.transport_why == "the defaults, NCCL_P2P_DISABLE=1" + preflight.FAILED
        (fallback, _cost) = group.warnings
        assert "NCCL_PROTO=Simple" not in fallback, fallback
    finally:
        group.close()
    assert not _alive(group.pids)


def test_gpus_without_nccl_start_on_gloo_and_the_planner_prices_it() -> None:
    """Strix Halo (no RCCL for gfx1151) or a torch without NCCL: gloo from the start, said and priced."""
    plan = preflight.plan_transports(["cuda:0", "cuda:1"], None, {}, retry=True, nccl_available=False)
    assert plan.ladder == (preflight.GLOO,)
    assert plan.why.startswith("this torch has no NCCL/RCCL (torch ") and plan.why.endswith(
        "): gloo through host memory over loopback TCP"
    )
    cost = preflight.gloo_cost(2, gbps=3.0, latency_us=200.0)
    assert cost.startswith("the planner prices one flux1-dev 1024x1024 step at tp 2 (100 TFLOPS per GPU) at ")
    assert "over gloo as measured here (3.00 GB/s, 200 µs per collective) against " in cost
    assert cost.endswith("`python -m rocm_parallel plan --devices 2 --link-gbps 3.00 --latency-us 200`)")


def test_the_backend_can_be_forced_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(preflight.TRANSPORT_FORCE, "gloo")
    assert preflight.forced_backend(None) == "gloo" and preflight.forced_backend("nccl") == "nccl"
    monkeypatch.setenv(preflight.TRANSPORT_FORCE, "mpi")
    with pytest.raises(ConfigError) as err:
        WorkerGroup(["cpu", "cpu"])
    assert (
        str(err.value) == "ROCM_PARALLEL_BACKEND='mpi' in the environment; use 'gloo' or 'nccl', or unset it"
    )


def _importing(what: str, watchdog: Watchdog = DEFAULT_WATCHDOG) -> WorkerGroup:
    return WorkerGroup(
        ["cpu", "cpu"], threads=1, start_timeout=300, extra_sys_path=[TESTS_DIR],
        methods=["worker_jobs", "startup_checks"], env={"RP_TEST_IMPORT": what}, watchdog=watchdog,
    )  # fmt: skip


def test_a_rank_blocked_while_importing_is_named_within_seconds(tmp_path: Path) -> None:
    """Rank 1 blocks in Python while importing its methods (its reports go on: 'starting (importing its
    methods)'); rank 0 is ready and waits for it. The start fails within seconds (tests/bounds.py) of the block naming rank 1,
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
    assert err.value.rank == 1 and took < HANG_NAMED_WITHIN, took
    assert not _alive([c.pid for c in psutil.Process().children() if c not in before])


@pytest.mark.slow
def test_a_slow_import_that_works_completes() -> None:
    """Rank 1 works 5 `idle` windows (40 s under the default watchdog) while importing its methods (rank 0
    ready, waiting): the group starts."""
    slow = OUTLAST * SCALED.idle
    started = time.monotonic()
    group = _importing(f"work:1:{slow:g}", SCALED)
    try:
        assert time.monotonic() - started >= slow
        assert [r.rank for r in group.call_all("ping")] == [0, 1]
    finally:
        group.close()


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_the_pair_rounds_meet_every_pair_once(n: int) -> None:
    from itertools import combinations

    from rocm_parallel.backend.runtime.probe import pair_rounds

    rounds = pair_rounds(n)
    met = [pair for r in rounds for pair in r]
    assert sorted(met) == list(combinations(range(n), 2))
    assert all(len({rank for pair in r for rank in pair}) == 2 * len(r) for r in rounds)  # one partner each


@pytest.mark.torch_api
def test_three_ranks_probe_every_pair_while_one_sits_out_each_round() -> None:
    """An odd group: in each round of the pair probe one rank has no partner and still joins the round's
    all-to-all (with nothing to send), or the other two would wait for it. Mutation tried: with the rank
    sitting out skipping the round, the start failed ('rank 2 ... exited with code -6 (SIGABRT) while
    running 'probe_pairs'', gloo's mismatched collectives) and this test failed."""
    with WorkerGroup(["cpu", "cpu", "cpu"], threads=1) as group:
        assert [sorted(p.pairs) for p in group.pairs] == [["0-1", "0-2"], ["0-1", "1-2"], ["0-2", "1-2"]]
        assert [p.correct for p in group.pairs] == [True, True, True]
