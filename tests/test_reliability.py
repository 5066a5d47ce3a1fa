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
from safetensors.torch import save_file
from test_sampling import flux_model, positive, reference
from worker_jobs import Load, OnRank, Scale, Steps, Value

from rocm_parallel.backend.api import ParallelFlux
from rocm_parallel.backend.checkpoint import diffusers_to_bfl
from rocm_parallel.backend.client import Watchdog, WorkerError, WorkerGroup, validate_devices
from rocm_parallel.backend.config import ConfigError
from rocm_parallel.backend.transport import private_dir, remove_stale_dirs

TESTS_DIR = str(Path(__file__).resolve().parent)


def _group() -> WorkerGroup:
    return WorkerGroup(["cpu", "cpu"], threads=1, extra_sys_path=[TESTS_DIR], methods=["worker_jobs"])


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


def _sample(flux: ParallelFlux, seed: int = 0, steps: int = 4, progress=None) -> torch.Tensor:
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
    with ParallelFlux(group=_group()) as flux:
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
    with ParallelFlux(group=_group()) as flux:
        flux.load(checkpoint, layout="context", dtype="float32")
        expected = _sample(flux)
        flux.group.call("arm_failure", OnRank(rank=1, at_step=2, kind="stop"))
        victim = flux.group.pids[1]
        with pytest.raises(WorkerError) as err:
            _sample(flux, seed=5)
        assert str(err.value).startswith(
            f"worker rank 1 (cpu, pid {victim}) is stopped (SIGSTOP or a debugger) while running 'flux_forward'"
        )
        assert _gone([victim])
        assert torch.equal(_sample(flux), expected)


def test_silence_past_the_watchdog_fails_the_job() -> None:
    """A rank that is alive but never answers (hung in a device call). Mutation tried: a watchdog
    limit that ignores `longest_gap` kept waiting for `first` (300 s)."""
    group = _group()
    hang = Watchdog(first=30.0, floor=1.0, factor=3.0)
    started = time.monotonic()
    with pytest.raises(WorkerError) as err:
        # steps of 0.05 s, then rank 1 sleeps in step 5 for far longer than 3 x the longest gap
        group.call("steps", Steps(n=4, seconds=0.05), watchdog=hang)  # warm: the job itself is fine
        group.call("hang_at", OnRank(rank=1, at_step=5), watchdog=hang)
    # rank 1 sleeps; rank 0 waits for it in the all-reduce: both fall silent within milliseconds
    assert re.search(
        r"no progress or reply from rank\(s\) \[(0, 1|0|1)\] \((cpu, cpu|cpu)\) for ", str(err.value)
    )
    assert "last progress: step 4 of 100" in str(err.value)
    assert time.monotonic() - started < 30  # it fired on the gap-based limit, not `first`
    assert not group.alive and _gone(group.pids)


def test_a_slower_rank_that_keeps_reporting_is_not_taken_for_a_hung_one(group2: WorkerGroup) -> None:
    """Rank 0 finishes a load at once, rank 1 needs 0.4 s per tensor for 8 tensors. Mutation tried:
    the old rules together (only rank 0 reports, and its fast pace limits every rank) failed this
    healthy job as 'no progress or reply from rank(s) [1] (cpu) for 1 s'. Either fix alone passes it;
    the next test pins per-rank reporting."""
    watch = Watchdog(first=30.0, floor=1.0, factor=1.0)
    results = group2.call_all("uneven_load", Load(tensors=8, seconds=0.4), watchdog=watch)
    assert [r.rank for r in results] == [0, 1]
    assert group2.alive


