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
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from .messages import GroupState, RankState

BEAT_SECONDS = 0.2  # how often a rank reports (the caller's limits are seconds: many reports each)
_DUMPS = ("_dump_fr_trace_json", "_dump_nccl_trace_json")  # gloo/CPU; NCCL/RCCL (GPU builds only)
ASK_FILE = "ask.json"  # the caller's questions about collectives, in the reports' directory


def state_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}.json")


def write_state(path: str, state: RankState) -> None:
    """Replace the file at `path` with `state` in one step (a reader sees the old report or the new)."""
    partial = f"{path}.{threading.get_ident()}.tmp"
    with open(partial, "w") as f:
        f.write(state.to_json())
    os.replace(partial, path)


def write_ask(directory: str, asked: dict[str, int]) -> None:
    """Ask every rank what collective #n of each named group was (heartbeat: `GroupState.answer`)."""
    path = os.path.join(directory, ASK_FILE)
    partial = f"{path}.{threading.get_ident()}.tmp"
    with open(partial, "w") as f:
        f.write(json.dumps(asked))
    os.replace(partial, path)


def read_ask(path: str) -> dict[str, int]:
    try:
        with open(path) as f:
            asked = json.loads(f.read())
        return {str(group): int(seq) for group, seq in asked.items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def read_state(path: str) -> RankState | None:
    """The latest report at `path`, or None (not written yet)."""
    try:
        with open(path) as f:
            return RankState.from_json(f.read())
    except FileNotFoundError:
        return None


class Collectives:
    """Every process group of this rank as the flight recorder sees it: issued and completed collectives,
    since when the oldest pending one has been pending (this thread's observation), and what the
    collectives the caller asks about were (`ask`)."""

    def __init__(self) -> None:
        import torch

        c10d = torch._C._distributed_c10d
        self._dumps: list[Callable[..., Any]] = [getattr(c10d, n) for n in _DUMPS if hasattr(c10d, n)]
        self._names: dict[tuple[int, str], tuple[str, tuple[int, ...]]] = {}  # (dump, pg id) -> group
        self._pending: dict[str, tuple[int, float, str]] = {}  # group -> (seq, first seen, op)
        self._asked: dict[str, int] = {}  # group -> the collective the caller asks about
        self._answers: dict[str, str] = {}  # group -> its signature, once found
        self._looked: dict[str, int] = {}  # group -> collectives issued when last looked up (not found)

    def ask(self, asked: dict[str, int]) -> None:
        """The caller wants to know what collective #n of these groups was on this rank (answered in the
        following reports, once this rank has issued it)."""
        if asked != self._asked:
            self._asked, self._answers, self._looked = dict(asked), {}, {}

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
                state = self._state(name, ranks, issued, max(completed, 0), dump)
                if name in self._asked:
                    state = replace(state, asked=self._asked[name], answer=self._answer(name, issued, dump))
                groups.append(state)
        return tuple(groups)

    def _answer(self, group: str, issued: int, dump: Callable[..., Any]) -> str:
        """The signature of the asked collective of `group`, looked up in the recorder once it is issued
        (one dump; again only after more collectives were issued, when it was not found)."""
        seq = self._asked[group]
        if group not in self._answers and seq <= issued and self._looked.get(group) != issued:
            self._looked[group] = issued
            found = _signature(_entries(dump), group, seq)
            if found:
                self._answers[group] = found
        return self._answers.get(group, "")

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
            for entry in _entries(dump):
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
            held = (seq, held[1], _signature(_entries(dump), name, seq) or "?")
        self._pending[name] = held
        return GroupState(name, ranks, issued, completed, held[2].split(" ")[0], held[1])


def _group_names() -> dict[Any, str]:
    """Process group -> name, for every group this rank belongs to (torch keeps no public map)."""
    from torch.distributed import distributed_c10d

    return dict(distributed_c10d._world.pg_names)


def _entries(dump: Callable[..., Any]) -> list[dict[str, Any]]:
    """The recorder's entries (its last TORCH_FR_BUFFER_SIZE collectives: launch.py keeps that small, so
    a dump costs about a millisecond)."""
    with contextlib.suppress(Exception):
        return list(json.loads(dump(True, False)).get("entries", []))
    return []


def _signature(entries: list[dict[str, Any]], group: str, seq: int) -> str:
    """What collective #`seq` of `group` was: its op and input sizes, 'all_reduce [[4, 3]]' ('' when the
    recorder no longer holds it)."""
    for entry in reversed(entries):
        with contextlib.suppress(KeyError, TypeError, IndexError):
            if entry["process_group"][0] == group and entry["collective_seq_id"] == seq:
                op = str(entry["profiling_name"]).split(":")[-1] or "?"
                return f"{op} {json.dumps(entry.get('input_sizes', []), separators=(',', ':'))}"
    return ""


class Heartbeat:
    """This rank's reports: `set` by the main thread when its activity changes, written by a daemon
    thread every `interval` seconds with the collectives read at that moment, whether GPU work is queued
    (`watch_device`) and the answers to the caller's questions about collectives (`ASK_FILE`)."""

    def __init__(self, rank: int, directory: str, interval: float = BEAT_SECONDS) -> None:
        self.rank, self.path, self.interval = rank, state_path(directory, rank), interval
        self._ask_path = os.path.join(directory, ASK_FILE)
        self._asked_at = 0  # the ask file's modification time when last read
        self._activity: tuple[str, int, str, int, int, float, str] = (
            "starting", 0, "", 0, 0, time.monotonic(), "importing torch",
        )  # fmt: skip
        self._collectives: Collectives | None = None
        self._streams: tuple[Any, ...] = ()  # what `gpu_queued` asks (watch_device)
        self._reporter = 0  # the reporting thread's id, once it runs
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
        native call or stopped, is then reported in this job, not as it was in the last one; a finished
        job: the caller reads the collectives the rank issued in it before its reply)."""
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

    def watch_device(self, device: Any, streams: Sequence[Any] | None = None) -> None:
        """Report whether work is queued on `device` (a GPU): a rank whose host thread waits for its GPU
        (a long kernel, a synchronize) works. `streams`: what to ask (anything with a non-blocking
        `query()`, True when its work is done); by default the device's default stream and the calling
        (main) thread's current one. A CPU device has nothing to ask."""
        if streams is None:
            if getattr(device, "type", "cpu") != "cuda":
                return
            import torch

            found = [torch.cuda.default_stream(device), torch.cuda.current_stream(device)]
            streams = [s for i, s in enumerate(found) if s not in found[:i]]
        self._streams = tuple(streams)

    def gpu_queued(self) -> bool:
        """Work is queued on the device: a stream query (cudaStreamQuery / hipStreamQuery) returns at once,
        with or without the GIL's other holder waiting for the GPU."""
        return any(not stream.query() for stream in self._streams)

    def state(self) -> RankState:
        doing, job, method, step, total, since, detail = self._activity
        self._beat += 1
        if self._collectives is not None:
            self._read_ask(self._collectives)
        groups = self._collectives.read() if self._collectives is not None else ()
        return RankState(
            self.rank, os.getpid(), self._beat, doing, job, method, step, total, since, detail, groups,
            reporter=self._reporter, gpu=self.gpu_queued(),
        )  # fmt: skip

    def _read_ask(self, collectives: Collectives) -> None:
        """Take the caller's questions (a stat per beat; the file is read when it changed)."""
        try:
            changed = os.stat(self._ask_path).st_mtime_ns
        except OSError:
            changed = 0
        if changed != self._asked_at:
            self._asked_at = changed
            collectives.ask(read_ask(self._ask_path))

    def _run(self) -> None:
        self._reporter = threading.get_native_id()
        while True:
            # Nothing may end this thread: a rank that stops reporting counts as hung.
            with contextlib.suppress(Exception):
                self._write()
            time.sleep(self.interval)

    def _write(self) -> None:
        with self._lock:
            write_state(self.path, self.state())
