"""`bench hangs`: how long a caller waits for a hung rank to be named, on a quiet machine and beside CPU
burners, with the default watchdog (issue 56's measure).

Twenty Python-level hangs (asleep or on a lock, and two more kinds; in the first model call after a load,
mid-sample, during a load or a LoRA change; 2 and 4 CPU workers sampling a tiny FLUX through the public
API) run once on the machine as it is and once beside `--burners` processes that keep a core busy each
(4 on a 2-core machine: load ~15 with the workers). Each row is the time from the moment rank 1 hung (it
writes time.monotonic() as it does: the same clock in every process) to the caller's error, and whether the
error names rank 1. Then the kernel-level hangs, both ways: rank 1's main thread in uninterruptible sleep
(D) with its reports going on (a stuck driver call; tests/worker_jobs.py `wait_in_kernel`), SIGSTOP, and
frozen by cgroup v1's freezer (D, SIGKILL held until the thaw) and v2's; for those the table adds how long
closing the group took inside the caller (the job closes it before it raises) and an explicit `close()` of
a group whose rank 1 is frozen between jobs. The faults come from the test suite's worker methods
(tests/worker_jobs.py `arm_failure`, `arm_load_failure`, `hang_at`), so a checkout is needed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..backend.api import ParallelModel
from ..backend.config import ConfigError
from ..backend.runtime import launch, watch
from ..backend.runtime.client import WorkerError, WorkerGroup
from ..backend.runtime.liveness import DEFAULT_WATCHDOG
from ..testing.helpers import TINY_CONFIG as CONFIG
from ..testing.helpers import burning, sampling_job, write_random_checkpoint
from ..testing.writers import write_random_lora

TESTS = Path(__file__).resolve().parents[1] / "tests"  # the fault-injecting worker methods
NAMED_WITHIN = 15.0  # issue 56's bound for a Python-level hang, quiet or beside the burners
FROZEN_NAMED_WITHIN = 60.0  # ... for a rank frozen in the kernel
CLOSED_WITHIN = 10.0  # ... for closing the group, whatever state its ranks are in
ASLEEP = {"kind": "sleep", "seconds": 3600.0}
RETRIES, RETRY_AFTER = 30, 10.0  # a group refused for want of host memory is asked again this often

# (kind in words, OnRank options, where: 'first call' | 'mid-sample' | 'load' | 'LoRA', workers)
PYTHON_HANGS: list[tuple[str, dict[str, Any], str, int]] = [
    *(
        (name, options, where, world)
        for name, options in (("asleep (time.sleep)", ASLEEP), ("on a lock", {"kind": "lock"}))
        for where in ("first call", "mid-sample", "load", "LoRA")
        for world in (2, 4)
    ),
    ("waiting for an event", {"kind": "block"}, "mid-sample", 2),
    ("waiting for an event", {"kind": "block"}, "mid-sample", 4),
    ("asleep beside a thread using 1/5 of a core", {**ASLEEP, "noise": 0.2}, "first call", 2),
    ("asleep beside a thread using 1/5 of a core", {**ASLEEP, "noise": 0.2}, "first call", 4),
]
# (kind in words, OnRank kind, the message's words after "worker rank 1 (cpu, pid N) ")
KERNEL_HANGS = [
    ("main thread in D, reports going on", "kernel", "has been in uninterruptible sleep (D)"),
    ("stopped (SIGSTOP)", "stop", "is stopped"),
    ("frozen by cgroup v1's freezer (D, SIGKILL held)", "freeze", "is frozen by its cgroup's freezer"),
    ("frozen by cgroup v2's cgroup.freeze", "freeze2", "is frozen by its cgroup's freezer"),
]

Row = dict[str, Any]
NOT_RUN: Row = {"error_s": float("nan"), "waited_s": float("nan"), "named": None, "close_s": float("nan")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--burners", type=int, default=4, help="busy processes beside the workers (default 4)"
    )
    parser.add_argument("--size", type=int, default=64, help="image side in pixels (default 64)")
    parser.add_argument("--steps", type=int, default=6, help="steps per job (default 6)")
    parser.add_argument("--json", help="also write the results to this JSON file")


def _tests() -> Any:
    """tests/worker_jobs.py and tests/freezers.py, imported here too (requests travel by name)."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    import freezers
    import worker_jobs

    return worker_jobs, freezers


def _group(world: int) -> WorkerGroup:
    return WorkerGroup(["cpu"] * world, threads=1, extra_sys_path=[str(TESTS)], methods=["worker_jobs"])


