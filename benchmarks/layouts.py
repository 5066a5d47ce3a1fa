"""`bench layouts`: the planner's choice among every composition (batch x tp x ring x ulysses) for FLUX.1-dev
and FLUX.2 [dev] on 2, 4 and 8 GPUs of 16, 24 and 48 GB over PCIe, and its ranking held against a
published measurement: cache-dit's FLUX.2 [dev] table on 8 x NVIDIA L20 (48 GB, PCIe).

No device and no worker: the planner alone (backend/plan/), on the shapes of the families' meta models.
Its figures are predictions of the simple cost model (compute / devices + bytes / link + latency per
collective, nothing overlapped); the published times are cache-dit's, quoted, not measured here.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..backend.cli import plan_models
from ..backend.config import ConfigError, ParallelLayout
from ..backend.plan import PCIE4, Link, Setup, call_batch, choose, estimate, plan
from ..backend.text import GB, markdown_table

# cache-dit docs/user_guide/HYBRID_PARALLEL.md (vipshop/cache-dit, read 2026-11): FLUX.2-dev, 1024x1024, 28
# steps (its examples' flux2 defaults, guidance 4: one image per model call), 8 x L20 48 GB on PCIe; the
# text encoder parallelised over the same GPUs. Seconds per image (None: out of memory), GiB per GPU.
CACHE_DIT = [
    ("TP-2", "tp 2", None, None),
    ("Ring-2/4/8", "ring 8", None, None),
    ("Ulysses-2/4/8", "ulysses 8", None, None),
    ("TP-4", "tp 4", 27.72, 32.40),
    ("TP-8", "tp 8", 21.37, 19.92),
    ("Ulysses-4-TP-2", "tp 2 x ulysses 4", 15.21, 41.85),
    ("Ulysses-2-TP-4", "tp 4 x ulysses 2", 17.98, 27.23),
    ("Ring-4-TP-2", "tp 2 x ring 4", 17.37, 41.85),
    ("Ring-2-TP-4", "tp 4 x ring 2", 17.13, 27.23),
    ("USP-2-2-TP-2", "tp 2 x ring 2 x ulysses 2", 16.06, 41.85),
]
CACHE_DIT_STEPS = 28
L20_TFLOPS = 119.5  # NVIDIA L20 dense bf16 tensor throughput (datasheet)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="flux1-dev,flux2-dev", help="plan --model names, comma-separated")
    parser.add_argument(
        "--gpus",
        default="2,4,8",
        help="GPU counts to price, comma-separated (GPUs like --memory's; they need not be here)",
    )
    parser.add_argument("--memory", default="16,24,48", help="GB per GPU")
    parser.add_argument("--size", type=int, default=1024, help="square image side in pixels")
    parser.add_argument("--cfg", default="1,2.5", help="cfg values (not 1: cond and uncond share a call)")
    parser.add_argument("--tflops", type=float, default=100.0, help="sustained TFLOPS of one GPU (table)")
    parser.add_argument(
        "--l20-efficiency",
        type=float,
        default=0.7,
        help="share of the L20's 119.5 TFLOPS sustained (cache-dit)",
    )


def _setup(model: str, devices: int, memory: float, size: int, batch: int, tflops: float) -> Setup:
    family, config = plan_models()[model]
    return Setup(
        family.dims(config), size, size, batch=batch, text_tokens=family.text.tokens, devices=devices,
        memory_gb=memory, link=PCIE4, tflops=tflops, family=family.name,
    )  # fmt: skip


def planner_table(args: argparse.Namespace) -> str:
    rows = []
    for model in args.models.split(","):
        for cfg in (float(c) for c in args.cfg.split(",")):
            batch = call_batch(1, cfg)
            for devices in (int(d) for d in args.gpus.split(",")):
                for memory in (float(m) for m in args.memory.split(",")):
                    rows.append(
                        _row(_setup(model, devices, memory, args.size, batch, args.tflops), model, cfg)
                    )
    header = ["model", "cfg (call batch)", "GPUs x GB", "layouts that fit", "choice", "predicted s/step",
              "per GPU (GB)", "next best"]  # fmt: skip
    return markdown_table(header, rows, ["---", "---", "---", "---", "---", "---:", "---:", "---"])


def _row(setup: Setup, model: str, cfg: float) -> list[str]:
    estimates = plan(setup)
    fits = [e for e in estimates if e.fits]
    where = f"{setup.devices} x {setup.memory_gb:g}"
    if not fits:
        return [model, f"{cfg:g} ({setup.batch})", where, f"none of {len(estimates)}", "-", "-", "-", "-"]
    best = choose(setup)
    chosen = fits[0]
    runner_up = f"{fits[1].name} ({fits[1].step_s:.2f})" if len(fits) > 1 else "-"
    return [model, f"{cfg:g} ({setup.batch})", where, f"{len(fits)} of {len(estimates)}", str(best.layout),
            f"{chosen.step_s:.2f}", f"{chosen.per_gpu / GB:.1f}", runner_up]  # fmt: skip


def cache_dit_comparison(args: argparse.Namespace) -> tuple[str, list[dict[str, Any]]]:
    """Each of cache-dit's layouts priced on its own GPU count (TP-4 ran on 4 of the 8), 48 GB each."""
    tflops = L20_TFLOPS * args.l20_efficiency
    rows, data = [], []
    for name, ours, seconds, gib in CACHE_DIT:
        layout = ParallelLayout.parse(ours)
        setup = _setup("flux2-dev", layout.world_size, 48.0, 1024, 1, tflops)
        try:
            e = estimate(setup, layout)
        except ConfigError as exc:  # a layout the engine refuses
            rows.append([name, ours, "-", "-", "-", "-", str(exc)])
            continue
        image = e.step_s * CACHE_DIT_STEPS
        data.append({"name": name, "ours": ours, "measured": seconds, "predicted": image, "fits": e.fits})
        measured = "OOM" if seconds is None else f"{seconds:.2f}"
        memory = "OOM" if gib is None else f"{gib * 2**30 / GB:.1f}"
        rows.append([name, ours, measured, memory, f"{e.per_gpu / GB:.1f}" + ("" if e.fits else " (no fit)"),
                     f"{image:.2f}", f"{e.compute_s * CACHE_DIT_STEPS:.2f} + {e.comm_s * CACHE_DIT_STEPS:.2f}"])  # fmt: skip
    header = ["cache-dit", "layout here", "cache-dit s/image", "cache-dit GB/GPU", "planner GB/GPU",
              f"planner s/image ({CACHE_DIT_STEPS} steps)", "compute + comm (s)"]  # fmt: skip
    return markdown_table(header, rows, ["---", "---", "---:", "---:", "---:", "---:", "---:"]), data


