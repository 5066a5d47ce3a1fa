"""`bench scaling`: a few sampling steps through `ParallelModel` on 1, 2, 4 workers of the devices present.

On this machine the workers are CPU processes (gloo), the model a scaled-down FLUX (random weights,
written as a BFL checkpoint to a temp dir, loaded the way users load theirs). Per configuration:
latency of the whole `sample` call, time per step (between the first and the last step's progress
report, so loading and the first step's warm-up stay out), peak memory per worker while sampling (GPU: the
worker's peak allocation; CPU: the worker process's peak RSS, VmHWM reset after loading, and its growth
over the RSS with the model loaded: the activations), and whether every worker did work (its CPU time grew). The planner's per-rank prediction for the
same model and size is printed next to the measured growth.

Writes the table, a JSON file and a PNG plot (time per step and peak memory per worker vs workers).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ..backend.config import ConfigError, ParallelLayout
from ..backend.flux.dims import FluxDims
from ..backend.plan import Setup, estimate
from ..backend.platforms import validate_devices
from ..backend.text import GB, MB
from ..testing.helpers import DEMO_CONFIG as CONFIG
from ..testing.helpers import write_random_checkpoint


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", default="1,2,4", help="worker counts (default 1,2,4)")
    parser.add_argument("--layouts", default="tp,ring,ulysses", help="layouts per count: tp, ring, ulysses")
    parser.add_argument("--size", type=int, default=512, help="square image side in pixels")
    parser.add_argument("--steps", type=int, default=3, help="sampling steps per configuration")
    parser.add_argument("--text-tokens", type=int, default=256)
    parser.add_argument(
        "--devices",
        default=None,
        help="the devices a count takes its workers from, first ones first: 'all', '0,1,2,3', "
        "'cuda:0,cuda:1' or 'cpu x4' (default: every GPU, else as many CPU workers as the largest count)",
    )
    parser.add_argument("--out", default="bench-scaling", help="prefix of the .json and .png written")


class Bar:
    """A one-line progress bar on stderr (no dependency)."""

    def __init__(self, total: int, width: int = 30) -> None:
        self.total, self.done, self.width, self.started = total, 0, width, time.perf_counter()

    def advance(self, label: str, n: int = 1) -> None:
        self.done += n
        filled = int(self.width * self.done / max(self.total, 1))
        elapsed = time.perf_counter() - self.started
        sys.stderr.write(
            f"\r[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} {elapsed:5.0f}s {label:<28}"
        )
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")


def _layout(kind: str, n: int) -> ParallelLayout:
    """'tp', 'ring' or 'ulysses' over all n workers."""
    name, ring, ulysses = {
        "tp": ("tp", None, None),
        "ring": ("context", n, None),
        "ulysses": ("context", None, n),
    }[kind]
    return ParallelLayout.make(name, n, ring, ulysses)


def _proc(pid: int) -> dict[str, int]:
    """Peak RSS (VmHWM), current RSS and CPU ticks of a worker process."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = {
        k: line.split()[1] for line in status.splitlines() for k in ("VmHWM", "VmRSS") if line.startswith(k)
    }
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return {
        "hwm": int(fields["VmHWM"]) * 1024,
        "rss": int(fields["VmRSS"]) * 1024,
        "cpu": int(stat[11]) + int(stat[12]),
    }