@contextlib.contextmanager
def _timed_closes() -> Iterator[list[float]]:
    """Seconds each `Workers.stop` took (the group's close inside the caller) while the block runs."""
    spans: list[float] = []
    stop = launch.Workers.stop

    def timed(self: launch.Workers, grace: float) -> None:
        started = time.monotonic()
        try:
            stop(self, grace)
        finally:
            spans.append(time.monotonic() - started)

    launch.Workers.stop = timed  # type: ignore[method-assign]
    try:
        yield spans
    finally:
        launch.Workers.stop = stop  # type: ignore[method-assign]


def _outcome(exc: BaseException | None, stamp: Path, raised: float, peers_done: float = 0.0) -> Row:
    """The row of one hang: seconds from the hang to the error, and from the moment a peer waited for the
    hung rank (in a load, which has no collective, that is when the last other rank answered: until then
    nobody waits for it, and the others' own reading is part of the first figure)."""
    hung_at = float(stamp.read_text()) if stamp.exists() else float("nan")
    message = "no error" if exc is None else f"{type(exc).__name__}: {exc}".splitlines()[0]
    return {
        "error_s": raised - hung_at,
        "waited_s": raised - max(hung_at, peers_done),
        "named": getattr(exc, "rank", None),
        "message": message,
    }


@contextlib.contextmanager
def _answers() -> Iterator[dict[int, float]]:
    """When each rank answered the jobs run in the block (the last answer per rank)."""
    answered: dict[int, float] = {}
    take = watch.Job._take

    def noted(job: watch.Job, rank: int, reply: Any) -> None:
        answered[rank] = time.monotonic()
        take(job, rank, reply)

    watch.Job._take = noted  # type: ignore[method-assign]
    try:
        yield answered
    finally:
        watch.Job._take = take  # type: ignore[method-assign]


def _python_hang(
    checkpoint: str,
    lora: str,
    job: dict[str, Any],
    options: dict[str, Any],
    where: str,
    world: int,
    folder: str,
) -> Row:
    worker_jobs, _ = _tests()
    stamp = Path(folder) / "hung"
    stamp.unlink(missing_ok=True)
    error: BaseException | None = None
    with ParallelModel(group=_group(world)) as flux:
        flux.load(checkpoint, layout="tp", dtype="float32")
        at = 1 if where == "first call" else 3
        fault = worker_jobs.OnRank(rank=1, at_step=at, stamp=str(stamp), **options)
        peers_done = 0.0
        try:
            if where in ("first call", "mid-sample"):
                flux.group.call("arm_failure", fault)
                flux.sample(job["positive"], job["latent"], seed=job["seed"], steps=job["steps"])
            else:
                if where == "load":
                    flux.unload()
                flux.group.call("arm_load_failure", fault)
                loras = [(lora, 0.5)] if where == "LoRA" else []
                with _answers() as answered:
                    try:
                        flux.load(checkpoint, layout="tp", dtype="float32", loras=loras)
                    finally:
                        peers_done = max((t for r, t in answered.items() if r != 1), default=0.0)
        except WorkerError as exc:
            error = exc
        raised = time.monotonic()
    return _outcome(error, stamp, raised, peers_done)


def _kernel_hang(kind: str, folder: str) -> Row:
    worker_jobs, freezers = _tests()
    version = {"freeze": 1, "freeze2": 2}.get(kind, 0)
    if version and (why := freezers.unusable(version)):
        return {**NOT_RUN, "message": f"not run: {why}"}
    stamp = Path(folder) / "hung"
    stamp.unlink(missing_ok=True)
    group = _group(2)
    error: BaseException | None = None
    with _timed_closes() as closes:
        try:
            group.call("hang_at", worker_jobs.OnRank(rank=1, at_step=3, kind=kind, stamp=str(stamp)))
        except WorkerError as exc:
            error = exc
        raised = time.monotonic()
    if version:
        freezers.thaw(version, group.pids[1])
    return {**_outcome(error, stamp, raised), "close_s": max(closes, default=float("nan"))}


def _close_frozen(version: int) -> Row:
    _, freezers = _tests()
    if why := freezers.unusable(version):
        return {**NOT_RUN, "message": f"not run: {why}"}
    group = _group(2)
    group.call("ping")
    try:
        freezers.freeze(version, group.pids[1])
        started = time.monotonic()
        group.close()
        closed = time.monotonic() - started
    finally:
        freezers.thaw(version, group.pids[1])
    return {**NOT_RUN, "message": "closed", "close_s": closed}