def test_a_rank_that_hangs_after_its_peer_finished_is_caught_at_its_own_pace() -> None:
    """Rank 0 finished its load; rank 1 reported 3 tensors, then hangs. Its own reports set its limit
    (1 s floor), so the job fails in seconds naming rank 1. Mutation tried: only rank 0 reporting
    progress (as before) left rank 1 unheard, judged by `first` (30 s): the call took 30 s."""
    group = _group()
    watch = Watchdog(first=30.0, floor=1.0, factor=1.0)
    started = time.monotonic()
    with pytest.raises(WorkerError) as err:
        group.call_all("uneven_load", Load(tensors=8, seconds=0.1, hang_after=3), watchdog=watch)
    assert str(err.value).startswith("no progress or reply from rank(s) [1] (cpu) for ")
    assert "last progress: tensor 8 of 8" in str(err.value)  # rank 0's: it had finished
    assert time.monotonic() - started < 10
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


def test_a_reply_from_another_job_is_never_accepted(group2: WorkerGroup) -> None:
    """Mutation tried: without the job-id check in `Job.collect` the call returned Value(value=-1)."""
    assert group2.call("send_stale_reply", Value(7)) == Value(7)


def test_cancel_during_a_load_stops_between_tensors(checkpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation tried: `load_progress` not checking the cancel flag → rank 0's load completed (its
    reply was ok) instead of JobCancelled."""
    with ParallelFlux(group=_group()) as flux:
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

        def cancel_at_five(done: int, total: int) -> None:
            seen.append((done, total))
            if done == 5:
                raise InterruptedError("user pressed Cancel")

        with pytest.raises(InterruptedError):
            flux.load(checkpoint, layout="tp", dtype="float32", progress=cancel_at_five)
        assert seen[-1][1] > 10  # the load had far more tensors to go
        # rank 0 reported tensor 5, so it saw the cancel before its last tensor; rank 1 (which reports
        # nothing) may have finished first: the cleanup below covers it
        assert load_replies[0].error_type == "JobCancelled"
        assert load_replies[0].error.startswith("JobCancelled: load cancelled after ")
        assert flux.resident is None
        assert [r.loaded for r in flux.status()] == [None, None]
        flux.load(checkpoint, layout="tp", dtype="float32")
        assert torch.equal(_sample(flux), _sample(flux))


def test_a_load_that_fails_on_one_rank_leaves_no_rank_holding_a_model(checkpoint: str) -> None:
    """Rank 1 runs out of memory at its 3rd tensor, rank 0 finishes its load. Mutation tried: without
    the unload in `ParallelFlux._load_resident`'s except clause, rank 0 still held the model."""
    with ParallelFlux(group=_group()) as flux:
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
    flux = ParallelFlux(group=group2)
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

    from rocm_parallel.backend import launch

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
            "least 50000 GB of host memory (0.5 GB each before any model) but ",
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
        "from rocm_parallel.backend.client import WorkerGroup\n"
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
        "from rocm_parallel.backend.client import WorkerGroup\n"
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
        ParallelFlux.check_sample(args.pop("positive"), args.pop("latent"), checkpoint=checkpoint, **args)
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
    }
    before = psutil.Process().children()
    for name, (overrides, message) in cases.items():
        assert _flux_checked(checkpoint, **overrides) == message, name
    assert psutil.Process().children() == before


def test_a_bad_dtype_leaves_the_resident_model_alone(checkpoint: str, group2: WorkerGroup) -> None:
    flux = ParallelFlux(group=group2)
    flux.load(checkpoint, layout="tp", dtype="float32")
    with pytest.raises(Exception, match="dtype='int8' is not a compute dtype"):
        flux.load(checkpoint, layout="tp", dtype="int8")
    assert flux.resident is not None and flux.resident.dtype == "float32"
    assert [r.loaded.dtype for r in flux.status()] == ["float32", "float32"]


def test_nan_from_a_step_is_an_error_naming_the_step(checkpoint: str, group2: WorkerGroup) -> None:
    """A finite input can still overflow inside the model (float16): the step that did it is named, and
    the loop (in the caller) stops there. Mutation tried: without the check in `euler` the job returned a
    NaN latent."""
    flux = ParallelFlux(group=group2)
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
