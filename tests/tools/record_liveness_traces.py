"""Record what the caller's watchdog sees under CPU contention, for tests/test_contention.py to replay:
tests/data/liveness/contention-<workers>.jsonl.gz (miniature loads and model calls, healthy) and one trace
per kind of hang in `HANGS` (rank 1 hangs at step 3 of `hang_at`), with more CPU burners than cores.

    python tests/tools/record_liveness_traces.py [--loads 30 --calls 300]

Each header says how the trace was made and counts its hard moments: `starved_looks` (a pending rank
runnable while its report was older than a second: its reporting thread waited for a core) and
`left_looks` (a rank still in a collective a peer had completed: what the old rules called a mismatch).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS)]

from test_contention import BURNERS, TRACES, _group, burning, run_contention  # noqa: E402
from worker_jobs import OnRank  # noqa: E402

from rocm_parallel.backend.runtime.client import WorkerError  # noqa: E402
from rocm_parallel.backend.runtime.liveness import DEFAULT_WATCHDOG  # noqa: E402
from rocm_parallel.testing.traces import Recorder  # noqa: E402


def _counts(events: list[dict]) -> dict[str, int]:
    starved = left = 0
    heard: dict[str, tuple[int, float]] = {}  # rank -> (beat, when it last changed)
    for event in events:
        if "looks" not in event:
            continue
        now, looks = event["now"], event["looks"]
        for rank, (state, process) in looks.items():
            if state is not None and heard.get(rank, (None,))[0] != state["beat"]:
                heard[rank] = (state["beat"], now)
            late = rank in heard and now - heard[rank][1] > 1.0
            if process is not None and process["working"] and late:
                starved += 1
        for rank, (state, _) in looks.items():
            if state is None or int(rank) not in event["pending"]:
                continue
            for group in state["groups"]:
                n = group["completed"] + 1 if group["issued"] > group["completed"] else 0
                if not n or group["pending_since"] < state["since"]:
                    continue
                for peer, (theirs, _) in looks.items():
                    mine = next(
                        (g for g in (theirs or {}).get("groups", ()) if g["name"] == group["name"]), None
                    )
                    if peer != rank and mine is not None and mine["completed"] >= n:
                        left += 1
    return {"starved_looks": starved, "left_looks": left}


def _header(world: int, pids: list[int], recorder: Recorder, how: str) -> dict:
    return {
        "devices": ["cpu"] * world,
        "pids": list(pids),
        "watchdog": dataclasses.asdict(DEFAULT_WATCHDOG),
        "recorded": how,
        "burners": BURNERS,
        "cores": os.cpu_count(),
        "loadavg": os.getloadavg()[0],
        **_counts(recorder.events),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loads", type=int, default=30)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--load-size", type=int, default=96, help="matrix side of a load's work per tensor")
    args = parser.parse_args()
    TRACES.mkdir(parents=True, exist_ok=True)
    with burning():
        for world in (2, 4):
            recorder = Recorder()
            pids = run_contention(world, args.loads, args.calls, recorder, args.load_size)
            how = f"{args.loads} miniature loads and {args.calls} calls beside {BURNERS} CPU burners"
            header = _header(world, pids, recorder, how)
            recorder.save(TRACES / f"contention-{world}.jsonl.gz", header)
            print(
                world,
                {k: header[k] for k in ("starved_looks", "left_looks", "loadavg")},
                len(recorder.events),
            )
        for name, (options, what) in HANGS.items():
            _record_hang(name, options, what)


# trace name -> (how rank 1 hangs at step 3: OnRank's options, in words)
HANGS = {
    "blocked-2": ({"kind": "block"}, "rank 1 blocked in Python"),
    "asleep-2": (
        {"kind": "sleep", "seconds": 3600.0, "noise": 0.2},
        "rank 1 asleep in Python while a thread of it uses a fifth of a core (issue 56)",
    ),
    "kernel-2": (
        {"kind": "kernel"},
        "rank 1's main thread in uninterruptible sleep (D), its reports going on",
    ),
}


def _record_hang(name: str, options: dict, what: str) -> None:
    recorder, group = Recorder(), _group(2)
    group._workers.trace = recorder
    try:
        group.call("hang_at", OnRank(rank=1, at_step=3, **options))
    except WorkerError as exc:
        print(f"{name}:", exc)
    how = f"hang_at, {what} at step 3, beside {BURNERS} burners"
    header = _header(2, group.pids, recorder, how)
    header["blocked_at"] = next(
        state["since"]
        for event in recorder.events
        for rank, (state, _) in event.get("looks", {}).items()
        if rank == "1" and state is not None and state["step"] == 3
    )
    group.close()
    recorder.save(TRACES / f"{name}.jsonl.gz", header)


if __name__ == "__main__":
    main()