def run(args: argparse.Namespace) -> str:
    torch.set_num_threads(1)
    job = sampling_job(CONFIG, args.size, args.steps, seed=3)
    rows: list[Row] = []

    def measure(load: str, kind: str, where: str, world: int, fn: Callable[..., Row], *fn_args: Any) -> None:
        for attempt in range(RETRIES + 1):
            try:
                outcome = fn(*fn_args)
                break
            except ConfigError as exc:  # a shared machine short of memory for the workers just now
                outcome = {**NOT_RUN, "message": f"not run: {exc}"}
                if attempt < RETRIES:
                    time.sleep(RETRY_AFTER)
        row = {"load": load, "kind": kind, "where": where, "workers": world, **NOT_RUN, **outcome}
        rows.append(row)
        print(
            f"  {load}, {kind}, {where}, {world} workers: {row['error_s']:.1f} s from the hang, "
            f"{row['waited_s']:.1f} s from a peer's wait, rank {row['named']}, closing {row['close_s']:.1f} s",
            flush=True,
        )

    with tempfile.TemporaryDirectory(prefix="rocm-parallel-bench-") as folder:
        checkpoint = write_random_checkpoint(Path(folder) / "tiny-flux.safetensors", CONFIG)
        lora = write_random_lora(Path(folder) / "tiny-lora.safetensors", CONFIG, "bfl")
        for load, burners in (("quiet", 0), (f"{args.burners} burners", args.burners)):
            with burning(burners):
                for kind, options, where, world in PYTHON_HANGS:
                    measure(
                        load,
                        kind,
                        where,
                        world,
                        _python_hang,
                        checkpoint,
                        lora,
                        job,
                        options,
                        where,
                        world,
                        folder,
                    )
                for kind, name, _ in KERNEL_HANGS:
                    measure(load, kind, "mid-sample", 2, _kernel_hang, name, folder)
                for version in (1, 2):
                    measure(
                        load,
                        f"close(), rank 1 frozen (cgroup v{version}) between jobs",
                        "-",
                        2,
                        _close_frozen,
                        version,
                    )
    text = _table(rows, args)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "cores": os.cpu_count()}, indent=2))
    return text


def _table(rows: list[Row], args: argparse.Namespace) -> str:
    windows = DEFAULT_WATCHDOG
    lines = [
        f"### A hung rank named: tiny FLUX on CPU workers, rank 1 hangs, default watchdog (idle {windows.idle:g} s, "
        f"stopped {windows.stopped:g} s, uninterruptible {windows.uninterruptible:g} s), {os.cpu_count()} cores, "
        f"quiet and beside {args.burners} CPU burners",
        "",
        "| load | rank 1 | where | workers | from the hang (s) | from a peer's wait (s) | rank named | closing (s) "
        "| what the caller gets |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        message = r["message"] if len(r["message"]) <= 120 else r["message"][:117] + "..."
        named = "-" if r["named"] is None else str(r["named"])
        close = f"{r['close_s']:.1f}" if r.get("close_s", float("nan")) == r.get("close_s") else "-"
        error = f"{r['error_s']:.1f}" if r["error_s"] == r["error_s"] else "-"
        waited = f"{r['waited_s']:.1f}" if r.get("waited_s", float("nan")) == r.get("waited_s") else "-"
        lines.append(
            f"| {r['load']} | {r['kind']} | {r['where']} | {r['workers']} | {error} | {waited} | {named} | "
            f"{close} | `{message}` |"
        )
    lines += ["", *_summary(rows)]
    return "\n".join(lines)


def _summary(rows: list[Row]) -> list[str]:
    """One line per load: how many hangs named the right rank within the bound, and the slowest."""
    out = []
    for load in dict.fromkeys(r["load"] for r in rows):
        for label, bound, chosen in (
            ("Python-level hangs", NAMED_WITHIN, [r for r in rows if r["load"] == load and r["where"] in
                                                  ("first call", "mid-sample", "load", "LoRA")
                                                  and r["kind"] not in {k for k, _, _ in KERNEL_HANGS}]),
            ("kernel-level hangs", FROZEN_NAMED_WITHIN, [r for r in rows if r["load"] == load and r["kind"] in
                                                         {k for k, _, _ in KERNEL_HANGS}]),
        ):  # fmt: skip
            ran = [r for r in chosen if r["error_s"] == r["error_s"]]
            good = [r for r in ran if r["named"] == 1 and r["waited_s"] < bound]
            slowest = max((r["waited_s"] for r in ran), default=float("nan"))
            hung = max((r["error_s"] for r in ran), default=float("nan"))
            out.append(f"- {load}: {label}: {len(good)} of {len(ran)} named rank 1 within {bound:g} s of a "
                       f"peer's wait (slowest {slowest:.1f} s; {hung:.1f} s from the hang)")  # fmt: skip
        closes = [
            r["close_s"]
            for r in rows
            if r["load"] == load and r.get("close_s", float("nan")) == r.get("close_s")
        ]
        out.append(
            f"- {load}: closing took at most {max(closes, default=float('nan')):.1f} s (bound {CLOSED_WITHIN:g} s)"
        )
    return out
