"""What the OS says a worker process is doing, thread by thread: `sample(pid, reporter)`.

The caller tells a rank that does no work from one that works slowly (liveness.py) by the kernel's own
account, read from /proc, in two views:

- the job's: its main thread (the one that runs the job: the process's first, tid == pid) and the
  processes it started (a compiler inductor runs, a decompressor). The job works when that thread is
  runnable (`R`: running, or waiting for a core on a busy machine) or used CPU, or a descendant works.
  Its other threads are left out: gloo's transfer threads wake a few times a second and use a tick or
  three of CPU whatever the job does (issue 56: a rank hung in `time.sleep` was taken for working by them).
  A main thread in uninterruptible sleep (`D`) is reported apart, with whether it made disk progress (major
  page faults, bytes read) and where in the kernel it waits: a slow disk moves, a stuck driver call or a
  frozen cgroup does not.
- the whole process's: every thread but the reporter's and the descendants, runnable or in disk wait,
  and their CPU time. A rank inside a collective waits in its main thread while gloo's threads move the
  data: on a starved machine those threads are `R` for seconds, and that is the collective's progress.

The rank's reporting thread (heartbeat.py) is left out of both: it wakes several times a second whatever
the rank does, and a starved one is `R` for a long time (said apart: `reporter_runnable`).

A process its cgroup's freezer holds (cgroup v1 `freezer.state` FROZEN, whose tasks show `D` and ignore
SIGKILL until thawed; cgroup v2 `cgroup.freeze`, whose tasks show `S`) is reported as `frozen`, with the
cgroup's path.

psutil gives the process's state (its main thread's only) and total CPU time; the per-thread view and the
children's are read here from /proc (Linux; elsewhere `sample` falls back to psutil's process-wide view,
and `main_state` is '': the job's view is then the whole process's).
"""

from __future__ import annotations

import functools
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
    main_state: str = ""  # the main thread's state letter ('' where /proc has no per-thread view)
    job_cpu: float = 0.0  # CPU seconds of the main thread and the descendants
    job_working: bool = False  # the main thread is runnable, or a descendant runnable or in disk wait
    main_io: int = 0  # the main thread's major page faults + bytes read from storage (progress while `D`)
    main_wait: str = ""  # where in the kernel the main thread waits, when it is `D` (/proc wchan)
    frozen: str = ""  # the frozen cgroup that holds the process ('' when none)


def _stat(path: str) -> tuple[str, float, int] | None:
    """(state letter, user + system seconds, major faults) from a /proc .../stat file; None: gone."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ')': split after the last one.
    fields = text[text.rfind(")") + 2 :].split()
    if len(fields) < 13:
        return None
    return fields[0], (int(fields[11]) + int(fields[12])) / _TICK, int(fields[9])


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _read_bytes(pid: int, tid: int) -> int:
    """Bytes the thread caused to be read from storage (0 where the kernel does not count them)."""
    for line in _read(f"/proc/{pid}/task/{tid}/io").splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


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


def _threads(pid: int, skip: int | None) -> tuple[dict[int, tuple[str, float, int]], bool] | None:
    """Each thread's (state, CPU seconds, major faults) by tid but `skip`'s, and whether `skip` is
    runnable; None: gone."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    threads, skipped_runnable = {}, False
    for tid in map(int, tasks):
        stat = _stat(f"/proc/{pid}/task/{tid}/stat")
        if stat is None:
            continue  # the thread ended between the listing and the read
        if skip is not None and tid == skip:
            skipped_runnable = stat[0] == "R"
            continue
        threads[tid] = stat
    return threads, skipped_runnable


def _descendants(pid: int) -> tuple[float, bool]:
    """CPU seconds of every process `pid` started (and they started), and whether a thread of one is
    runnable or in disk wait."""
    cpu, working = 0.0, False
    todo, visited = _children(pid), 0
    while todo and visited < _MAX_CHILDREN:
        child = todo.pop()
        visited += 1
        seen = _threads(child, None)
        if seen is None:
            continue
        cpu += sum(seconds for _, seconds, _ in seen[0].values())
        working = working or any(state in _WORKING for state, _, _ in seen[0].values())
        todo += _children(child)
    return cpu, working


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
    child_cpu, child_working = _descendants(pid)
    main_state, main_cpu, faults = threads.get(pid, main)
    return ProcSample(
        stopped=main[0] in _STOPPED,
        cpu_seconds=sum(seconds for _, seconds, _ in threads.values()) + child_cpu,
        working=child_working or any(state in _WORKING for state, _, _ in threads.values()),
        reporter_runnable=reporter_runnable,
        main_state=main_state,
        job_cpu=main_cpu + child_cpu,
        job_working=main_state == "R" or child_working,
        main_io=faults + _read_bytes(pid, pid),
        main_wait=_read(f"/proc/{pid}/task/{pid}/wchan").strip() if main_state == "D" else "",
        frozen=frozen_cgroup(pid),
    )


def frozen_cgroup(pid: int) -> str:
    """The path of the cgroup whose freezer holds `pid` frozen, or '' (not frozen, or no freezer here)."""
    for line in _read(f"/proc/{pid}/cgroup").splitlines():
        _, controllers, path = line.split(":", 2)
        if path in ("", "/"):
            continue  # the root cgroup cannot be frozen
        if controllers == "":  # cgroup v2: one hierarchy, cgroup.freeze
            for folder in _mounted("cgroup2", "", path):
                if "frozen 1" in _read(os.path.join(folder, "cgroup.events")).splitlines():
                    return folder
        elif "freezer" in controllers.split(","):  # cgroup v1's freezer hierarchy
            for folder in _mounted("cgroup", "freezer", path):
                if _read(os.path.join(folder, "freezer.state")).strip() in ("FROZEN", "FREEZING"):
                    return folder
    return ""


def _mounted(kind: str, controller: str, path: str) -> list[str]:
    """Where the cgroup at `path` (as /proc/<pid>/cgroup writes it) is in this process's mounts."""
    folders = []
    for root, point in _cgroup_mounts(kind, controller):
        if path == root or path.startswith(root.rstrip("/") + "/"):
            folders.append(os.path.join(point, path[len(root) :].lstrip("/")))
    return folders


@functools.lru_cache(maxsize=4)
def _cgroup_mounts(kind: str, controller: str) -> tuple[tuple[str, str], ...]:
    """(cgroup root, mount point) of each mount of `kind` ('cgroup' with `controller`, or 'cgroup2'),
    from /proc/self/mountinfo (read once: cgroup hierarchies are mounted at boot)."""
    found = []
    for line in _read("/proc/self/mountinfo").splitlines():
        head, _, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if len(fields) < 5 or len(rest) < 3 or rest[0] != kind:
            continue
        if controller and controller not in rest[2].split(","):
            continue
        found.append((fields[3], fields[4].replace("\\040", " ")))
    return tuple(found)


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
