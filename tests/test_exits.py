"""A worker the kernel kills for want of memory is reported as out of host memory, with what it held.

The real case: one worker is moved into a memory cgroup of its own with a small limit, then asked to
grow past it, so the kernel's out-of-memory killer ends it exactly as it would on a full machine. That
needs a writable memory cgroup (root in a container, as on this project's machines and CI).
"""

from __future__ import annotations

import os
import re
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from worker_jobs import OnRank

from rocm_parallel.backend.runtime.client import WorkerError, WorkerGroup
from rocm_parallel.backend.runtime.exits import MemoryReading, exit_reason, oom_kill_count

TESTS_DIR = str(Path(__file__).resolve().parent)
LIMIT = 256 * 2**20


def _memory_cgroup() -> tuple[Path, str, tuple[str, ...]] | None:
    """This process's memory cgroup directory, the limit file and the swap limit files (v1 or v2)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return (
                Path("/sys/fs/cgroup/memory") / path.lstrip("/"),
                "memory.limit_in_bytes",
                ("memory.memsw.limit_in_bytes",),
            )
        if controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
            return Path("/sys/fs/cgroup") / path.lstrip("/"), "memory.max", ("memory.swap.max",)
    return None


@pytest.fixture
def limited_cgroup() -> Iterator[Path]:
    """A child memory cgroup limited to LIMIT bytes (swap included), removed afterwards."""
    found = _memory_cgroup()
    if found is None or not os.access(found[0], os.W_OK):
        pytest.skip(
            "needs a writable memory cgroup (root) to let the kernel's out-of-memory killer end a worker"
        )
    parent, limit_file, swap_files = found
    child = parent / f"rp-test-{uuid.uuid4().hex[:8]}"
    child.mkdir()
    try:
        (child / limit_file).write_text(str(LIMIT))
        for name in swap_files:
            if (child / name).exists():
                (child / name).write_text(str(LIMIT) if name.startswith("memory.memsw") else "0")
        yield child
    finally:
        child.rmdir()  # empty again once its process is gone


def test_a_worker_killed_for_memory_is_reported_as_out_of_host_memory(limited_cgroup: Path) -> None:
    before = oom_kill_count()
    assert before is not None, "this kernel does not count out-of-memory kills in /proc/vmstat"
    with WorkerGroup(["cpu", "cpu"], threads=1, extra_sys_path=[TESTS_DIR], methods=["worker_jobs"]) as group:
        victim = group.pids[1]
        start_rss = psutil.Process(victim).memory_info().rss
        (limited_cgroup / "cgroup.procs").write_text(str(victim))
        with pytest.raises(WorkerError) as err:
            group.call("grow_memory", OnRank(rank=1, n=2048, seconds=0.3))  # ~3 s to the limit: several looks
    text = str(err.value)
    found = re.search(
        rf"^worker rank 1 \(cpu, pid {victim}\) exited with code -9 \(SIGKILL\) while running 'grow_memory': out "
        r"of host memory\. The kernel's out-of-memory killer ended it; its resident memory was (\d+\.\d\d) GB "
        r"when last read \(\d+\.\d s before\), with \d+\.\d\d GB of the machine's \d+\.\d\d GB available\. Use a "
        r"smaller image or batch, fewer workers on this machine, or GPU workers; `python -m rocm_parallel "
        r"doctor` shows this machine's memory and how many workers fit",
        text,
    )
    assert found, text
    assert oom_kill_count() > before
    # The last reading caught it on its way up: above where it started, at most its limit above that.
    assert start_rss / 1e9 + 0.05 < float(found[1]) <= (start_rss + LIMIT) / 1e9 + 0.01, (start_rss, text)
    assert not psutil.pid_exists(victim) or psutil.Process(victim).status() == psutil.STATUS_ZOMBIE


def _reason(code: int, **kw: object) -> tuple[str, str]:
    defaults: dict[str, object] = dict(
        stopped_by_pack=False, oom_kills_before=3, oom_kills_now=3, memory=None, now=10.0
    )
    return exit_reason(code, **{**defaults, **kw})  # type: ignore[arg-type]


def test_exit_reasons_name_the_signal_and_only_blame_memory_on_evidence() -> None:
    seen = MemoryReading(rss=int(5.5e9), available=int(0.25e9), total=int(24e9), at=9.5)
    assert _reason(1) == ("", "")
    assert _reason(-signal.SIGSEGV) == (" (SIGSEGV)", "")
    assert _reason(-signal.SIGKILL, stopped_by_pack=True, oom_kills_now=4) == (" (SIGKILL)", "")
    assert _reason(-signal.SIGKILL, memory=seen)[1] == (
        ": it was killed from outside the pack (the kernel's out-of-memory killer recorded no kill); its "
        "resident memory was 5.50 GB when last read (0.5 s before), with 0.25 GB of the machine's 24.00 GB "
        "available"
    )
    assert _reason(-signal.SIGKILL, oom_kills_before=None, oom_kills_now=None)[1] == (
        ": most likely out of host memory (the kernel's out-of-memory killer sends SIGKILL; this system does "
        "not say whether it did); its memory was never read"
    )
    assert _reason(-signal.SIGKILL, oom_kills_now=4, memory=seen)[1].startswith(
        ": out of host memory. The kernel's out-of-memory killer ended it; its resident memory was 5.50 GB"
    )
