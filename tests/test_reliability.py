"""When one rank fails: never hang, never poison the group, never return a stale result.

Each mechanism was broken on purpose once and these tests failed (the mutation is named in each test).
Tests that end a group use their own; the session groups stay healthy for the rest of the suite.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from bounds import HANG_NAMED_WITHIN, OUTLAST, SCALED
from safetensors.torch import save_file
from test_sampling import flux_model, positive, reference
from worker_jobs import Load, OnRank, Scale, Steps, Value

from rocm_parallel.backend.checkpoint import diffusers_to_bfl
from rocm_parallel.backend.config import ConfigError
from rocm_parallel.backend.diffusion.api import ParallelModel
from rocm_parallel.backend.runtime.client import WorkerError, WorkerGroup, validate_devices
from rocm_parallel.backend.runtime.transport import private_dir, remove_stale_dirs

TESTS_DIR = str(Path(__file__).resolve().parent)


def _group(world: int = 2) -> WorkerGroup:
    return WorkerGroup(["cpu"] * world, threads=1, extra_sys_path=[TESTS_DIR], methods=["worker_jobs"])


# How the hang tests' rank 1 hangs (tests/worker_jobs.py OnRank): in Python while another thread of it uses a
# fifth of a core (gloo's threads use some whatever the rank does: issue 56), on a lock, in a native call.
HANGS = {
    "sleep": {"kind": "sleep", "seconds": 3600.0, "noise": 0.2},
    "lock": {"kind": "lock"},
    "native": {"kind": "native"},
}


def _gone(pids: list[int], within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("models") / "tiny-flux-dev.safetensors"
    save_file(diffusers_to_bfl(flux_model("dev").state_dict()), str(path))
    return str(path)


def _sample(flux: ParallelModel, seed: int = 0, steps: int = 4, progress=None) -> torch.Tensor:
    ref = reference("dev_4steps")
    out = flux.sample(
        positive(ref["cond"], ref["pooled"]),
        {"samples": ref["latent"]},
        seed=seed,
        steps=steps,
        progress=progress,
    )
    return out["samples"]


# ------------------------------------------------------------------------------------------ one rank fails


def test_one_rank_out_of_memory_fails_fast_with_its_own_message() -> None:
    """Rank 1 raises OOM while rank 0 waits in an all-reduce for it. Mutation tried: without the
    first-error teardown (`_check_time` ignoring `first_error`) the call hung until the collective
    timeout and this test timed out."""
    group = _group()
    with pytest.raises(WorkerError) as err:
        group.call("fail_in_collective", OnRank(rank=1, at_step=3))
    assert str(err.value) == (
        "rank 1 (cpu): out of memory on cpu (rank 1 of 2): HIP out of memory. Tried to allocate 2.00 GiB. "
        "To fit: use more GPUs, use tensor parallelism (it splits the weights; context parallelism keeps a "
        "full copy per GPU), or lower the resolution; rank(s) [0] were left waiting for it in a collective, "
        "so the worker group was stopped (the next call starts it again)"
    )
    assert err.value.rank == 1
    assert "fail_in_collective" in err.value.remote_traceback  # the worker's own traceback
    assert not group.alive and _gone(group.pids)


def test_a_failure_on_every_rank_keeps_the_group(group2: WorkerGroup) -> None:
    """Errors before any collective (bad input on every rank) need no teardown."""
    with pytest.raises(WorkerError, match="unknown worker method 'nope'"):
        group2.call("nope")
    assert group2.alive
    assert group2.call("ping").rank == 0


def test_api_recovers_after_a_rank_runs_out_of_memory_mid_sampling(checkpoint: str) -> None:
    """The next job after a one-rank failure gives the right image (a fresh group, reloaded)."""
    with ParallelModel(group=_group()) as flux:
        flux.load(checkpoint, layout="tp", dtype="float32")
        expected = _sample(flux)
        flux.group.call("arm_failure", OnRank(rank=1, at_step=2))
        with pytest.raises(WorkerError, match=r"^rank 1 \(cpu\): out of memory on cpu \(rank 1 of 2\)"):
            _sample(flux, seed=5)
        assert not flux.started
        assert torch.equal(_sample(flux), expected)


def test_a_stopped_rank_is_caught_by_the_watchdog_and_the_next_job_is_correct(checkpoint: str) -> None:
    """Rank 1 stops itself (SIGSTOP) at step 2, in that step's forward. Mutation tried: with `Job._watch`
    returning at once the call never returned (pytest-timeout)."""
    with ParallelModel(group=_group()) as flux:
        flux.load(checkpoint, layout="context", dtype="float32")
        expected = _sample(flux)
        flux.group.call("arm_failure", OnRank(rank=1, at_step=2, kind="stop"))
        victim = flux.group.pids[1]
        with pytest.raises(WorkerError) as err:
            _sample(flux, seed=5)
        assert str(err.value).startswith(
            f"worker rank 1 (cpu, pid {victim}) is stopped (SIGSTOP or a debugger) while running 'model_call'"
        )
        assert _gone([victim])
        assert torch.equal(_sample(flux), expected)


def _named(error: WorkerError, victim: int, kind: str, method: str, report: str) -> None:
    """The error names rank 1 alone (a hang found by state: 'native' stopped its reports, the Python kinds
    did not), with its own last report."""
    if kind == "native":
        start = (
            rf"worker rank 1 \(cpu, pid {victim}\) stopped reporting \d+ s ago while running '{method}' "
            rf"\(its last report: {report}.*; its process is alive but does no work: stuck in a native call "
            r"or deadlocked \("
        )
    else:
        start = (
            rf"worker rank 1 \(cpu, pid {victim}\) does no work while running '{method}': it reports "
            rf"{report}.*, but for \d+ s it has used no CPU, waited for no disk and queued no GPU work, and "
        )
    assert re.match(start, str(error)), str(error)
    assert "worker rank 0" not in str(error) and error.rank == 1  # the innocent rank waits for it


@pytest.mark.parametrize(
    ("at_step", "kind", "world"),
    [(1, "sleep", 4), (1, "native", 2), (3, "lock", 2)],
    ids=[
        "asleep in Python in the first call after a load, 4 workers",
        "in a native call, first call",
        "blocked on a lock mid-sample",
    ],
)
def test_a_rank_hung_in_a_model_call_is_named_within_seconds(
    checkpoint: str, tmp_path: Path, at_step: int, kind: str, world: int
) -> None:
    """Rank 1 hangs in the first model call after a load (every ComfyUI run's first), or in step 3: in
    Python with its interpreter free (its reports go on: 'computing'; asleep while another thread of it
    works, or on a lock), or in a native call that keeps the interpreter (its reports stop); rank 0 waits
    for it in a collective. Only rank 1 is named, within seconds (tests/bounds.py), under the default
    watchdog. Mutations tried: without `Liveness._blocked` the Python case waited for the 600 s collective
    timeout and named rank 0 (before this rule: 600.1 s, gloo's 'Timed out waiting 600000ms for send
    operation'); naming every pending rank (`Hang((0, 1), ...)`) failed the rank assertion; without `publish`
    in the worker's job start, the message said 'its last report: reading tensor 112 of 112'; counting
    every thread's CPU (issue 56) left the sleeping rank unnamed until the pytest timeout."""
    with ParallelModel(group=_group(world)) as flux:
        flux.load(checkpoint, layout="tp", dtype="float32")
        stamp = tmp_path / "hung"
        flux.group.call("arm_failure", OnRank(rank=1, at_step=at_step, stamp=str(stamp), **HANGS[kind]))
        victim = flux.group.pids[1]
        with pytest.raises(WorkerError) as err:
            _sample(flux)
        took = time.monotonic() - float(stamp.read_text())
        _named(err.value, victim, kind, "model_call", r"computing 'model_call' \(")
        assert took < HANG_NAMED_WITHIN, took
        assert _gone([victim]) and not flux.started


@pytest.mark.parametrize(
    ("lora", "kind"),
    [(False, "sleep"), (True, "lock"), (False, "native")],
    ids=["load", "LoRA change", "native"],
)
def test_a_rank_hung_while_loading_is_named_within_seconds(
    checkpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lora: bool, kind: str
) -> None:
    """Rank 1 hangs at its 3rd tensor of a load (asleep beside a working thread), of a LoRA change on the
    resident model (a lock), or in a native call, while rank 0 finishes: rank 1 is named with its own
    progress within seconds (tests/bounds.py) of rank 0's answer (from then on its peer waits for it; rank
    0's own load may take long on a loaded machine), and the next load works. Mutation tried: without
    `Liveness._blocked`'s finished-peers case the load never returned (pytest-timeout; before this rule the
    caller's own `timeout=30` ended it after 41 s)."""
    from rocm_parallel.backend.runtime import watch

    answered: dict[int, float] = {}
    take = watch.Job._take

    def noted(job: watch.Job, rank: int, reply) -> None:
        if job.method == "load":
            answered.setdefault(rank, time.monotonic())
        take(job, rank, reply)

    monkeypatch.setattr(watch.Job, "_take", noted)
    from test_sampling import MODELS

    from rocm_parallel.testing.models import tiny_flux_config
    from rocm_parallel.testing.writers import write_random_lora

    with ParallelModel(group=_group()) as flux:
        flux.load(checkpoint, layout="tp", dtype="float32")
        loras = []
        if lora:
            config = tiny_flux_config(**MODELS["dev"]["config"])
            loras = [(write_random_lora(tmp_path / "lora.safetensors", config, "bfl"), 0.5)]
        else:
            flux.unload()
        stamp = tmp_path / "hung"
        flux.group.call("arm_load_failure", OnRank(rank=1, at_step=3, stamp=str(stamp), **HANGS[kind]))
        victim = flux.group.pids[1]
        answered.clear()
        with pytest.raises(WorkerError) as err:
            flux.load(checkpoint, layout="tp", dtype="float32", loras=loras)
        took = time.monotonic() - max(float(stamp.read_text()), answered[0])
        _named(err.value, victim, kind, "load", r"reading tensor 3 of ")
        assert took < HANG_NAMED_WITHIN, took
        assert _gone([victim]) and flux.resident is None
        flux.load(checkpoint, layout="tp", dtype="float32")
        assert flux.resident is not None


@pytest.mark.torch_api
def test_a_rank_left_alone_in_a_collective_is_named_with_where_it_waits() -> None:
    """Rank 1 enters one all-reduce more than rank 0, which finishes the job: rank 1 is alive and reports,
    but waits in a collective no peer will enter. On a loaded machine rank 1's last report may still show
    the step's broadcast before it (which rank 0 completed): the verdict is the same, rank 1 named because
    rank 0 has finished the job (seen once in a full run at load ~8). Mutation tried: with `_peers`
    ignoring finished peers the call never returned (pytest-timeout)."""
    group = _group()
    started = time.monotonic()
    with pytest.raises(WorkerError) as err:
        group.call("hang_at", OnRank(rank=1, at_step=3, n=6, kind="strand"))
    assert re.fullmatch(
        r"rank 1 \(cpu\) has been waiting in collective #\d+ \((all_reduce|broadcast) over ranks 0, 1\) for "
        r"\d+ s while running 'hang_at', which rank 0 (will never enter: it|has left: it completed it and) has "
        r"finished the job; the worker group was stopped \(the next call starts it again\)",
        str(err.value),
    ), str(err.value)
    assert err.value.rank == 1 and time.monotonic() - started < HANG_NAMED_WITHIN
    assert not group.alive and _gone(group.pids)


def test_a_slower_rank_that_keeps_reporting_is_not_taken_for_a_hung_one(group2: WorkerGroup) -> None:
    """Rank 0 finishes a load at once, rank 1 needs 0.4 s per tensor for 8 tensors. Mutation tried:
    the old rules together (only rank 0 reports, and its fast pace limits every rank) failed this
    healthy job as 'no progress or reply from rank(s) [1] (cpu) for 1 s'."""
    results = group2.call_all("uneven_load", Load(tensors=8, seconds=0.4))
    assert [r.rank for r in results] == [0, 1]
    assert group2.alive


def test_a_rank_that_hangs_after_its_peer_finished_is_named_with_its_own_progress(tmp_path: Path) -> None:
    """Rank 0 finished its load; rank 1 read 3 tensors, then hangs reading the 4th. The message names
    rank 1 and its own progress (before: rank 0's 'tensor 8 of 8'). Mutation tried: describing the job
    from rank 0's progress (as before) printed 'tensor 8 of 8'."""
    group, stamp = _group(), tmp_path / "hung"
    with pytest.raises(WorkerError) as err:
        group.call_all("uneven_load", Load(tensors=8, seconds=0.1, hang_after=3, stamp=str(stamp)))
    _named(err.value, group.pids[1], "native", "uneven_load", r"reading tensor 4 of 8 \(\d+ s on it\)\)")
    assert time.monotonic() - float(stamp.read_text()) < HANG_NAMED_WITHIN
    assert not group.alive and _gone(group.pids)


# ------------------------------------------------------------------------------------------ slow, healthy


@pytest.fixture
def scaled(group2: WorkerGroup, monkeypatch: pytest.MonkeyPatch) -> WorkerGroup:
    """The session's 2-worker group under the suite's scaled windows (tests/bounds.py) for one test."""
    monkeypatch.setattr(group2, "watchdog", SCALED)
    return group2


def test_a_call_five_windows_longer_after_fast_ones_completes(checkpoint: str, scaled: WorkerGroup) -> None:
    """Steps of a fraction of a second, then one 5 `idle` windows longer on rank 1 (25 s under the default
    watchdog), working all along (a bigger image, a first kernel autotune), while rank 0 waits for it: the
    job completes with the right image. Mutation tried: the old pace watchdog (a forward may take max(8 s, 5
    x the slowest so far)) killed step 3 at 8 s; a 'does no work' rule that ignored the runnable state
    failed it once CPU-starved."""
    flux = ParallelModel(group=scaled)
    flux.load(checkpoint, layout="tp", dtype="float32")
    expected = _sample(flux)
    slow = OUTLAST * SCALED.idle
    flux.group.call("arm_failure", OnRank(rank=1, at_step=3, kind="slow", seconds=slow))
    seen: list[str] = []
    poll = threading.Timer(slow / 2, lambda: seen.append(flux.activity or ""))

    def progress(step: int, total: int) -> None:
        if step == 2:  # step 3, the slow one, runs from here on
            poll.start()

    assert torch.equal(_sample(flux, progress=progress), expected)
    poll.join()
    # the panel's line: rank 1 computes, rank 0 waits for it in the step's next collective
    assert re.fullmatch(
        r"step 3 of 4: \d+ s so far, still computing \(rank 1; rank 0 waits for it in collective #\d+ "
        r"\(\w+ over ranks 0, 1\)\)",
        seen[0],
    ), seen
    assert scaled.alive


def test_ranks_asleep_five_windows_in_the_same_call_complete(checkpoint: str, scaled: WorkerGroup) -> None:
    """Every rank sleeps 5 `idle` windows (40 s under the default watchdog) at the start of step 2 (no CPU,
    no disk, no GPU): nobody waits for anybody, so nothing is hung, and the job completes with the same
    image. Mutation tried: calling every rank that does no work hung (not only one its peers wait for)
    failed this at 5 s."""
    flux = ParallelModel(group=scaled)
    flux.load(checkpoint, layout="tp", dtype="float32")
    expected = _sample(flux)
    asleep = OUTLAST * SCALED.idle
    flux.group.call("arm_failure", OnRank(rank=-1, at_step=2, kind="sleep", seconds=asleep))
    started = time.monotonic()
    assert torch.equal(_sample(flux), expected)
    assert time.monotonic() - started >= asleep and scaled.alive


def test_a_tensor_read_five_windows_long_completes(checkpoint: str, scaled: WorkerGroup) -> None:
    """Rank 1 takes 5 `idle` windows (30 s under the default watchdog) to read its 3rd tensor, working all
    along (a read that decompresses; a network share's reads wait in D and bring pages in, which counts
    the same), while rank 0 has finished: the load completes and samples the same image. Mutation tried:
    the old gap watchdog (max(8 s, 5 x the longest gap between records)) failed the load after 8 s."""
    flux = ParallelModel(group=scaled)
    flux.load(checkpoint, layout="tp", dtype="float32")
    expected = _sample(flux)
    flux.unload()
    flux.group.call("arm_load_failure", OnRank(rank=1, at_step=3, kind="slow", seconds=OUTLAST * SCALED.idle))
    reports = flux.load(checkpoint, layout="tp", dtype="float32")
    assert [r.reused for r in reports] == [False, False]
    assert torch.equal(_sample(flux), expected)


def test_the_rank_a_timed_out_collective_waited_for_is_named(tmp_path: Path) -> None:
    """Rank 1 works for 30 s (it is never hung) while rank 0 waits for it in an all-reduce; the process
    groups' collective timeout (5 s here, 600 s by default) ends rank 0's wait from inside. The error
    names rank 1, the rank everyone waited for, with rank 0's own error as a note. Mutation tried: without
    `Job.late` the error was rank 0's 'Timed out waiting 5000ms for recv operation to complete'."""
    from rocm_parallel.backend.runtime.liveness import Watchdog

    group = WorkerGroup(
        ["cpu", "cpu"], threads=1, extra_sys_path=[TESTS_DIR], methods=["worker_jobs"],
        watchdog=Watchdog(collective_timeout=5.0),
    )  # fmt: skip
    stamp = tmp_path / "slow"
    with pytest.raises(WorkerError) as err:
        group.call("hang_at", OnRank(rank=1, at_step=2, kind="slow", seconds=30.0, stamp=str(stamp)))
    assert re.fullmatch(
        r"rank 1 \(cpu\) never reached collective #\d+ \(all_reduce over ranks 0, 1\), in which rank 0 \(cpu\) "
        r"waited for it for the collective timeout \(5 s\) while running 'hang_at' \(rank 1: computing step 2 "
        r"of 100 \(\d+ s so far\)\); the worker group was stopped \(the next call starts it again\)",
        str(err.value),
    ), str(err.value)
    assert err.value.rank == 1 and time.monotonic() - float(stamp.read_text()) < HANG_NAMED_WITHIN
    assert any(n.startswith("rank 0's own error: ") and "Timed out" in n for n in err.value.__notes__)
    assert not group.alive and _gone(group.pids)


def test_a_time_limit_that_ends_a_job_names_the_rank_it_waited_for() -> None:
    """Rank 1 works (never hung) while rank 0 waits for it in an all-reduce; the caller's `timeout` passes
    and neither can stop (no cancel point in either place): the error names rank 1, the rank the job waited
    for, and who waited for it, never the waiter (issue 56: 'did not stop ... (rank 0 waiting ...)' with
    `rank` 0). Mutation tried: the first pending rank, as before, named rank 0."""
    group = _group()
    # The limit leaves a loaded machine time to reach step 2 (a CI run under load hit a 3 s limit with rank 1
    # still receiving step 1's broadcast, before the case this test is about); rank 1 then works for 60 s.
    with pytest.raises(WorkerError) as err:
        group.call(
            "hang_at", OnRank(rank=1, at_step=2, kind="slow", seconds=60.0), timeout=10.0, cancel_grace=2.0
        )
    assert err.value.rank == 1, str(err.value)
    assert re.match(
        r"'hang_at' did not stop within 2 s of being cancelled at its time limit: worker rank 1 \(cpu\) held it "
        r"up \(rank 0 waits for it in collective #\d+ \(all_reduce over ranks 0, 1\)\) \(",
        str(err.value),
    ), str(err.value)
    assert not group.alive and _gone(group.pids)


@pytest.mark.torch_api
def test_ranks_that_issue_different_collectives_at_the_same_number_are_named(tmp_path: Path) -> None:
    """Rank 1 broadcasts where rank 0 all-reduces: the recorders disagree on collective #n, asked by the
    caller once a rank has waited a second. Mutation tried: without the comparison of the answers
    (`same_collective` always True) the job waited until both ranks did no work long enough to be cycles'
    ... and named them with no op (12 s instead of 5)."""
    group, stamp = _group(), tmp_path / "mismatch"
    with pytest.raises(WorkerError) as err:
        group.call("hang_at", OnRank(rank=1, at_step=3, kind="mismatch", stamp=str(stamp)))
    assert "which rank 1 issued as broadcast of [[1]] where it issued all_reduce of [[1]]" in str(err.value)
    assert time.monotonic() - float(stamp.read_text()) < HANG_NAMED_WITHIN
    assert not group.alive and _gone(group.pids)


# ------------------------------------------------------------------------------------------ cancel


def test_cancel_stops_the_workers_not_just_the_progress(group2: WorkerGroup, tmp_path: Path) -> None:
    """What the workers did, read from their own log: each stopped within a step of the cancel.
    Mutation tried: `WorkerContext.step_done` never raising JobCancelled → both logs said 50."""
    log = str(tmp_path / "steps")

    def interrupt_at_two(step: int, total: int) -> None:
        if step == 2:
            raise InterruptedError("user pressed Cancel")

    with pytest.raises(InterruptedError):
        group2.call("steps", Steps(n=50, seconds=0.05, log=log), progress=interrupt_at_two)
    done = [int(Path(f"{log}.rank{r}").read_text()) for r in range(2)]
    assert all(2 <= d <= 4 for d in done), done
    assert all(r.error_type == "JobCancelled" for r in group2.last_replies.values())


def test_interrupt_while_waiting_cancels_and_the_next_call_gets_its_own_result(
    group2: WorkerGroup, tmp_path: Path
) -> None:
    """Ctrl+C (KeyboardInterrupt raised in the waiting thread by a signal handler). Mutation tried:
    without `_stop` in call_all's except clause the next call returned the interrupted job's reply."""
    log = str(tmp_path / "steps")

    def ctrl_c(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, ctrl_c)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(KeyboardInterrupt):
            group2.call("steps", Steps(n=200, seconds=0.02, log=log))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    done = [int(Path(f"{log}.rank{r}").read_text()) for r in range(2)]
    assert max(done) < 200, done
    assert group2.alive
    assert group2.call("steps", Steps(n=3)).steps == 3  # its own reply, not the interrupted job's
    big = torch.randn(256, 1024)
    assert torch.equal(group2.call("scale", Scale(big)).scaled, big)  # request files intact


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["send", "receive"])
def test_ctrl_c_inside_a_send_or_a_receive_keeps_the_group(
    group2: WorkerGroup, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A real SIGINT lands inside the request's send loop (after rank 0 got it, before rank 1), or inside
    the receive of a reply (after its bytes were read): the interrupt is held until the message is whole,
    every rank stops at the same step, no reply is lost and the group keeps going. Mutation tried: with
    `transport.uninterrupted` a no-op, the send case left rank 0 alone in a collective (the call never
    returned: pytest-timeout) and the receive case lost rank 1's reply (`last_replies` had only rank 0)."""
    from rocm_parallel.backend.runtime import watch
    from rocm_parallel.backend.runtime.transport import Reply

    module, name = watch, where.replace("receive", "recv")
    real, fired = getattr(module, name), []

    def interrupted(conn, *args):
        result = real(conn, *args)
        if not fired and (where == "send" or isinstance(result, Reply)):
            fired.append(1)
            signal.raise_signal(signal.SIGINT)  # Python's handler raises KeyboardInterrupt here
        return result

    monkeypatch.setattr(module, name, interrupted)
    with pytest.raises(KeyboardInterrupt):
        group2.call("steps", Steps(n=200 if where == "send" else 3, seconds=0.02))
    monkeypatch.undo()
    assert sorted(group2.last_replies) == [0, 1]
    assert {r.error_type for r in group2.last_replies.values()} <= {"JobCancelled", ""}
    assert group2.alive
    assert group2.call("steps", Steps(n=3)).steps == 3


def test_a_reply_from_another_job_is_never_accepted(group2: WorkerGroup) -> None:
    """Mutation tried: without the job-id check in `Job.collect` the call returned Value(value=-1)."""
    assert group2.call("send_stale_reply", Value(7)) == Value(7)


def test_cancel_during_a_load_stops_between_tensors(checkpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation tried: `load_progress` not checking the cancel flag → rank 0's load completed (its
    reply was ok) instead of JobCancelled."""
    with ParallelModel(group=_group()) as flux:
        seen: list[tuple[int, int]] = []
        load_replies: dict = {}
        call_all = flux.group.call_all

        def spy(method: str, *args, **kwargs):
            try:
                return call_all(method, *args, **kwargs)
            finally:
                if method == "load":
                    load_replies.update(flux.group.last_replies)

        monkeypatch.setattr(flux.group, "call_all", spy)
        # rank 0 holds at tensor 6 until the cancel flag is up: on a loaded machine the caller may read
        # the report of tensor 5 after rank 0 has read every tensor (seen once in CI)
        flux.group.call("arm_load_failure", OnRank(rank=0, at_step=6, kind="await_cancel"))

        def cancel_at_five(done: int, total: int) -> None:
            seen.append((done, total))
            if done == 5:
                raise InterruptedError("user pressed Cancel")

        with pytest.raises(InterruptedError):
            flux.load(checkpoint, layout="tp", dtype="float32", progress=cancel_at_five)
        assert seen[-1][1] > 10  # the load had far more tensors to go
        # rank 1 (which reports nothing) may have finished first: the cleanup below covers it
        assert load_replies[0].error_type == "JobCancelled"
        assert load_replies[0].error.startswith("JobCancelled: load cancelled after ")
        assert flux.resident is None
        assert [r.loaded for r in flux.status()] == [None, None]
        flux.load(checkpoint, layout="tp", dtype="float32")
        assert torch.equal(_sample(flux), _sample(flux))


def test_a_load_that_fails_on_one_rank_leaves_no_rank_holding_a_model(checkpoint: str) -> None:
    """Rank 1 runs out of memory at its 3rd tensor, rank 0 finishes its load. Mutation tried: without
    the unload in `ParallelModel._load_resident`'s except clause, rank 0 still held the model."""
    with ParallelModel(group=_group()) as flux:
        flux.group.call("arm_load_failure", OnRank(rank=1, at_step=3))
        with pytest.raises(WorkerError, match=r"^rank 1 \(cpu\): out of memory on cpu \(rank 1 of 2\)"):
            flux.load(checkpoint, layout="tp", dtype="float32")
        assert flux.group.last_replies[0].ok  # the cleanup's unload answered on both ranks
        assert [r.loaded for r in flux.status()] == [None, None]
        assert flux.resident is None


# ------------------------------------------------------------------------------------------ threads


def test_two_threads_share_a_group(group2: WorkerGroup) -> None:
    """Sampling in one thread while another polls. Mutation tried: without the lock in call_all the
    poller read the other job's replies (KeyError / wrong results)."""
    errors: list[BaseException] = []
    results: list[int] = []

    def poll() -> None:
        try:
            for _ in range(20):
                results.append(group2.call("ping").rank)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=poll)
    thread.start()
    out = [group2.call("steps", Steps(n=5, seconds=0.01)).sum for _ in range(5)]
    thread.join()
    assert not errors, errors
    assert results == [0] * 20 and out == [10.0] * 5


def test_status_does_not_wait_for_a_running_job(checkpoint: str, group2: WorkerGroup) -> None:
    flux = ParallelModel(group=group2)
    flux.load(checkpoint, layout="tp", dtype="float32")
    reports: list[list[dict]] = []

    def poll(step: int, total: int) -> None:
        if step == 2:
            box: list = []
            t = threading.Thread(target=lambda: box.append(flux.status()))
            t.start()
            t.join(5)
            reports.append(box[0])

    _sample(flux, progress=poll)
    assert [r.busy for r in reports[0]] == [True, True]
    assert [r.loaded.layout.tp for r in reports[0]] == [2, 2]


# ------------------------------------------------------------------------------------------ start-up


def test_a_worker_crash_at_start_names_the_rank_exit_code_and_output() -> None:
    before = psutil.Process().children()
    with pytest.raises(WorkerError) as err:
        WorkerGroup(["cpu", "cpu"], threads=1, methods=["no_such_module_for_rocm_parallel"])
    text = str(err.value)
    assert "exited with code 1 while starting; its last output:" in text
    assert "ModuleNotFoundError: No module named 'no_such_module_for_rocm_parallel'" in text
    assert err.value.rank in (0, 1)
    assert _gone([c.pid for c in psutil.Process().children() if c not in before])


def test_start_timeout_is_reported_as_such() -> None:
    with pytest.raises(WorkerError) as err:
        WorkerGroup(["cpu", "cpu"], threads=1, start_timeout=0.3)
    assert "within 0 s" in str(err.value) or "(start_timeout)" in str(err.value)
    assert "FileNotFoundError" not in repr(err.value)


def test_stray_connections_do_not_stop_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection with the wrong key, and one that never speaks, while the workers connect."""
    from multiprocessing.connection import Client

    from rocm_parallel.backend.runtime import launch

    handshake = launch.Workers._handshake

    def probed(self: launch.Workers, listener) -> None:
        address = os.path.join(self.tmp, "control.sock")

        def wrong_key() -> None:
            try:
                Client(address, family="AF_UNIX", authkey=b"wrong")
            except Exception:
                pass

        import socket

        silent = socket.socket(socket.AF_UNIX)
        silent.connect(address)
        threading.Thread(target=wrong_key, daemon=True).start()
        try:
            handshake(self, listener)
        finally:
            silent.close()

    monkeypatch.setattr(launch.Workers, "_handshake", probed)
    with WorkerGroup(["cpu", "cpu"], threads=1) as group:
        assert [group.call_all("ping")[r].rank for r in range(2)] == [0, 1]


@pytest.mark.parametrize(
    ("devices", "message"),
    [
        (
            ["cpu"] * 99999,
            "devices=['cpu', 'cpu', 'cpu', ... (99999 devices)] asks for 99999 CPU workers, which need at "
            "least 99999 GB of host memory (1 GB each, measured on a worker that has loaded a model, besides "
            "the model itself) but ",
        ),
        (
            ["cuda:-1"],
            "devices=['cuda:-1']: a GPU is named 'cuda:N' with N = 0, 1, ... (an index, not 'cuda:-1')",
        ),
    ],
)
def test_impossible_device_lists_fail_before_any_process(devices: list[str], message: str) -> None:
    before = psutil.Process().children()
    with pytest.raises(ConfigError) as err:
        validate_devices(devices)
    assert str(err.value).startswith(message)
    assert psutil.Process().children() == before


# ------------------------------------------------------------------------------------------ leftovers


def test_directories_of_dead_parents_are_removed_at_the_next_start() -> None:
    """A parent killed with SIGKILL leaves its private directories; a new start removes them, and
    only those whose owner is gone. Mutation tried: `_pid_alive` always False removed the live one."""
    script = (
        "from rocm_parallel.backend.runtime.client import WorkerGroup\n"
        "g = WorkerGroup(['cpu'], threads=1)\n"
        "print(g._workers.tmp, g._workers.shm, flush=True)\n"
        "import sys; sys.stdin.read()\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    left = parent.stdout.readline().decode().split()
    parent.kill()
    parent.wait()
    assert all(os.path.isdir(d) for d in left)  # SIGKILL: nothing cleaned up
    alive = private_dir("shm", owner=os.getpid(), tmpfs=True)
    try:
        removed = remove_stale_dirs()
        assert set(left) <= set(removed)
        assert not any(os.path.exists(d) for d in left)
        assert os.path.isdir(alive)
    finally:
        os.rmdir(alive)


def test_exit_without_close_ends_the_workers() -> None:
    script = (
        "from rocm_parallel.backend.runtime.client import WorkerGroup\n"
        "g = WorkerGroup(['cpu', 'cpu'], threads=1)\n"
        "print(*g.pids, g._workers.tmp, g._workers.shm, flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    *pids, tmp, shm = done.stdout.split()
    assert done.returncode == 0, done.stderr
    assert _gone([int(p) for p in pids])
    assert not os.path.exists(tmp) and not os.path.exists(shm)


# ------------------------------------------------------------------------------------------ bad input


def _flux_checked(checkpoint: str, **overrides) -> str:
    ref = reference("dev_4steps")
    args = {
        "positive": positive(ref["cond"], ref["pooled"]),
        "latent": {"samples": ref["latent"]},
        "seed": 0,
        "steps": 2,
    }
    args.update(overrides)
    with pytest.raises(ConfigError) as err:
        ParallelModel.check_sample(args.pop("positive"), args.pop("latent"), checkpoint=checkpoint, **args)
    return str(err.value)


def test_bad_sampling_input_fails_before_any_worker(checkpoint: str) -> None:
    ref = reference("dev_4steps")
    cond, pooled = ref["cond"], ref["pooled"]
    text_dim, pooled_dim = cond.shape[-1], pooled.shape[-1]
    nan = torch.full_like(ref["latent"], float("nan"))
    cases = {
        "wide text": (
            {"positive": positive(torch.zeros(1, 8, text_dim + 1), pooled)},
            f"conditioning tensor has shape (1, 8, {text_dim + 1}); this model expects [batch, tokens, "
            f"{text_dim}] (T5-XXL text features): encode the prompt with a FLUX DualCLIPLoader (clip_l + t5xxl)",
        ),
        "wide pooled": (
            {"positive": positive(cond, torch.zeros(1, pooled_dim + 2))},
            f"conditioning has no pooled_output [batch, {pooled_dim}] (got (1, {pooled_dim + 2})); encode the "
            "prompt with a FLUX DualCLIPLoader (clip_l + t5xxl) and CLIPTextEncode",
        ),
        "batch 0": (
            {"latent": {"samples": torch.zeros(0, 16, 8, 8)}},
            "latent samples have shape (0, 16, 8, 8); expected [batch, 16, height/8, width/8] with at least "
            "one image (batch >= 1)",
        ),
        "meta": (
            {"latent": {"samples": torch.zeros(1, 16, 8, 8, device="meta")}},
            "latent samples is on the 'meta' device and holds no values; give a CPU or GPU tensor",
        ),
        "seed": (
            {"seed": 2**64},
            "seed=18446744073709551616 must be an integer from 0 to 18446744073709551615 (2**64 - 1), as in "
            "ComfyUI",
        ),
        "guidance": (
            {"positive": positive(cond, pooled, "abc")},
            "conditioning guidance='abc' is not a finite number; set it with FluxGuidance (e.g. 3.5)",
        ),
        "nan guidance": (
            {"positive": positive(cond, pooled, float("nan"))},
            "conditioning guidance=nan is not a finite number; set it with FluxGuidance (e.g. 3.5)",
        ),
        "nan latent": (
            {"latent": {"samples": nan}},
            "latent samples contains NaN values; encode the image again or start from EmptySD3LatentImage",
        ),
        "nan cond": (
            {"positive": positive(torch.full_like(cond, float("nan")), pooled)},
            "conditioning tensor contains NaN values; re-encode the prompt (a broken text encoder or a bad "
            "upstream node)",
        ),
        "nan sigmas": (
            {"sigmas": torch.tensor([1.0, float("nan"), 0.0])},
            "sigmas contains NaN values; check the scheduler node that made them",
        ),
        "rising sigmas": (
            {"sigmas": torch.tensor([0.5, 0.8, 0.0])},
            "sigmas must not increase, but sigma[1]=0.8 > sigma[0]=0.5; use a scheduler's output (e.g. "
            "BasicScheduler) or flip them",
        ),
        "inf latent": (
            {"latent": {"samples": torch.full_like(ref["latent"], float("inf"))}},
            "latent samples contains inf values; encode the image again or start from EmptySD3LatentImage",
        ),
        **{
            f"shift_mu {mu!r}": (
                {"shift_mu": mu},
                f"shift_mu={mu!r} must be a finite number from -87 to 87 (beyond that e^mu leaves float32 and "
                "every sigma is NaN); ModelSamplingFlux sets 0.5 to 1.15 for 256x256 to 1024x1024 "
                "(resolution_mu(width, height)), or leave it unset for the model's default",
            )
            for mu in (float("nan"), 1e6, -1000.0, float("inf"), "1.15")
        },
        "shift_mu with sigmas": (
            {"shift_mu": 1.15, "sigmas": torch.tensor([1.0, 0.5, 0.0])},
            "shift_mu=1.15 has no effect when sigmas are given (they are the whole schedule); leave shift_mu "
            "unset, or drop sigmas to sample from the shifted table",
        ),
    }
    before = psutil.Process().children()
    for name, (overrides, message) in cases.items():
        assert _flux_checked(checkpoint, **overrides) == message, name
    assert psutil.Process().children() == before


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("x", "x contains NaN values; the latent entering this model call is broken: check the nodes before the "
         "sampler (a VAE Encode of a broken image, a latent upscale, a noise node)"),
        ("timestep", "timestep contains inf values; it is the sampler's sigma: check the scheduler or SIGMAS input"),
        ("guidance", "guidance contains NaN values; set a finite value with FluxGuidance (e.g. 3.5)"),
        ("context", "context contains inf values; re-encode the prompt (a broken text encoder or a bad upstream node)"),
        ("y", "y (pooled_output) contains NaN values; re-encode the prompt (a broken text encoder or a bad "
         "upstream node)"),
        ("ref_latents", "ref_latents[0] contains NaN values; encode the reference image again (VAE Encode into "
         "ReferenceLatent)"),
        ("meta", "x is on the 'meta' device and holds no values; give a CPU or GPU tensor"),
    ],
)  # fmt: skip
def test_nan_or_inf_in_a_model_call_is_refused_before_any_rank_runs(
    checkpoint: str, group2: WorkerGroup, name: str, message: str
) -> None:
    """Every input of `forward`, on the caller's side: no job reaches the ranks. Mutation tried: without
    `check_conditioning_values` in `ConditioningSender.add`, the NaN context ran on the ranks and the call
    returned NaN."""
    from test_service import call_inputs

    flux = ParallelModel(group=group2)
    flux.load(checkpoint, layout="tp", dtype="float32")
    inputs = call_inputs()
    bad = float("inf") if name in ("timestep", "context") else float("nan")
    if name == "meta":
        inputs["x"] = torch.empty_like(inputs["x"], device="meta")
    elif name == "ref_latents":
        inputs["ref_latents"] = [torch.full((2, 16, 4, 4), bad)]
    else:
        inputs[name] = inputs[name].clone()
        inputs[name].view(-1)[1] = bad
    before = group2._job
    with pytest.raises(ConfigError) as err:
        flux.forward(**inputs)
    assert str(err.value) == message
    assert group2._job == before


def test_a_model_call_whose_output_overflows_names_its_sigma(checkpoint: str, group2: WorkerGroup) -> None:
    """Finite inputs, NaN out (the model overflowed): an error naming the call, not a black image."""
    from test_service import call_inputs

    flux = ParallelModel(group=group2)
    flux.load(checkpoint, layout="tp", dtype="float32")
    inputs = call_inputs()
    inputs["context"] = inputs["context"] * 1e38
    with pytest.raises(FloatingPointError) as err:
        flux.forward(**inputs)
    assert str(err.value) == (
        "the model call at sigma 0.7, 0.7 produced NaN or inf values from finite inputs; the model's output "
        "overflowed: try dtype='bfloat16' or 'float32' instead of float16"
    )


def test_nan_weights_are_refused_at_load_naming_the_tensor(
    checkpoint: str, group2: WorkerGroup, tmp_path: Path
) -> None:
    """One NaN in a stored tensor: every rank that reads it refuses the load, naming the file's key; the
    group stays (loading has no collectives) and holds no model. Mutation tried: with `CHECK_VALUES` off
    the load succeeded and sampling returned NaN."""
    from safetensors.torch import load_file

    state = load_file(checkpoint)
    key = "img_in.bias"  # replicated: every rank reads it whole
    state[key] = state[key].clone()
    state[key][1] = float("nan")
    damaged = str(tmp_path / "damaged.safetensors")
    save_file(state, damaged)
    flux = ParallelModel(group=group2)
    with pytest.raises(WorkerError) as err:
        flux.load(damaged, layout="tp", dtype="float32")
    assert str(err.value).split(": ", 1)[1] == (
        f"CheckpointError: '{damaged}': tensor '{key}' holds NaN values; the file is damaged (an interrupted "
        "download or copy, a failing disk) or was saved from a broken model: download or copy it again"
    )
    assert group2.alive and flux.resident is None
    assert [r.loaded for r in flux.status()] == [None, None]


def test_a_damaged_header_of_the_right_size_says_what_safetensors_says(tmp_path: Path) -> None:
    """Before: 'its header promises 152 bytes but the file has 152'."""
    import json
    import struct

    from rocm_parallel.backend.checkpoint import inspect_checkpoint

    path = tmp_path / "h.safetensors"
    save_file({"a": torch.ones(4), "b": torch.ones(4)}, str(path))
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header["a"]["data_offsets"], header["b"]["data_offsets"] = [0, 12], [12, 32]  # a holds 16 bytes
    text = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(raw[:8] + text + b" " * (n - len(text)) + raw[8 + n :])
    with pytest.raises(ConfigError) as err:
        inspect_checkpoint(path)
    assert str(err.value) == (
        f"'{path}' is truncated or corrupt: its size matches its header ({len(raw)} bytes), but safetensors "
        "refuses the header: Error while deserializing header: invalid shape, data type, or offset for tensor. "
        "Download or copy it again"
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"threads": -1}, "threads=-1 must be a whole number of torch threads per worker (1 or more), or None for "
         "the default (CPU workers: the cores shared out; GPUs: torch's own)"),
        ({"threads": 1.5}, "threads=1.5 must be a whole number of torch threads per worker (1 or more), or None "
         "for the default (CPU workers: the cores shared out; GPUs: torch's own)"),
        ({"start_timeout": 0}, "start_timeout=0 must be a number of seconds > 0"),
        ({"health_timeout": float("nan")}, "health_timeout=nan must be a number of seconds > 0, or None for no limit"),
    ],
)  # fmt: skip
def test_ignored_group_options_are_refused_before_any_process(options: dict, message: str) -> None:
    """threads=-1 used to start workers with torch's default; start_timeout=0 failed the start at once."""
    before = psutil.Process().children()
    for make in (WorkerGroup, ParallelModel):
        if make is ParallelModel and "health_timeout" in options:
            continue
        with pytest.raises(ConfigError) as err:
            make(["cpu", "cpu"], **options)
        assert str(err.value) == message
    assert psutil.Process().children() == before


def test_a_time_limit_must_be_positive(group2: WorkerGroup) -> None:
    for timeout in (0, -1.0, float("nan")):
        with pytest.raises(
            ConfigError, match=r"^timeout=.* must be a number of seconds > 0, or None for no limit$"
        ):
            group2.call("ping", timeout=timeout)
    flux = ParallelModel(group=group2)
    with pytest.raises(ConfigError, match=r"^threads=2 but the group given runs 1 per worker; pass one$"):
        ParallelModel(group=group2, threads=2)
    with pytest.raises(ConfigError, match=r"^devices=\['cpu', 'cpu', 'cpu'\] but the group given runs on "):
        ParallelModel(["cpu"] * 3, group=group2)
    assert flux.devices == ("cpu", "cpu")


@pytest.mark.torch_api
def test_a_workers_own_memory_is_within_the_bound(checkpoint: str) -> None:
    """WORKER_HOST_BYTES, the per-worker host memory the CPU worker count is bounded by, is what a real
    worker holds besides its model's weights once it has loaded and sampled one. A fresh group: the
    session's group2 has served hundreds of jobs by now (other tests' models, VAEs and encoders come and
    go, and the allocator keeps what they freed), which is not what the bound is about (CI saw 1.04 GB
    there with torch 2.15's CUDA build)."""
    from rocm_parallel.backend.platforms import WORKER_HOST_BYTES

    with WorkerGroup(["cpu", "cpu"], threads=1) as group:
        flux = ParallelModel(group=group)
        flux.load(checkpoint, layout="tp", dtype="float32")
        _sample(flux)
        for pid, status in zip(group.pids, flux.status(), strict=True):
            own = psutil.Process(pid).memory_info().rss - status.parameter_bytes
            assert own <= WORKER_HOST_BYTES, f"{own / 1e9:.2f} GB"


def test_a_bad_dtype_leaves_the_resident_model_alone(checkpoint: str, group2: WorkerGroup) -> None:
    flux = ParallelModel(group=group2)
    flux.load(checkpoint, layout="tp", dtype="float32")
    with pytest.raises(Exception, match="dtype='int8' is not a compute dtype"):
        flux.load(checkpoint, layout="tp", dtype="int8")
    assert flux.resident is not None and flux.resident.dtype == "float32"
    assert [r.loaded.dtype for r in flux.status()] == ["float32", "float32"]


def test_nan_from_a_step_is_an_error_naming_the_step(checkpoint: str, group2: WorkerGroup) -> None:
    """A finite input can still overflow inside the model (float16): the step that did it is named, and
    the loop (in the caller) stops there. Mutation tried: without the check in `euler` the job returned a
    NaN latent."""
    flux = ParallelModel(group=group2)
    flux.load(checkpoint, layout="tp", dtype="float32")
    ref = reference("dev_4steps")
    huge = positive(ref["cond"] * 1e30, ref["pooled"] * 1e30)
    seen: list[int] = []
    with pytest.raises(FloatingPointError, match=r"^step 1 of 2 produced NaN or inf values \(sigma 1\)"):
        flux.sample(huge, {"samples": ref["latent"]}, seed=0, steps=2, progress=lambda s, t: seen.append(s))
    assert seen == [] and group2.alive


def test_private_dirs_carry_their_owner() -> None:
    d = private_dir("ctl")
    try:
        assert os.path.basename(d).startswith(f"rocm-parallel-ctl-{os.getpid()}-")
        assert os.path.dirname(d) == tempfile.gettempdir()
        assert (os.stat(d).st_mode & 0o777) == 0o700
    finally:
        os.rmdir(d)


def test_a_failing_rank_stops_its_peers_load_and_keeps_the_group(group2: WorkerGroup) -> None:
    """Rank 0 fails at once; rank 1 is still loading (no collectives), reporting every tensor. It is
    cancelled, not torn down with the group, and the error is rank 0's. Mutation tried: without the
    cancel on the first error, rank 1 loaded all 40 tensors (its reply was ok)."""
    with pytest.raises(WorkerError, match=r"^rank 0 \(cpu\): out of memory on cpu \(rank 0 of 2\)"):
        group2.call_all("load_then_fail", Load(tensors=40, seconds=0.1, failing=0))
    assert group2.last_replies[1].error_type == "JobCancelled"
    assert group2.alive


# ------------------------------------------------------------------------------------------ LoRA values


def _lora(tmp_path: Path) -> str:
    from test_sampling import MODELS

    from rocm_parallel.testing.models import tiny_flux_config
    from rocm_parallel.testing.writers import write_random_lora

    return write_random_lora(
        tmp_path / "lora.safetensors", tiny_flux_config(**MODELS["dev"]["config"]), "bfl"
    )


def test_a_lora_strength_beyond_comfyuis_range_is_refused_before_any_worker(
    checkpoint: str, tmp_path: Path
) -> None:
    """Strength 1e30 used to load and sample NaN. Mutation tried: without the bound in `check_loras` the
    check passed."""
    lora = _lora(tmp_path)
    before = psutil.Process().children()
    for strength in (1e30, -100.5):
        with pytest.raises(ConfigError) as err:
            ParallelModel(["cpu", "cpu"]).check_load(checkpoint, loras=[(lora, strength)])
        assert str(err.value) == (
            f"LoRA '{lora}': strength {strength!r} is beyond +-100 (ComfyUI's LoraLoader range; far beyond it "
            "the patched weights overflow to inf); use e.g. 1.0"
        )
    ParallelModel(["cpu", "cpu"]).check_load(checkpoint, loras=[(lora, -100.0)])
    assert psutil.Process().children() == before


def test_nan_lora_factors_are_refused_naming_the_file_and_module(
    checkpoint: str, group2: WorkerGroup, tmp_path: Path
) -> None:
    """One NaN in a LoRA's up factor: the LoRA change is refused in the caller (the LoRA package's value
    scan, backend/checkpoint/lora/values.py) naming the file, the tensor and the place, before any rank
    patches anything; the resident model stays as it was. Mutation tried: without `_finite` in
    `scan_values` the load succeeded and sampling returned NaN."""
    from safetensors.torch import load_file

    state = load_file(_lora(tmp_path))
    key = "diffusion_model.img_in.lora_up.weight"  # replicated: every rank reads it whole
    state[key][1, 0] = float("nan")
    damaged = str(tmp_path / "damaged-lora.safetensors")
    save_file(state, damaged)
    flux = ParallelModel(group=group2)
    flux.load(checkpoint, layout="tp", dtype="float32")
    resident = flux.resident
    with pytest.raises(ConfigError) as err:
        flux.load(checkpoint, layout="tp", dtype="float32", loras=[(damaged, 1.0)])
    assert str(err.value).startswith(
        f"LoRA '{damaged}': '{key}' holds nan at [1, 0] (1 of {state[key].numel()} values are not finite); "
        "applied, it would make the model's output NaN."
    )
    assert group2.alive and flux.resident == resident
