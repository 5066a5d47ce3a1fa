"""What the OS says a process does (backend/runtime/procstat.py) and what a rank's report carries besides its
activity (backend/runtime/heartbeat.py): real processes sleeping, spinning, stopped, a busy grandchild; the
reporting thread left out; a GPU queue through a fake stream (the CUDA path itself needs a GPU)."""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import freezers
import pytest

from rocm_parallel.backend.runtime.heartbeat import Heartbeat, _signature, read_state, state_path
from rocm_parallel.backend.runtime.procstat import sample

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="per-thread /proc is Linux's")

SPIN = "import time\nwhile True: pass\n"


@contextmanager
def _python(code: str) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _settle(pid: int, seconds: float = 0.3) -> None:
    """Let a just-started interpreter finish its start-up (CPU and disk)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        before = sample(pid)
        time.sleep(seconds)
        after = sample(pid)
        if before and after and after.cpu_seconds - before.cpu_seconds < 0.01 and not after.working:
            return
    raise AssertionError("the child never went quiet")


def test_a_sleeping_process_does_no_work_and_a_spinning_one_works() -> None:
    with _python("import time; print('ready', flush=True); time.sleep(60)") as sleeper:
        assert sleeper.stdout.readline().strip() == "ready"
        _settle(sleeper.pid)
        first = sample(sleeper.pid)
        time.sleep(0.5)
        second = sample(sleeper.pid)
        assert first is not None and second is not None
        assert not second.working and not second.stopped
        assert second.cpu_seconds - first.cpu_seconds < 0.02
    with _python(SPIN) as spinner:
        seen = [sample(spinner.pid) for _ in range(5)]
        assert all(s is not None and s.working for s in seen)  # runnable: running or waiting for a core


def test_a_stopped_process_is_stopped_and_a_gone_one_is_none() -> None:
    with _python("import time; time.sleep(60)") as proc:
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not (seen := sample(proc.pid)).stopped and time.monotonic() < deadline:
            time.sleep(0.02)
        assert seen.stopped
        os.kill(proc.pid, signal.SIGCONT)
    assert sample(proc.pid) is None


def test_a_busy_grandchild_counts_as_work() -> None:
    """The rank waits for a child it started (inductor's compiler, a decompressor): the child works."""
    code = (
        "import subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', {SPIN!r}])\n"
        "print(child.pid, flush=True)\n"
        "child.wait()\n"
    )
    with _python(code) as parent:
        child = int(parent.stdout.readline())
        try:
            time.sleep(0.3)
            first = sample(parent.pid)
            deadline = time.monotonic() + 20  # on a busy machine the child gets a small share of a core
            while (second := sample(parent.pid)).cpu_seconds - first.cpu_seconds <= 0.05:
                assert time.monotonic() < deadline, "the child's CPU time never counted"
                time.sleep(0.1)
            assert second.working
            assert sample(
                parent.pid, reporter=parent.pid
            ).working  # its main thread left out: the child works
        finally:
            os.kill(child, signal.SIGKILL)


def test_the_reporting_thread_is_left_out() -> None:
    """A process whose only busy thread is its reporter does no work; the reporter's being runnable is
    said apart (its reports are late, not stopped)."""
    code = (
        "import threading, time\n"
        "def spin():\n"
        "    print(threading.get_native_id(), flush=True)\n"
        "    while True: pass\n"
        "threading.Thread(target=spin, daemon=True).start()\n"
        "time.sleep(60)\n"
    )
    with _python(code) as proc:
        reporter = int(proc.stdout.readline())
        time.sleep(0.3)
        first = sample(proc.pid, reporter)
        time.sleep(0.5)
        second = sample(proc.pid, reporter)
        assert second is not None and not second.working
        assert second.cpu_seconds - first.cpu_seconds < 0.05
        assert any(sample(proc.pid, reporter).reporter_runnable for _ in range(10))
        assert sample(proc.pid).working  # counted, it would make the process look busy


class _Stream:
    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def test_a_report_says_whether_gpu_work_is_queued_and_which_thread_reports(tmp_path: Path) -> None:
    """The GPU path is a non-blocking stream query from the reporting thread; here through fake streams
    (torch.cuda.Stream.query's contract: True when all its work is done)."""
    beat = Heartbeat(0, str(tmp_path), interval=0.05)
    beat.watch_device(type("Device", (), {"type": "cpu"})())
    assert not beat.state().gpu  # a CPU has no queue
    queued, idle = _Stream(done=False), _Stream(done=True)
    beat.watch_device(None, streams=[idle, queued])
    assert beat.state().gpu
    queued.done = True
    assert not beat.state().gpu
    beat.start()
    deadline = time.monotonic() + 10
    while ((state := read_state(state_path(str(tmp_path), 0))) is None or not state.reporter) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.05)
    assert state is not None and state.reporter not in (0, threading.get_native_id())
    assert os.path.exists(f"/proc/{os.getpid()}/task/{state.reporter}")


@pytest.mark.torch_api
def test_a_collective_is_named_by_op_and_shapes_from_the_recorder() -> None:
    entries = [
        {"process_group": ["1", "tp"], "collective_seq_id": 4, "profiling_name": "gloo:all_reduce",
         "input_sizes": [[4, 3]]},
        {"process_group": ["0", "default_pg"], "collective_seq_id": 4, "profiling_name": "gloo:broadcast",
         "input_sizes": [[1]]},
    ]  # fmt: skip
    assert _signature(entries, "1", 4) == "all_reduce [[4,3]]"
    assert _signature(entries, "0", 4) == "broadcast [[1]]"
    assert _signature(entries, "0", 5) == ""