def _inputs(size: int, text_tokens: int, dims: FluxDims) -> tuple[list[Any], dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    cond = torch.randn(1, text_tokens, dims.text_dim, generator=g)
    positive = [[cond, {"pooled_output": torch.randn(1, dims.pooled_dim, generator=g), "guidance": 3.5}]]
    return positive, {"samples": torch.zeros(1, 16, size // 8, size // 8)}


def measure(flux: Any, checkpoint: str, layout: ParallelLayout, args: argparse.Namespace, bar: Bar) -> dict:
    from ..backend.diffusion.api import ParallelModel

    assert isinstance(flux, ParallelModel)
    dims = FluxDims.from_diffusers_config(CONFIG)
    gpu = flux.devices[0].startswith("cuda")
    flux.load(checkpoint, layout=layout, dtype=None if gpu else "float32")
    for pid in flux.group.pids:  # peak RSS from here on: sampling, not loading
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    before = [_proc(p) for p in flux.group.pids]
    positive, latent = _inputs(args.size, args.text_tokens, dims)
    stamps: list[float] = []

    def progress(step: int, total: int) -> None:
        stamps.append(time.perf_counter())
        bar.advance(f"{layout} step {step}/{total}")

    started = time.perf_counter()
    flux.sample(positive, latent, seed=0, steps=args.steps, progress=progress)
    latency = time.perf_counter() - started
    after = [_proc(p) for p in flux.group.pids]
    status = flux.status()
    per_step = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else latency
    if gpu:
        peaks = [(r.memory.peak_gb if r.memory else 0.0) * GB for r in status]
        growth = peaks
    else:
        peaks = [a["hwm"] for a in after]
        growth = [a["hwm"] - b["rss"] for a, b in zip(after, before, strict=True)]
    return {
        "workers": len(flux.devices),
        "layout": str(layout),
        "latency_s": latency,
        "step_s": per_step,
        "peak_bytes": max(peaks),
        "growth_bytes": max(growth),
        "all_active": all(a["cpu"] > b["cpu"] for a, b in zip(after, before, strict=True)),
        "parameter_bytes": status[0].parameter_bytes,
    }


def predicted(layout: ParallelLayout, args: argparse.Namespace, dtype: str) -> Any:
    dims = FluxDims.from_diffusers_config(CONFIG)
    setup = Setup(
        dims, args.size, args.size, 1, args.text_tokens, dtype=dtype, devices=layout.world_size, memory_gb=1e3
    )
    return estimate(setup, layout)


def _plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.6))
    kinds = sorted({r["layout"].split("=")[0] for r in rows if r["workers"] > 1})
    single = [r for r in rows if r["workers"] == 1]
    for kind in kinds:
        points = single + [r for r in rows if r["workers"] > 1 and r["layout"].startswith(kind)]
        xs = [r["workers"] for r in points]
        ax1.plot(xs, [r["step_s"] for r in points], marker="o", label=kind)
        ax2.plot(xs, [r["peak_bytes"] / MB for r in points], marker="o", label=kind)
    if single:
        xs = sorted({r["workers"] for r in rows})
        ax1.plot(xs, [single[0]["step_s"] / x for x in xs], "k:", label="ideal 1/N")
    ax1.set(xlabel="workers", ylabel="time per step (s)", xticks=sorted({r["workers"] for r in rows}))
    ax2.set(
        xlabel="workers", ylabel="peak memory per worker (MB)", xticks=sorted({r["workers"] for r in rows})
    )
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _devices(spec: str | None, most: int) -> tuple[str, ...]:
    """The devices the worker counts take from (the pack's one vocabulary), checked before any worker."""
    if spec is None:
        spec = "all" if torch.cuda.is_available() else f"cpu x{most}"
    devices = validate_devices(spec)
    if len(devices) < most:
        raise ConfigError(
            f"--workers asks for {most} workers but --devices {spec!r} names {len(devices)}; name at least "
            f"{most} devices or use smaller counts"
        )
    return devices


def run(args: argparse.Namespace) -> str:
    from ..backend.diffusion.api import ParallelModel

    counts = [int(n) for n in args.workers.split(",")]
    pool = _devices(args.devices, max(counts))
    gpu = pool[0].startswith("cuda")
    kinds = args.layouts.split(",")
    dims = FluxDims.from_diffusers_config(CONFIG)
    plans = []
    for n in counts:
        for kind in ["tp"] if n == 1 else kinds:
            layout = _layout(kind, n)
            try:
                layout.validate(dims, devices=n)
            except ConfigError as exc:
                print(f"  skipped {layout}: {exc}", file=sys.stderr)
                continue
            plans.append(layout)
    bar = Bar(len(plans) * args.steps)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = write_random_checkpoint(Path(folder) / "scaled-down-flux-dev.safetensors", CONFIG)
        for n in counts:
            devices = list(pool[:n])
            with ParallelModel(devices, threads=1) as flux:
                flux.group.call_all("ping")
                for layout in (p for p in plans if p.world_size == n):
                    row = measure(flux, checkpoint, layout, args, bar)
                    est = predicted(layout, args, "bfloat16" if gpu else "float32")
                    row["planned_bytes"] = est.per_gpu
                    row["planned_activations"] = est.activations
                    row["planned_weights"] = est.weights
                    rows.append(row)
                    flux.unload()
    bar.close()
    device = "GPU" if gpu else "CPU worker"
    title = (
        f"scaled-down FLUX ({dims.heads}x{dims.head_dim}, {dims.double_blocks}+{dims.single_blocks} blocks), "
        f"{args.size}x{args.size}, {args.steps} steps, {device}s, {'bf16' if gpu else 'fp32'}"
    )
    base = next((r["step_s"] for r in rows if r["workers"] == 1), None)
    lines = [
        title,
        "",
        f"| configuration | latency (s) | time per step (s) | speed-up | peak memory per {device} (MB) | "
        "growth while sampling (MB) | planned activations (MB) | weights held = planned (MB) | all active |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        speed = f"{base / r['step_s']:.2f}x" if base else "-"
        lines.append(
            f"| {r['workers']} x {r['layout']} | {r['latency_s']:.2f} | {r['step_s']:.3f} | {speed} | "
            f"{r['peak_bytes'] / MB:.0f} | {r['growth_bytes'] / MB:.0f} | {r['planned_activations'] / MB:.0f} | "
            f"{'yes' if r['parameter_bytes'] == r['planned_weights'] else 'NO'} ({r['planned_weights'] / MB:.0f}) | "
            f"{'yes' if r['all_active'] else 'no'} |"
        )
    table = "\n".join(lines)
    print(table)
    with open(f"{args.out}.json", "w") as f:
        json.dump({"title": title, "rows": rows}, f, indent=2)
    if importlib.util.find_spec("matplotlib") is None:  # the plot is extra: the table and JSON are the result
        print(f"\nwrote {args.out}.json (no plot: matplotlib is not installed; pip install matplotlib)")
    else:
        _plot(rows, f"{args.out}.png", title)
        print(f"\nwrote {args.out}.json and {args.out}.png")
    return table
