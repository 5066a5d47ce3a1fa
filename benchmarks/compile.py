"""`bench compile`: eager against compiled repeated blocks (backend/compile.py), per step, in one run.

For each layout one CPU worker group loads a small FLUX eager, times `--steps` model calls (after two
warm-up calls), then loads it again with `compile='inductor'`, times the first call (dynamo's tracing and
inductor's code generation on every rank: reported apart) and the same `--steps` calls. Both halves run in
the same worker processes on the same inputs, one after the other, and the outputs are compared. Each step
changes sigma, as a sampler does, so a recompile per step would show in the compiled column.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ..backend.config import ParallelLayout
from ..backend.diffusion.api import ParallelModel
from ..testing.helpers import markdown_table, write_random_checkpoint
from ..testing.models import tiny_flux_config

# Wider than the test model so the blocks' compute, not the service, is what a step costs on a CPU.
CONFIG = tiny_flux_config(heads=8, head_dim=32, double_blocks=2, single_blocks=4, text_dim=64, pooled_dim=32)
TEXT_TOKENS = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=10, help="measured steps per configuration (default 10)")
    parser.add_argument("--size", type=int, default=512, help="image side in pixels (default 512)")
    parser.add_argument("--layouts", default="1,tp 2", help="comma-separated layouts (default '1,tp 2')")
    parser.add_argument("--json", help="also write the results to this JSON file")


def step_inputs(size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    side = size // 8
    return {
        "x": torch.randn(1, 16, side, side, generator=g),
        "context": torch.randn(1, TEXT_TOKENS, CONFIG["joint_attention_dim"], generator=g),
        "y": torch.randn(1, CONFIG["pooled_projection_dim"], generator=g),
        "guidance": torch.tensor([3.5]),
    }


def _median_ms(times: list[float]) -> float:
    return sorted(times)[len(times) // 2] * 1e3


def _steps(
    flux: ParallelModel, inputs: dict[str, torch.Tensor], steps: int
) -> tuple[list[float], list[torch.Tensor]]:
    times, outs = [], []
    for i in range(steps):
        sigma = torch.tensor([1.0 - i / steps])
        started = time.perf_counter()
        outs.append(flux.forward(timestep=sigma, **inputs))
        times.append(time.perf_counter() - started)
    return times, outs


def measure(
    checkpoint: str, layout: ParallelLayout, inputs: dict[str, torch.Tensor], steps: int
) -> dict[str, Any]:
    with ParallelModel(["cpu"] * layout.world_size, threads=1) as flux:
        flux.load(checkpoint, layout=layout, dtype="float32")
        _steps(flux, inputs, 2)  # warm-up: the conditioning is sent, the allocator settles
        eager, eager_out = _steps(flux, inputs, steps)
        flux.load(checkpoint, layout=layout, dtype="float32", compile="inductor")
        started = time.perf_counter()
        flux.forward(timestep=torch.tensor([1.0]), **inputs)
        first = time.perf_counter() - started
        _steps(flux, inputs, 1)
        compiled, compiled_out = _steps(flux, inputs, steps)
        compiles = flux.compiles
    worst = max((a - b).abs().max().item() for a, b in zip(eager_out, compiled_out, strict=True))
    return {
        "eager_ms": _median_ms(eager),
        "compiled_ms": _median_ms(compiled),
        "first_call_s": first,
        "compiling_calls": len(compiles),
        "max_abs_diff": worst,
    }


def run(args: argparse.Namespace) -> str:
    torch.set_num_threads(1)
    inputs = step_inputs(args.size)
    layouts = [
        ParallelLayout() if s.strip() == "1" else ParallelLayout.parse(s.strip())
        for s in args.layouts.split(",")
    ]
    rows = {}
    with tempfile.TemporaryDirectory(prefix="rocm-parallel-bench-") as folder:
        checkpoint = str(Path(folder) / "small-flux.safetensors")
        write_random_checkpoint(checkpoint, CONFIG)
        for layout in layouts:
            rows[str(layout)] = measure(checkpoint, layout, inputs, args.steps)
            print(f"  measured {layout}", flush=True)
    header = (
        "workers (layout)", "eager step (ms)", "compiled step (ms)", "compiled / eager", "first compiled call (s)",
        "calls that compiled", "max abs diff",
    )  # fmt: skip
    table = [
        (
            f"{layout.world_size} ({layout})" if layout.world_size > 1 else "1 (no split)",
            f"{r['eager_ms']:.1f}",
            f"{r['compiled_ms']:.1f}",
            f"{r['compiled_ms'] / r['eager_ms']:.2f}",
            f"{r['first_call_s']:.1f}",
            str(r["compiling_calls"]),
            f"{r['max_abs_diff']:.1e}",
        )
        for layout, r in zip(layouts, rows.values(), strict=True)
    ]
    side = args.size // 16
    text = (
        f"### Compiled blocks (inductor) against eager: small FLUX (8 heads x 32, 2 double + 4 single blocks), "
        f"{args.size}x{args.size} px ({side * side} image tokens), {TEXT_TOKENS} text tokens, batch 1, float32, "
        f"CPU workers with 1 thread each, medians of {args.steps} steps (sigma changes every step)\n\n"
        + markdown_table(header, table)
    )
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return text