# ------------------------------------------------------------------------------------------ the job's thread


def test_the_jobs_thread_is_told_apart_from_the_others() -> None:
    """The main thread sleeps while another spins (gloo's threads, a user's prefetcher): the whole process
    works, the job does not (issue 56). Mutation tried: `job_working`/`job_cpu` from every thread made the
    sleeping main thread's job look busy."""
    code = (
        "import threading, time\n"
        "def spin():\n"
        "    while True: pass\n"
        "threading.Thread(target=spin, daemon=True).start()\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    with _python(code) as proc:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        first = sample(proc.pid)
        deadline = time.monotonic() + 20  # a starved spinner gets little of a core
        while (second := sample(proc.pid)).cpu_seconds - first.cpu_seconds < 0.05:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert second.working and second.main_state == "S" and not second.job_working
        assert second.job_cpu - first.job_cpu < 0.02
    with _python(SPIN) as spinner:
        assert any((s := sample(spinner.pid)).job_working and s.main_state == "R" for _ in range(20))


def test_a_main_thread_waiting_in_the_kernel_is_in_d_with_no_progress(tmp_path: Path) -> None:
    """tests/worker_jobs.py's `wait_in_kernel` (a vfork whose child never execs) puts the main thread in
    uninterruptible sleep, its interpreter free: what a stuck driver call looks like. The OS says D, where it
    waits, and no page or byte read; a SIGKILL of its process group ends it and the child."""
    from worker_jobs import wait_in_kernel

    source = inspect.getsource(wait_in_kernel)  # run alone: the test module imports torch
    code = f"import os\n{source}\nprint('ready', flush=True)\nwait_in_kernel()\n"
    env = {**os.environ, "RP_SHM_DIR": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 20
        while (seen := sample(proc.pid)).main_state != "D":
            assert time.monotonic() < deadline, seen
            time.sleep(0.05)
        time.sleep(0.5)
        later = sample(proc.pid)
        assert later.main_state == "D" and later.main_io == seen.main_io and later.job_cpu == seen.job_cpu
        assert later.main_wait not in ("", "0") and not later.stopped and not later.frozen
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.parametrize("version", [1, 2])
def test_a_frozen_cgroup_is_seen(version: int) -> None:
    """A process frozen by its cgroup's freezer: v1 shows its threads in D, v2 asleep (S); both say the
    cgroup. Mutation tried: `frozen_cgroup` returning '' left a v1-frozen process looking like D (no more)."""
    if why := freezers.unusable(version):
        pytest.skip(why)
    with _python("import time; print('ready', flush=True); time.sleep(60)") as proc:
        assert proc.stdout.readline().strip() == "ready"
        with freezers.frozen(proc.pid, version) as folder:
            state = "D" if version == 1 else "S"
            deadline = time.monotonic() + 10  # its threads stop on their way back to user space
            while not ((seen := sample(proc.pid)).frozen and seen.main_state == state):
                assert time.monotonic() < deadline, seen
                time.sleep(0.05)
            assert seen.frozen == folder
        assert not sample(proc.pid).frozen


def test_terminate_leaves_a_process_sigkill_cannot_end_and_returns(tmp_path: Path) -> None:
    """A worker frozen by cgroup v1's freezer ignores SIGKILL until thawed: `terminate` stops waiting after
    its limits and returns it instead of blocking its caller (issue 56: `proc.kill(); proc.wait()` without
    a timeout froze ComfyUI's execution thread). Mutation tried: the old last `proc.wait()` never returned
    (pytest-timeout)."""
    from rocm_parallel.backend.runtime import launch

    if why := freezers.unusable(1):
        pytest.skip(why)
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; print('ready', flush=True); sys.stdin.read(); time.sleep(60)"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    assert proc.stdout.readline().strip() == b"ready"
    with freezers.frozen(proc.pid, 1):
        while not sample(proc.pid).frozen:
            time.sleep(0.05)
        started = time.monotonic()
        left = launch.terminate([proc], (), grace=15.0)
        took = time.monotonic() - started
        assert left == [proc] and proc.returncode is None, left
        assert took < 1.0 + 1.0 + launch.REAP_SECONDS + 1.0, took  # the grace ends at once: it cannot run
        assert "its cgroup is frozen" in launch.why_left(proc.pid)
    proc.wait(timeout=10)  # thawed: the SIGKILL it holds ends it
    assert proc.returncode == -signal.SIGKILL


def test_a_worker_that_exits_takes_what_it_started_with_it() -> None:
    """A worker that exits by itself (its death pipe, a crash) leaves what it started (a compiler, a vfork
    child that never exec'd): `launch.reap` kills its process group before reaping it, while the group's id
    is still its own. Mutation tried: `reap` as a plain `poll()` left the child running."""
    from rocm_parallel.backend.runtime import launch

    code = (
        "import subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(child.pid, flush=True)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    child = int(proc.stdout.readline())
    try:
        deadline = time.monotonic() + 20
        while launch.reap(proc) is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{child}") and sample(child) is not None and not sample(child).zombie:
            assert time.monotonic() < deadline, "the child outlived its worker"
            time.sleep(0.02)
    finally:
        with contextlib.suppress(OSError):
            os.kill(child, signal.SIGKILL)
