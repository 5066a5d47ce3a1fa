"""`bench failures`: what a user waits for when one rank fails or hangs, whether the right rank is named,
whether the next job is right, and that a slow but healthy rank is waited for.

Each scenario samples a tiny FLUX on 2 CPU workers (TP=2) through the public API with the default
watchdog (liveness.py: no clock, a rank is hung when it is stopped, does no work while its peers wait for
it, or waits in a collective that cannot complete), injects one fault on rank 1, and measures the time from the fault to
the error the caller gets; then it runs the next job and checks it against the image sampled before the
fault (bit for bit: same workers count, same layout, same seed).

Faults come from the test suite's worker methods (tests/worker_jobs.py: `arm_failure`, which makes a
rank's forward in the given step run out of memory, SIGSTOP itself, hang in a native call that keeps the
interpreter, block in Python, or work longer; `arm_load_failure` the same at a tensor of the next load or LoRA change), so
a checkout is needed, as for every benchmark. The last table measures what the NaN/inf check of every
tensor read at load costs against the read itself.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch

from ..backend.checkpoint import load as load_module
from ..backend.checkpoint import load_model
from ..backend.diffusion.api import ParallelModel
from ..backend.runtime.client import WorkerGroup
from ..testing.helpers import TINY_CONFIG as CONFIG
from ..testing.helpers import sampling_job, write_random_checkpoint
from ..testing.writers import write_random_lora

TESTS = Path(__file__).resolve().parents[1] / "tests"  # the fault-injecting worker methods
FAULT_STEP = 3
SLOW_STEP_S = 10.0  # the slow-but-healthy step: many times the others
SLOW_READ_S = 20.0  # the slow-but-healthy tensor read (a network share)

Row = dict[str, Any]


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
    flux: ParallelModel, job: dict[str, Any], progress: Callable[[int, int], None] | None = None
) -> Any:
    return flux.sample(
        job["positive"], job["latent"], seed=job["seed"], steps=job["steps"], progress=progress
    )


def _outcome(exc: BaseException | None) -> tuple[str, int | None]:
    if exc is None:
        return "no error", None
    return f"{type(exc).__name__}: {exc}".splitlines()[0], getattr(exc, "rank", None)


def _row(message: str, error_s: float, named: int | None, next_s: float, next_ok: bool) -> Row:
    return {"message": message, "error_s": error_s, "named": named, "next_s": next_s, "next_correct": next_ok}


def _sampling(
    checkpoint: str,
    job: dict[str, Any],
    expected: torch.Tensor,
    inject: Callable[[ParallelModel], Any],
    at: int,
) -> Row:
    """Arm the fault (`inject` runs before the job; it may return a progress hook) for step `at` of the next
    job, and time the error from the start of that step."""
    with ParallelModel(group=_group()) as flux:
        flux.load(checkpoint, layout="tp", dtype="float32")
        hook = inject(flux)
        marks: dict[str, float] = {}

        def progress(step: int, total: int) -> None:
            if step == at - 1:
                marks["fault"] = time.perf_counter()  # the fault happens in the next step
            if hook is not None:
                hook(step, total)

        error: BaseException | None = None
        marks["fault"] = time.perf_counter()  # step 1: from the start of the job
        try:
            _sample(flux, job, progress)
        except BaseException as exc:  # KeyboardInterrupt too: that is one of the scenarios
            error = exc
        error_s = time.perf_counter() - marks["fault"]
        started = time.perf_counter()
        out = _sample(flux, job)["samples"]
        return _row(*_outcome(error)[:1], error_s, _outcome(error)[1], time.perf_counter() - started,
                    bool(torch.equal(out, expected)))  # fmt: skip


def _arm(kind: str, at: int = FAULT_STEP, seconds: float = 0.0) -> Callable[[ParallelModel], None]:
    def inject(flux: ParallelModel) -> None:
        flux.group.call(
            "arm_failure", _fault_methods().OnRank(rank=1, at_step=at, kind=kind, seconds=seconds)
        )

    return inject


def _kill_at_fault(flux: ParallelModel) -> Callable[[int, int], None]:
    victim = flux.group.pids[1]

    def hook(step: int, total: int) -> None:
        if step == FAULT_STEP - 1:
            os.kill(victim, signal.SIGKILL)

    return hook


def _raise_at_fault(error: type[BaseException]) -> Callable[[ParallelModel], Callable[[int, int], None]]:
    def inject(flux: ParallelModel) -> Callable[[int, int], None]:
        def hook(step: int, total: int) -> None:
            if step == FAULT_STEP - 1:
                raise error("user pressed Cancel") if error is InterruptedError else error()

        return hook

    return inject


def _loading(
    checkpoint: str, job: dict[str, Any], expected: torch.Tensor, kind: str, seconds: float = 0.0,
    lora: str | None = None,
) -> Row:  # fmt: skip
    """A fault at tensor 3 of the next load (with `lora`: of the LoRA change on the resident model)."""
    at = 3
    with ParallelModel(group=_group()) as flux:
        flux.load(checkpoint, layout="tp", dtype="float32")
        if lora is None:
            flux.unload()
        flux.group.call(
            "arm_load_failure", _fault_methods().OnRank(rank=1, at_step=at, kind=kind, seconds=seconds)
        )
        marks = {"fault": time.perf_counter()}

        def progress(done: int, total: int) -> None:
            if done == at - 1:
                marks["fault"] = time.perf_counter()

        error: BaseException | None = None
        loras = [(lora, 0.5)] if lora else []
        try:
            flux.load(checkpoint, layout="tp", dtype="float32", loras=loras, progress=progress)
        except BaseException as exc:
            error = exc
        error_s = time.perf_counter() - marks["fault"]
        started = time.perf_counter()
        flux.load(checkpoint, layout="tp", dtype="float32")
        out = _sample(flux, job)["samples"]
        message, named = _outcome(error)
        return _row(message, error_s, named, time.perf_counter() - started, bool(torch.equal(out, expected)))


def _stop_at_start() -> Row:
    """SIGSTOP rank 1 as soon as it exists (it imports torch then, long before it connects)."""
    stopped: list[float] = []

    def watch() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not stopped:
            for child in psutil.Process().children():
                try:
                    if child.environ().get("RP_RANK") == "1":
                        child.send_signal(signal.SIGSTOP)
                        stopped.append(time.perf_counter())
                        return
                except psutil.Error:
                    continue
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    before = psutil.Process().children()
    error: BaseException | None = None
    try:
        _group().close()
    except BaseException as exc:
        error = exc
    ended = time.perf_counter()
    watcher.join()
    gone = not [c for c in psutil.Process().children() if c not in before]
    message, named = _outcome(error)
    return _row(message, ended - stopped[0], named, float("nan"), gone)


def _exit_without_close() -> Row:
    script = (
        "import time; from rocm_parallel.backend.runtime.client import WorkerGroup\n"
        "g = WorkerGroup(['cpu', 'cpu'], threads=1)\n"
        "print(*g.pids, flush=True); print(time.perf_counter(), flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    ended = time.perf_counter()
    pids_line, t_line = done.stdout.split("\n")[:2]
    pids = [int(p) for p in pids_line.split()]
    gone = not any(psutil.pid_exists(p) for p in pids)
    # perf_counter is system-wide on Linux (CLOCK_MONOTONIC)
    return _row(f"exit code {done.returncode}", ended - float(t_line), None, float("nan"), gone)


def _value_check_cost(folder: str, repeats: int = 5) -> list[list[str]]:
    """Loading a 0.4 GB bf16 checkpoint in one process (TP=1, CPU, one thread) with the NaN/inf check of
    every tensor read and without it, alternately (the file in the page cache after a warm-up): the median
    of each, and the time spent inside the check itself during the checked loads (what the check costs
    whatever else the machine does meanwhile)."""
    from ..backend.checkpoint import save_checkpoint
    from ..backend.flux.model import build_flux

    config = {**CONFIG, "num_attention_heads": 8, "attention_head_dim": 128, "joint_attention_dim": 4096,
              "num_layers": 3, "num_single_layers": 6}  # fmt: skip
    path = Path(folder) / "checkpoint-bf16.safetensors"
    save_checkpoint(build_flux(config, dtype=torch.bfloat16, seed=0), path)
    size = path.stat().st_size
    inside: list[float] = []
    check = load_module.check_values

    def timed_check(*args: Any) -> None:
        started = time.perf_counter()
        check(*args)
        inside.append(time.perf_counter() - started)

    times: dict[bool, list[float]] = {False: [], True: []}
    load_module.check_values = timed_check
    try:
        load_model(str(path), dtype="bfloat16")  # warm-up: the page cache, torch's kernels
        warm = len(inside)
        for _ in range(repeats):
            for on in (False, True):
                load_module.CHECK_VALUES = on
                started = time.perf_counter()
                load_model(str(path), dtype="bfloat16")
                times[on].append(time.perf_counter() - started)
    finally:
        load_module.CHECK_VALUES, load_module.check_values = True, check
    off, on = (sorted(times[k])[repeats // 2] for k in (False, True))
    in_check = sum(inside[warm:]) / repeats  # per checked load
    mib = f"{size / 2**20:.0f}"
    return [
        ["off", mib, f"{off:.2f}", f"{size / 2**30 / off:.2f}", "-"],
        [
            "on",
            mib,
            f"{on:.2f}",
            f"{size / 2**30 / on:.2f}",
            f"{in_check:.2f} ({in_check / on:.0%} of the load)",
        ],
    ]


def run(args: argparse.Namespace) -> str:
    torch.set_num_threads(1)
    job = sampling_job(CONFIG, args.size, args.steps, seed=3)
    rows: dict[str, Row] = {}

    def measure(name: str, fn: Callable[[], Row]) -> None:
        rows[name] = fn()
        print(f"  measured: {name}: {rows[name]['error_s']:.2f} s", flush=True)

    with tempfile.TemporaryDirectory(prefix="rocm-parallel-bench-") as folder:
        checkpoint = write_random_checkpoint(Path(folder) / "tiny-flux.safetensors", CONFIG)
        lora = write_random_lora(Path(folder) / "tiny-lora.safetensors", CONFIG, "bfl")
        with ParallelModel(group=_group()) as flux:
            flux.load(checkpoint, layout="tp", dtype="float32")
            expected = _sample(flux, job)["samples"]
        sampled = lambda inject, at=FAULT_STEP: lambda: _sampling(checkpoint, job, expected, inject, at)  # noqa: E731
        measure("one rank out of memory mid-step (its peer waits in an all-reduce)", sampled(_arm("oom")))
        measure("one rank stopped (SIGSTOP) mid-step", sampled(_arm("stop")))
        measure("one rank killed (SIGKILL) mid-job", sampled(_kill_at_fault))
        measure(
            "one rank hung in a native call, first model call after a load", sampled(_arm("native", 1), 1)
        )
        measure("one rank hung in a native call, mid-sample (step 3)", sampled(_arm("native")))
        measure("one rank blocked in Python (its reports go on), mid-sample (step 3)", sampled(_arm("block")))
        measure("one rank hung in a native call while loading (tensor 3)",
                lambda: _loading(checkpoint, job, expected, "native"))  # fmt: skip
        measure("one rank hung in a native call during a LoRA change (tensor 3)",
                lambda: _loading(checkpoint, job, expected, "native", lora=lora))  # fmt: skip
        measure("one rank stopped (SIGSTOP) at start-up, before it connects", _stop_at_start)
        measure(f"healthy: one step {SLOW_STEP_S:g} s slower on rank 1 (step 3)",
                sampled(_arm("slow", FAULT_STEP, SLOW_STEP_S)))  # fmt: skip
        measure(f"healthy: one tensor read taking {SLOW_READ_S:g} s on rank 1 (tensor 3)",
                lambda: _loading(checkpoint, job, expected, "slow", SLOW_READ_S))  # fmt: skip
        measure("user's Cancel (progress callback raises)", sampled(_raise_at_fault(InterruptedError)))
        measure("Ctrl+C while waiting (KeyboardInterrupt)", sampled(_raise_at_fault(KeyboardInterrupt)))
        measure("caller exits without close()", _exit_without_close)
        cost = _value_check_cost(folder)
    text = _table(rows, args, cost)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "value_check": cost}, indent=2))
    return text


def _table(rows: dict[str, Row], args: argparse.Namespace, cost: list[list[str]]) -> str:
    lines = [
        f"### One rank fails or hangs: tiny FLUX on 2 CPU workers (TP=2), {args.size}x{args.size} px, "
        f"{args.steps} steps, fault on rank 1, default watchdog",
        "",
        "| scenario | what the caller gets | time to error (s) | rank named | next job | next job (s) |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        if r["next_s"] == r["next_s"]:  # not NaN: a next job ran
            verdict = "same image" if r["next_correct"] else "WRONG image"
        else:
            verdict = "workers gone" if r["next_correct"] else "WORKERS LEFT"
        message = r["message"] if len(r["message"]) <= 150 else r["message"][:147] + "..."
        if name.startswith("healthy"):
            message = "completed" if r["message"] == "no error" else message
        next_s = f"{r['next_s']:.2f}" if r["next_s"] == r["next_s"] else "-"
        named = "-" if r["named"] is None else str(r["named"])
        lines.append(f"| {name} | `{message}` | {r['error_s']:.2f} | {named} | {verdict} | {next_s} |")
    lines += [
        "",
        "### The NaN/inf check of every tensor read at load: one process, TP=1, CPU, one thread, bf16",
        "",
        "| check | checkpoint (MiB) | load (s, median of 5, alternating) | GiB/s | inside the check (s) |",
        "|---|---|---|---|---|",
        *(f"| {' | '.join(row)} |" for row in cost),
    ]
    return "\n".join(lines)
