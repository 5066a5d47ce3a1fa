"""What a rank is doing, written several times a second by a thread of its own: `Heartbeat`.

The caller (liveness.py) tells a hung rank from a slow one by these reports, never by a clock: a rank
whose reports stop (a stopped process, an interpreter stuck in a native call) or that waits in a
collective its peers have left is hung; a rank that keeps reporting 'computing' or 'loading' is working,
however long that takes. So the reports must keep coming while the main thread is busy or blocked:

- they come from a daemon thread, and the main thread only swaps one tuple when its activity changes
  (`Heartbeat.set`, a few hundred nanoseconds: cheap at every step and tensor);
- they go to a small file per rank in a private tmpfs directory (written whole, then renamed into place,
  so a reader never sees half of one), not through the control socket: a report never waits behind a
  reply, a blocked socket or a caller that is between jobs, and the caller can read it at start-up,
  before the rank has even connected.

Where a rank is in its collectives comes from torch's own flight recorder (`Collectives`), which every
process group (gloo, NCCL/RCCL) fills for every collective, whichever API issued it: our TP all-reduces
(`dist.all_reduce` in parallel/tensor.py), diffusers' context-parallel all-gathers and all-to-alls
(functional collectives, async, waited on later), the step barrier's broadcast and DTensor alike. Its
per-group status (`pg_status`: the last collective enqueued and the last completed) is read from this
thread in about ten microseconds. The alternatives were weighed and rejected: a TorchDispatchMode sees
every op in Python (a callback per aten op: tens of milliseconds per FLUX forward) and cannot see an
NCCL collective completing on the GPU; wrapping `torch.distributed`'s functions misses the functional
collectives diffusers calls through `torch.ops._c10d_functional`, names bound at import (`from
torch.distributed import all_reduce`), and again GPU-side completion. The recorder is a private API of
torch (`torch._C._distributed_c10d._dump_fr_trace_json` for gloo, `_dump_nccl_trace_json` for NCCL/RCCL):
when it is missing or fails, the reports carry no collectives and only the stopped-reporting rule applies.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from .messages import GroupState, RankState

BEAT_SECONDS = 0.2  # how often a rank reports (the caller's limits are seconds: many reports each)
_DUMPS = ("_dump_fr_trace_json", "_dump_nccl_trace_json")  # gloo/CPU; NCCL/RCCL (GPU builds only)


def state_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}.json")


def write_state(path: str, state: RankState) -> None:
    """Replace the file at `path` with `state` in one step (a reader sees the old report or the new)."""
    partial = f"{path}.{threading.get_ident()}.tmp"
    with open(partial, "w") as f:
        f.write(state.to_json())
    os.replace(partial, path)


def read_state(path: str) -> RankState | None:
    """The latest report at `path`, or None (not written yet)."""
    try:
        with open(path) as f:
            return RankState.from_json(f.read())
    except FileNotFoundError:
        return None


class Collectives:
    """Every process group of this rank as the flight recorder sees it: issued and completed collectives,
    and since when the oldest pending one has been pending (this thread's observation)."""

    def __init__(self) -> None:
        import torch

        c10d = torch._C._distributed_c10d
        self._dumps: list[Callable[..., Any]] = [getattr(c10d, n) for n in _DUMPS if hasattr(c10d, n)]
        self._names: dict[tuple[int, str], tuple[str, tuple[int, ...]]] = {}  # (dump, pg id) -> group
        self._pending: dict[str, tuple[int, float, str]] = {}  # group -> (seq, first seen, op)

    def read(self) -> tuple[GroupState, ...]:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return ()
        groups = []
        for index, dump in enumerate(self._dumps):
            try:
                status = json.loads(dump(False, False)).get("pg_status", {})
            except Exception:  # a recorder that cannot dump says nothing; the report still goes out
                continue
            for pg_id, s in status.items():
                issued, completed = int(s["last_enqueued_collective"]), int(s["last_completed_collective"])
                name, ranks = self._group((index, pg_id), dump)
                groups.append(self._state(name, ranks, issued, max(completed, 0), dump))
        return tuple(groups)

    def _group(self, key: tuple[int, str], dump: Callable[..., Any]) -> tuple[str, tuple[int, ...]]:
        """The name and ranks of a group the status lists by its recorder id (learned once, from the
        recorder's entries, which carry both)."""
        if key not in self._names:
            self._learn(*key, dump)
        return self._names[key]

    def _learn(self, index: int, pg_id: str, dump: Callable[..., Any]) -> None:
        import torch.distributed as dist

        with contextlib.suppress(Exception):
            members = {name: tuple(dist.get_process_group_ranks(pg)) for pg, name in _group_names().items()}
            for entry in json.loads(dump(True, False)).get("entries", []):
                name = entry["process_group"][0]
                self._names[(index, str(entry["pg_id"]))] = (name, members.get(name, ()))
        self._names.setdefault((index, pg_id), (f"pg{pg_id}", ()))  # one try: no dump at every beat

    def _state(
        self, name: str, ranks: tuple[int, ...], issued: int, completed: int, dump: Callable[..., Any]
    ) -> GroupState:
        if issued <= completed:
            self._pending.pop(name, None)
            return GroupState(name, ranks, issued, completed)
        seq = completed + 1
        held = self._pending.get(name)
        if held is None or held[0] != seq:
            held = (seq, time.monotonic(), "")
        if not held[2] and time.monotonic() - held[1] > 2 * BEAT_SECONDS:  # long enough to name it
            held = (seq, held[1], _op_name(dump, name, seq))
        self._pending[name] = held
        return GroupState(name, ranks, issued, completed, held[2], held[1])


def _group_names() -> dict[Any, str]:
    """Process group -> name, for every group this rank belongs to (torch keeps no public map)."""
    from torch.distributed import distributed_c10d

    return dict(distributed_c10d._world.pg_names)


def _op_name(dump: Callable[..., Any], group: str, seq: int) -> str:
    with contextlib.suppress(Exception):
        for entry in reversed(json.loads(dump(True, False)).get("entries", [])):
            if entry["process_group"][0] == group and entry["collective_seq_id"] == seq:
                return str(entry["profiling_name"]).split(":")[-1] or "?"
    return "?"


class Heartbeat:
    """This rank's reports: `set` by the main thread when its activity changes, written by a daemon
    thread every `interval` seconds with the collectives read at that moment."""

    def __init__(self, rank: int, directory: str, interval: float = BEAT_SECONDS) -> None:
        self.rank, self.path, self.interval = rank, state_path(directory, rank), interval
        self._activity: tuple[str, int, str, int, int, float, str] = (
            "starting", 0, "", 0, 0, time.monotonic(), "importing torch",
        )  # fmt: skip
        self._collectives: Collectives | None = None
        self._beat = 0
        self._lock = threading.Lock()  # one writer at a time: beats stay in order
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def set(
        self,
        doing: str,
        *,
        job: int = 0,
        method: str = "",
        step: int = 0,
        total: int = 0,
        detail: str = "",
        publish: bool = False,
    ) -> None:
        """What the main thread does from now on (one tuple swap: the thread reads whole tuples).
        `publish`: written at once, from this thread (a new job: a rank that hangs in its first line, in a
        native call or stopped, is then reported in this job, not as it was in the last one)."""
        self._activity = (doing, job, method, step, total, time.monotonic(), detail)
        if publish:
            with contextlib.suppress(OSError):  # the thread writes it within `interval` anyway
                self._write()

    def update(self, step: int, total: int, doing: str | None = None) -> None:
        """The same job at its next step or tensor (`doing`: 'computing' or 'loading'; None: unchanged)."""
        was, job, method, *_ = self._activity
        self._activity = (doing or was, job, method, step, total, time.monotonic(), "")

    def watch_collectives(self) -> None:
        """Report collectives from now on (once the process group exists)."""
        self._collectives = Collectives()

    def state(self) -> RankState:
        doing, job, method, step, total, since, detail = self._activity
        self._beat += 1
        groups = self._collectives.read() if self._collectives is not None else ()
        return RankState(
            self.rank, os.getpid(), self._beat, doing, job, method, step, total, since, detail, groups
        )

    def _run(self) -> None:
        while True:
            # Nothing may end this thread: a rank that stops reporting counts as hung.
            with contextlib.suppress(Exception):
                self._write()
            time.sleep(self.interval)

    def _write(self) -> None:
        with self._lock:
            write_state(self.path, self.state())
