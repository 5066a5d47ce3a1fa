"""Context-parallel benchmark: per-GPU activation memory, bytes moved and one-rank compute per layout.

Everything is per *one transformer forward* (one denoising step without CFG).

* Collectives and bytes: diffusers' context parallelism runs on the meta device under the `fake` process
  group, so the collectives of the real code path are counted (`CountCollectives`), not derived.
  "Sent per GPU" applies ring-algorithm factors per group: all-to-all (u-1)/u inside a Ulysses group,
  the K/V all-gather (r-1)/r inside a ring group, the output all-gather (N-1)/N over all N devices.
* Activation memory: torch's `MemTracker` on the same meta forward: the peak of live activation
  tensors on one rank (weights excluded; kernel workspaces excluded: the CPU flash kernel stands in for
  the GPU one, with the same outputs).
* Compute: one rank's forward on this CPU under the `fake` group (collectives are no-ops), on a
  scaled-down FLUX (the demo's 8 heads x 64, 2 double + 4 single blocks) against the same model on one
  process. It shows how the work divides, not GPU speed.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from ..backend.config import ParallelLayout
from ..backend.flux.dims import FluxDims
from ..backend.flux.model import FLUX_DEV, build_flux
from ..backend.text import GB
from ..testing.fake import fake_process_group
from ..testing.helpers import DEMO_CONFIG, median_seconds
from ..testing.meta import measure_on_meta
from ..testing.models import random_inputs
from ..testing.parallel import apply_context_parallel

LAYOUTS = ["2x1", "1x2", "4x1", "1x4", "2x2", "8x1", "1x8", "2x4", "4x2"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="ring x ulysses, comma-separated")
    parser.add_argument("--sizes", default="1024,2048", help="square image sides in pixels (FLUX.1-dev rows)")
    parser.add_argument("--text-tokens", type=int, default=512, help="T5 tokens (512 for dev)")
    parser.add_argument("--compute-size", type=int, default=512, help="image side for the compute rows")
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="timed forwards per compute row after a warm-up; the median is kept",
    )
    parser.add_argument("--no-compute", action="store_true", help="skip the CPU compute rows")


def _layouts(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in item.split("x")) for item in text.split(",")]  # type: ignore[misc]


def _gb(n: float) -> str:
    return f"{n / GB:.2f}"


def measure_forward(ring: int, ulysses: int, size: int, text_tokens: int) -> dict[str, Any]:
    """One FLUX.1-dev bf16 forward of rank 0 on the meta device: collectives and peak activations."""
    world = ring * ulysses
    traced = measure_on_meta(FLUX_DEV, ParallelLayout(ring=ring, ulysses=ulysses), size, size, 1, text_tokens)
    log = traced["log"]
    image_tokens = traced["image_tokens"]
    output_gather = (
        image_tokens * FluxDims.from_diffusers_config(FLUX_DEV).in_channels * 2
    )  # bf16 [1, S_img, 64]
    sent = log.payload_bytes["all_to_all"] * (ulysses - 1) / ulysses
    sent += (log.payload_bytes["all_gather"] - output_gather) * (ring - 1) / ring
    sent += output_gather * (world - 1) / world
    return {
        "counts": traced["counts"],
        "payload": sum(log.payload_bytes.values()),
        "sent": sent,
        "activations": traced["activations"],
        "tokens": image_tokens + text_tokens,
    }


def time_one_rank(ring: int, ulysses: int, size: int, repeats: int) -> float:
    dims = FluxDims.from_diffusers_config(DEMO_CONFIG)
    kwargs = random_inputs(dims, height=size, width=size, text_tokens=256).as_kwargs()
    with torch.no_grad():
        if ring * ulysses == 1:
            model = build_flux(DEMO_CONFIG, seed=0)
            return median_seconds(lambda: model(**kwargs), repeats)
        with fake_process_group(ring * ulysses, rank=0):
            model = apply_context_parallel(build_flux(DEMO_CONFIG, seed=0), ring, ulysses)
            return median_seconds(lambda: model(**kwargs), repeats)


def _collectives(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))


def run(args: argparse.Namespace) -> str:
    torch.set_flush_denormal(True)  # the fake group's all-gathers return uninitialised memory
    layouts = _layouts(args.layouts)
    lines = [
        "FLUX.1-dev, bf16, one transformer forward, rank 0 (collectives counted on the meta device under "
        "the fake process group; activation peak from MemTracker, weights excluded)",
        "",
        "| image | tokens | ring x ulysses | GPUs | collectives per forward | payload (GB) "
        "| sent per GPU (GB) | peak activations per GPU (GB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for size in (int(s) for s in args.sizes.split(",")):
        for ring, ulysses in layouts:
            m = measure_forward(ring, ulysses, size, args.text_tokens)
            lines.append(
                f"| {size}x{size} | {m['tokens']} | {ring} x {ulysses} | {ring * ulysses} | "
                f"{_collectives(m['counts'])} | {_gb(m['payload'])} | {_gb(m['sent'])} | "
                f"{_gb(m['activations'])} |"
            )
            print(lines[-1], flush=True)
    if not args.no_compute:
        dims = FluxDims.from_diffusers_config(DEMO_CONFIG)
        tokens = (args.compute_size // 16) ** 2 + 256
        lines += [
            "",
            f"One rank's compute, CPU, float32, scaled-down FLUX ({dims.heads} heads x {dims.head_dim}, "
            f"{dims.double_blocks} double + {dims.single_blocks} single blocks), {args.compute_size}x"
            f"{args.compute_size} = {tokens} tokens, fake process group (no communication), "
            f"{torch.get_num_threads()} thread(s)",
            "",
            "| ring x ulysses | GPUs | forward (ms, median) | vs 1 device |",
            "|---|---|---|---|",
        ]
        base = time_one_rank(1, 1, args.compute_size, args.repeats)
        lines.append(f"| 1 x 1 | 1 | {base * 1e3:.0f} | 1.00 |")
        for ring, ulysses in layouts:
            t = time_one_rank(ring, ulysses, args.compute_size, args.repeats)
            lines.append(f"| {ring} x {ulysses} | {ring * ulysses} | {t * 1e3:.0f} | {t / base:.2f} |")
            print(lines[-1], flush=True)
    table = "\n".join(lines)
    print("\n" + table)
    return table
