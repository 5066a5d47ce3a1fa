"""What the caller's watchdog saw, recorded and replayed: every job start and every look `Workers.watch`
took (each rank's report, the OS's view of its process, which ranks had answered), written as gzipped JSON
lines by `Recorder` (set as `Workers.trace`) and fed back through a fresh `Liveness` by `replay`, the way
`Workers.begin` and `Workers.watch` feed it. The contention test's traces (tests/data/liveness/) were
recorded so on a machine with more CPU burners than cores (tests/tools/record_liveness_traces.py).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ..backend.runtime.liveness import Hang, Liveness, Process, Watchdog
from ..backend.runtime.messages import RankState


class Recorder:
    """`Workers.trace`: keeps every event, JSON-ready."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def __call__(self, event: dict[str, Any]) -> None:
        self.events.append(encode(event))

    def save(self, path: str | Path, header: dict[str, Any]) -> None:
        """Write `header` (devices, pids, watchdog, how it was recorded) and the events."""
        with gzip.open(path, "wt") as f:
            for line in (header, *self.events):
                f.write(json.dumps(line, separators=(",", ":")) + "\n")


def encode(event: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in event.items() if k not in ("looks", "states")}
    if "states" in event:
        out["states"] = {str(r): _state(s) for r, s in event["states"].items()}
    if "looks" in event:
        out["looks"] = {
            str(r): [_state(state), dataclasses.asdict(process) if process is not None else None]
            for r, (state, process) in event["looks"].items()
        }
    return out


def _state(state: RankState | None) -> Any:
    return json.loads(state.to_json()) if state is not None else None


def _decode_state(data: Any) -> RankState | None:
    return RankState.from_json(json.dumps(data)) if data is not None else None


def load(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(header, events) of a recorded trace."""
    with gzip.open(path, "rt") as f:
        lines = [json.loads(line) for line in f]
    return lines[0], lines[1:]


def replay(header: dict[str, Any], events: Iterable[dict[str, Any]]) -> Iterator[tuple[float, Hang | None]]:
    """Feed the recorded looks through `Liveness` (a new one at each job start, with the previous one's
    reports, as `Workers.begin` does): each look's (time, verdict)."""
    devices, pids = header["devices"], header["pids"]
    watchdog = Watchdog(**header["watchdog"])
    live = Liveness(devices, pids, watchdog, 0.0)
    for event in events:
        now = event["now"]
        if "begin" in event:
            old, live = live, Liveness(devices, pids, watchdog, now, event["begin"], event["job"])
            live.carry(old.seen)
            for rank, data in event["states"].items():
                live.observe(int(rank), now, _decode_state(data), None)
            continue
        for rank, (state, process) in event["looks"].items():
            live.observe(int(rank), now, _decode_state(state), Process(**process) if process else None)
        yield now, live.verdict(now, event["pending"], event["done"], event["failed"])
