"""`bench failures`: what a user waits for when one rank fails, and whether the next job is right.

Each scenario samples a tiny FLUX on 2 CPU workers (TP=2) through the public API with the default
watchdog, injects one fault on rank 1 in the middle of a job, and measures the time from the fault to
the error the caller gets; then it runs the next job and checks it against the image sampled before
the fault (bit for bit: same workers count, same layout, same seed).

Faults come from the test suite's worker methods (tests/worker_jobs.py: `arm_failure`, which fails a
rank's forward in the given step, and `hang_at`), so a checkout is needed, as for every benchmark. A
hung rank (alive, silent) is caught by the watchdog's `floor` once steps are fast, so its row shows
that limit.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch

from ..backend.api import ParallelFlux
from ..backend.client import DEFAULT_WATCHDOG, WorkerGroup
from ..testing.helpers import TINY_CONFIG as CONFIG
from ..testing.helpers import sampling_job, write_random_checkpoint

TESTS = Path(__file__).resolve().parents[1] / "tests"  # the fault-injecting worker methods
FAULT_STEP = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", type=int, default=128, help="image side in pixels (default 128)")
    parser.add_argument("--steps", type=int, default=8, help="steps per job (default 8)")
    parser.add_argument("--json", help="also write the results to this JSON file")


def _fault_methods() -> Any:
    """tests/worker_jobs.py, imported here too: its requests travel by name, so this process must know them."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    import worker_jobs

    return worker_jobs


def _group() -> WorkerGroup:
    return WorkerGroup(["cpu", "cpu"], threads=1, extra_sys_path=[str(TESTS)], methods=["worker_jobs"])


def _sample(
    flux: ParallelFlux, job: dict[str, Any], progress: Callable[[int, int], None] | None = None
) -> Any:
    return flux.sample(
        job["positive"], job["latent"], seed=job["seed"], steps=job["steps"], progress=progress
    )


def _scenario(
    checkpoint: str, job: dict[str, Any], expected: torch.Tensor, inject: Callable[[ParallelFlux], None]
) -> dict[str, Any]:
    """Arm the fault (`inject` runs before the job; it may also return a progress hook), time the error."""
    with ParallelFlux(group=_group()) as flux:
        flux.load(checkpoint, layout="tp", dtype="float32")
        hook = inject(flux)
        marks: dict[str, float] = {}

        def progress(step: int, total: int) -> None:
            if step == FAULT_STEP - 1:
                marks["fault"] = time.perf_counter()  # the fault happens in the next step
            if hook is not None:
                hook(step, total)

        try:
            _sample(flux, job, progress)
            message = "no error"
        except BaseException as exc:  # KeyboardInterrupt too: that is one of the scenarios
            message = f"{type(exc).__name__}: {exc}".splitlines()[0]
        error_s = time.perf_counter() - marks.get("fault", time.perf_counter())
        started = time.perf_counter()
        out = _sample(flux, job)["samples"]
        return {
            "message": message,
            "error_s": error_s,
            "next_s": time.perf_counter() - started,
            "next_correct": bool(torch.equal(out, expected)),
        }


def _arm(kind: str) -> Callable[[ParallelFlux], None]:
    def inject(flux: ParallelFlux) -> None:
        flux.group.call("arm_failure", _fault_methods().OnRank(rank=1, at_step=FAULT_STEP, kind=kind))

    return inject


def _kill_at_fault(flux: ParallelFlux) -> Callable[[int, int], None]:
    victim = flux.group.pids[1]

    def hook(step: int, total: int) -> None:
        if step == FAULT_STEP - 1:
            os.kill(victim, signal.SIGKILL)

    return hook


def _cancel_at_fault(flux: ParallelFlux) -> Callable[[int, int], None]:
    def hook(step: int, total: int) -> None:
        if step == FAULT_STEP - 1:
            raise InterruptedError("user pressed Cancel")

    return hook


