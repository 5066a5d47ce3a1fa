"""cgroup freezers for the hang tests: a process frozen by cgroup v1's freezer (every thread in D, SIGKILL
held until the thaw: a frozen container, and what a stuck driver call looks like to the OS) or by cgroup
v2's `cgroup.freeze` (every thread asleep, S; SIGKILL works). Each test cgroup is named after the process it
holds, `rocm-parallel-test-<pid>`, so the test that froze a worker from inside can thaw and remove it."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

# version -> (hierarchy on this machine, control file, frozen, thawed)
FREEZERS = {
    1: ("/sys/fs/cgroup/freezer", "freezer.state", "FROZEN", "THAWED"),
    2: ("/sys/fs/cgroup/unified", "cgroup.freeze", "1", "0"),
}


def folder(version: int, pid: int) -> str:
    return os.path.join(FREEZERS[version][0], f"rocm-parallel-test-{pid}")


def unusable(version: int) -> str:
    """Why this machine (or user) cannot freeze a process with cgroup `version`'s freezer, or ''."""
    root, control, _, _ = FREEZERS[version]
    probe = folder(version, os.getpid())
    try:
        os.mkdir(probe)
    except OSError as exc:
        return f"no cgroup v{version} freezer this user can use at {root}: {exc}"
    try:
        if not os.path.exists(os.path.join(probe, control)):
            return f"the cgroup hierarchy at {root} has no {control}"
        return ""
    finally:
        os.rmdir(probe)


def freeze(version: int, pid: int) -> str:
    """Move process `pid` into a cgroup of its own and freeze it; the cgroup's folder."""
    _, control, frozen, _ = FREEZERS[version]
    where = folder(version, pid)
    os.makedirs(where, exist_ok=True)
    Path(where, "cgroup.procs").write_text(str(pid))
    Path(where, control).write_text(frozen)
    return where


def thaw(version: int, pid: int) -> None:
    """Thaw `pid`'s test cgroup (a SIGKILL it held then ends it), move it back to the root cgroup when it
    is still alive, and remove the cgroup (nothing when there is none)."""
    root, control, _, thawed = FREEZERS[version]
    where = folder(version, pid)
    if not os.path.isdir(where):
        return
    Path(where, control).write_text(thawed)
    with contextlib.suppress(OSError):  # gone already when a SIGKILL was waiting for the thaw
        Path(root, "cgroup.procs").write_text(str(pid))
    deadline = time.monotonic() + 10
    while True:
        try:
            os.rmdir(where)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@contextlib.contextmanager
def frozen(pid: int, version: int) -> Iterator[str]:
    """`pid` frozen for the block (thawed and its cgroup removed afterwards)."""
    try:
        yield freeze(version, pid)
    finally:
        thaw(version, pid)
