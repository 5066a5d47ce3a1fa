"""What the OS says a worker process is doing, thread by thread: `sample(pid, reporter)`.

The caller tells a rank that does no work from one that works slowly (liveness.py) by the kernel's own
account, read from /proc: each thread's scheduler state and CPU time, and those of the processes it
started (a compiler inductor runs, a decompressor). A process whose threads are all asleep (`S`: in a
futex, a socket, `time.sleep`) and use no CPU does no work; one with a thread runnable (`R`: running, or
waiting for a core on a busy machine) or in disk wait (`D`: a slow or network disk) works, however little
CPU it gets. The rank's reporting thread (heartbeat.py) is left out: it wakes several times a second
whatever the rank does, and a starved one is `R` for a long time.

psutil gives the process's state (its main thread's only) and total CPU time; the per-thread view and the
children's are read here from /proc (Linux; elsewhere `sample` falls back to psutil's process-wide view).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_WORKING = frozenset("RD")  # runnable (running or waiting for a core), uninterruptible (disk) wait
_STOPPED = frozenset("Tt")  # SIGSTOP, a debugger
_MAX_CHILDREN = 64  # descendants looked at: a rank starts a handful (compilers), never thousands


@dataclass(frozen=True)
class ProcSample:
    """One look at a process and its descendants (its reporting thread left out)."""

    stopped: bool  # the process is stopped (SIGSTOP, a debugger)
    cpu_seconds: float  # user + system time of every thread but the reporter's, descendants' included
    working: bool = False  # a thread (not the reporter) or a descendant is runnable or in disk wait
    reporter_runnable: bool = False  # the reporting thread waits for a core: its reports are late, not over
    zombie: bool = False


def _stat(path: str) -> tuple[str, float] | None:
    """(state letter, user + system seconds) from a /proc .../stat file, or None when it is gone."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ')': split after the last one.
    fields = text[text.rfind(")") + 2 :].split()
    if len(fields) < 13:
        return None
    return fields[0], (int(fields[11]) + int(fields[12])) / _TICK


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
    return found


def _threads(pid: int, skip: int | None) -> tuple[list[tuple[str, float]], bool] | None:
    """Each thread's (state, CPU seconds) but `skip`'s, and whether `skip` is runnable; None: gone."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    threads, skipped_runnable = [], False
    for tid in tasks:
        stat = _stat(f"/proc/{pid}/task/{tid}/stat")
        if stat is None:
            continue  # the thread ended between the listing and the read
        if skip is not None and int(tid) == skip:
            skipped_runnable = stat[0] == "R"
            continue
        threads.append(stat)
    return threads, skipped_runnable


def sample(pid: int, reporter: int | None = None) -> ProcSample | None:
    """The process `pid` and its descendants now; `reporter`: the thread id of its reporting thread (left
    out). None once the process is gone."""
    if not os.path.isdir("/proc/self/task"):
        return _psutil_sample(pid)
    main = _stat(f"/proc/{pid}/stat")
    seen = _threads(pid, reporter)
    if main is None or seen is None:
        return None
    threads, reporter_runnable = seen
    if main[0] in "ZX":
        return ProcSample(stopped=False, cpu_seconds=0.0, working=False, zombie=True)
    cpu = sum(seconds for _, seconds in threads)
    working = any(state in _WORKING for state, _ in threads)
    todo, visited = _children(pid), 0
    while todo and visited < _MAX_CHILDREN:
        child = todo.pop()
        visited += 1
        child_threads = _threads(child, None)
        if child_threads is None:
            continue
        cpu += sum(seconds for _, seconds in child_threads[0])
        working = working or any(state in _WORKING for state, _ in child_threads[0])
        todo += _children(child)
    return ProcSample(
        stopped=main[0] in _STOPPED, cpu_seconds=cpu, working=working, reporter_runnable=reporter_runnable
    )


def _psutil_sample(pid: int) -> ProcSample | None:
    """Where /proc has no per-thread view: the main thread's state and the whole process's CPU time."""
    try:
        ps = psutil.Process(pid)
        with ps.oneshot():
            status, times = ps.status(), ps.cpu_times()
    except psutil.Error:
        return None
    return ProcSample(
        stopped=status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP),
        cpu_seconds=times.user + times.system,
        working=status in (psutil.STATUS_RUNNING, psutil.STATUS_DISK_SLEEP),
        zombie=status == psutil.STATUS_ZOMBIE,
    )