def _ranks(data: list[dict[str, Any]]) -> str:
    timed = [d for d in data if d["measured"] is not None]
    measured = [d["name"] for d in sorted(timed, key=lambda d: d["measured"])]
    predicted = [d["name"] for d in sorted(timed, key=lambda d: d["predicted"])]
    swaps = [
        (a, b)
        for i, a in enumerate(measured)
        for b in measured[i + 1 :]
        if predicted.index(a) > predicted.index(b)
    ]
    lines = [
        "measured order:  " + " < ".join(measured),
        "predicted order: " + " < ".join(predicted),
        f"pairs in another order: {len(swaps)} of {len(timed) * (len(timed) - 1) // 2}"
        + (": " + ", ".join(f"{a} / {b}" for a, b in swaps) if swaps else ""),
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> str:
    head = (
        f"Planner, bf16 weights, {args.size}x{args.size}, PCIe ({PCIE4.describe()}, {PCIE4.latency_us:g} µs "
        f"per collective), {args.tflops:g} TFLOPS per GPU; call batch = images x 2 at cfg != 1"
    )
    table = planner_table(args)
    link = Link(PCIE4.gbps, PCIE4.latency_us, name=PCIE4.name)
    comparison, data = cache_dit_comparison(args)
    tail = (
        f"FLUX.2 [dev] 1024x1024, {CACHE_DIT_STEPS} steps, call batch 1, 48 GB GPUs, {link.describe()}, "
        f"{L20_TFLOPS * args.l20_efficiency:.1f} TFLOPS (L20 {L20_TFLOPS:g} x {args.l20_efficiency:g})"
    )
    out = f"{head}\n\n{table}\n\n{tail}\n\n{comparison}\n\n{_ranks(data)}"
    print(out)
    return out