def _ctrl_c_at_fault(flux: ParallelFlux) -> Callable[[int, int], None]:
    def hook(step: int, total: int) -> None:
        if step == FAULT_STEP - 1:
            raise KeyboardInterrupt

    return hook


def _hang() -> dict[str, Any]:
    """A rank alive but silent (stuck in a driver call): only the watchdog can tell."""
    group, jobs = _group(), _fault_methods()
    started = time.perf_counter()
    try:
        group.call("steps", jobs.Steps(n=4, seconds=0.05))
        started = time.perf_counter()
        group.call("hang_at", jobs.OnRank(rank=1, at_step=FAULT_STEP))
        message = "no error"
    except BaseException as exc:
        message = f"{type(exc).__name__}: {exc}".splitlines()[0]
    error_s = time.perf_counter() - started
    gone = not any(
        psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in group.pids
    )
    group.close()
    return {"message": message, "error_s": error_s, "next_s": float("nan"), "next_correct": gone}


def _exit_without_close() -> dict[str, Any]:
    script = (
        "import time; from rocm_parallel.backend.client import WorkerGroup\n"
        "g = WorkerGroup(['cpu', 'cpu'], threads=1)\n"
        "print(*g.pids, flush=True); print(time.perf_counter(), flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    ended = time.perf_counter()
    pids_line, t_line = done.stdout.split("\n")[:2]
    pids = [int(p) for p in pids_line.split()]
    gone = not any(psutil.pid_exists(p) for p in pids)
    return {
        "message": f"exit code {done.returncode}",
        "error_s": ended - float(t_line),  # perf_counter is system-wide on Linux (CLOCK_MONOTONIC)
        "next_s": float("nan"),
        "next_correct": gone,
    }


SCENARIOS: dict[str, tuple[str, Callable[..., Any]]] = {
    "one rank out of memory mid-step (its peer waits in an all-reduce)": ("oom", _arm("oom")),
    "one rank stopped (SIGSTOP) mid-step": ("stop", _arm("stop")),
    "one rank killed (SIGKILL) mid-job": ("kill", _kill_at_fault),
    "user's Cancel (progress callback raises)": ("cancel", _cancel_at_fault),
    "Ctrl+C while waiting (KeyboardInterrupt)": ("ctrl_c", _ctrl_c_at_fault),
}


def run(args: argparse.Namespace) -> str:
    torch.set_num_threads(1)
    job = sampling_job(CONFIG, args.size, args.steps, seed=3)
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="rocm-parallel-bench-") as folder:
        checkpoint = write_random_checkpoint(Path(folder) / "tiny-flux.safetensors", CONFIG)
        with ParallelFlux(group=_group()) as flux:
            flux.load(checkpoint, layout="tp", dtype="float32")
            expected = _sample(flux, job)["samples"]
        for name, (_, inject) in SCENARIOS.items():
            rows[name] = _scenario(checkpoint, job, expected, inject)
            print(f"  measured: {name}", flush=True)
    rows[f"one rank hung, alive and silent (watchdog floor {DEFAULT_WATCHDOG.floor:g} s)"] = _hang()
    rows["caller exits without close()"] = _exit_without_close()
    lines = [
        f"### One rank fails: tiny FLUX on 2 CPU workers (TP=2), {args.size}x{args.size} px, {args.steps} steps, "
        f"fault on rank 1 in step {FAULT_STEP}, default watchdog",
        "",
        "| scenario | what the caller gets | time to error (s) | next job | next job (s) |",
        "|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        if r["next_s"] == r["next_s"]:  # not NaN: a next job ran
            verdict = "same image" if r["next_correct"] else "WRONG image"
        else:
            verdict = "workers gone" if r["next_correct"] else "WORKERS LEFT"
        message = r["message"] if len(r["message"]) <= 110 else r["message"][:107] + "..."
        next_s = f"{r['next_s']:.2f}" if r["next_s"] == r["next_s"] else "-"
        lines.append(f"| {name} | `{message}` | {r['error_s']:.2f} | {verdict} | {next_s} |")
    text = "\n".join(lines)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return text
