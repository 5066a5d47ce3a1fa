"""`bench group`: what the persistent worker group costs — start-up, first vs warm job, per-job overhead.

The overhead of a job is measured against the same model and the same sampling in this one process:
both run one thread, one step per job on a small latent, so the difference is the group's own cost
(each step is one forward request: the latent through a tensor file, the conditioning sent once per
prompt, the reply). A one-worker group isolates it from any parallel speed-up; two workers (TP=2) are
shown for reference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ..backend.diffusion.api import ParallelModel
from ..backend.flux.model import build_flux
from ..backend.flux.sampling import diffusers_model_fn, sample_flux
from ..testing.helpers import TINY_CONFIG as CONFIG
from ..testing.helpers import sampling_job, write_random_checkpoint


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--jobs", type=int, default=30, help="warm jobs per configuration (default 30)")
    parser.add_argument("--size", type=int, default=128, help="image side in pixels (default 128)")
    parser.add_argument("--json", help="also write the results to this JSON file")


def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def local_job(model_fn: Any, job: dict[str, Any]) -> float:
    started = time.perf_counter()
    sample_flux(model_fn, job["latent"]["samples"], job["positive"], seed=job["seed"], steps=job["steps"])
    return time.perf_counter() - started


def in_group(checkpoint: str, devices: list[str], job: dict[str, Any], jobs: int) -> dict[str, float]:
    """Start, load, first job; then warm jobs interleaved with the same job in this process.

    Interleaving makes both sides see the same machine load, so their difference is the group's cost.
    """
    model_fn = diffusers_model_fn(build_flux(CONFIG, seed=0))
    local_job(model_fn, job)  # warm-up
    t0 = time.perf_counter()
    with ParallelModel(devices, threads=1) as flux:
        flux.start()
        t1 = time.perf_counter()
        flux.load(checkpoint, layout="tp", dtype="float32")
        t2 = time.perf_counter()
        flux.sample(job["positive"], job["latent"], seed=job["seed"], steps=job["steps"])
        t3 = time.perf_counter()
        local, warm, pings = [], [], []
        for _ in range(jobs):
            local.append(local_job(model_fn, job))
            started = time.perf_counter()
            flux.sample(job["positive"], job["latent"], seed=job["seed"], steps=job["steps"])
            warm.append(time.perf_counter() - started)
            started = time.perf_counter()
            flux.group.call("ping")
            pings.append(time.perf_counter() - started)
    return {
        "start_s": t1 - t0,
        "load_s": t2 - t1,
        "first_job_ms": (t3 - t2) * 1e3,
        "one_process_ms": _median_ms(local),
        "warm_job_ms": _median_ms(warm),
        "ping_ms": _median_ms(pings),
    }


def run(args: argparse.Namespace) -> str:
    torch.set_num_threads(1)
    job = sampling_job(CONFIG, args.size, steps=1, seed=1)
    latent_kb = job["latent"]["samples"].numel() * 4 / 1024
    rows = {}
    with tempfile.TemporaryDirectory(prefix="rocm-parallel-bench-") as folder:
        checkpoint = str(Path(folder) / "tiny-flux.safetensors")
        write_random_checkpoint(checkpoint, CONFIG)
        for n in (1, 2):
            rows[n] = in_group(checkpoint, ["cpu"] * n, job, args.jobs)
            print(f"  measured a group of {n}", flush=True)
    lines = [
        f"### Worker group overhead: tiny FLUX, {args.size}x{args.size} px ({latent_kb:.0f} KiB latent), "
        f"1 step per job, 1 thread per process, medians of {args.jobs} warm jobs, each interleaved with the "
        "same job in one process",
        "",
        "| configuration | start (s) | load (s) | first job (ms) | warm job (ms) | same job in 1 process (ms) "
        "| overhead (ms) | ping (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, r in rows.items():
        lines.append(
            f"| group of {n} CPU worker{'s' if n > 1 else ''} (TP={n}) | {r['start_s']:.2f} | {r['load_s']:.2f} | "
            f"{r['first_job_ms']:.0f} | {r['warm_job_ms']:.1f} | {r['one_process_ms']:.1f} | "
            f"{r['warm_job_ms'] - r['one_process_ms']:+.1f} | {r['ping_ms']:.2f} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return text
