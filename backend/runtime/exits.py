"""Why a worker process ended, in words: its exit code or signal, whether the kernel's out-of-memory
killer ended it, and how much memory it held when last seen.

A worker that outgrows the machine's memory is killed by the kernel with SIGKILL: the caller sees only
"exit code -9", the same as any other kill. The kernel counts its out-of-memory kills in /proc/vmstat
(`oom_kill`, Linux 4.13+, cgroup limits included), so a count that rose while the group ran tells the
two apart; the worker's resident memory comes from the caller's own periodic look at each rank
(`launch.Workers.process`), since a killed process can no longer be asked.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

GB = 1e9
VMSTAT = Path("/proc/vmstat")


@dataclass(frozen=True)
class MemoryReading:
    """A rank's resident memory and the machine's, at one look (`at`: time.monotonic())."""

    rss: int
    available: int
    total: int
    at: float


def oom_kill_count(vmstat: Path = VMSTAT) -> int | None:
    """The kernel's count of out-of-memory kills since boot, or None where the system does not say."""
    try:
        for line in vmstat.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return None


def signal_name(code: int) -> str:
    """'SIGKILL' for exit code -9 (a subprocess ended by a signal has the signal's negative number)."""
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def exit_reason(
    code: int,
    *,
    stopped_by_pack: bool,
    oom_kills_before: int | None,
    oom_kills_now: int | None,
    memory: MemoryReading | None,
    now: float,
) -> tuple[str, str]:
    """What a failure's message adds to 'worker rank R (device, pid P) exited with code C{name} while
    {doing}{why}': the signal's name, and for a SIGKILL the pack did not send, why it came."""
    if code >= 0:
        return "", ""
    name = f" ({signal_name(code)})"
    if code != -signal.SIGKILL or stopped_by_pack:
        return name, ""
    held = _held(memory, now)
    if oom_kills_before is not None and oom_kills_now is not None and oom_kills_now > oom_kills_before:
        return name, (
            f": out of host memory. The kernel's out-of-memory killer ended it{held}. Use a smaller image or "
            "batch, fewer workers on this machine, or GPU workers; `python -m rocm_parallel doctor` shows "
            "this machine's memory and how many workers fit"
        )
    if oom_kills_now is None:
        return name, (
            ": most likely out of host memory (the kernel's out-of-memory killer sends SIGKILL; this system "
            f"does not say whether it did){held}"
        )
    return (
        name,
        f": it was killed from outside the pack (the kernel's out-of-memory killer recorded no kill){held}",
    )


def _held(memory: MemoryReading | None, now: float) -> str:
    if memory is None:
        return "; its memory was never read"
    return (
        f"; its resident memory was {memory.rss / GB:.2f} GB when last read ({now - memory.at:.1f} s before), "
        f"with {memory.available / GB:.2f} GB of the machine's {memory.total / GB:.2f} GB available"
    )
