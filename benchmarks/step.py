"""`bench step`: what one ComfyUI-driven step costs on top of the model itself.

ComfyUI's samplers call the model once per step (twice with CFG unless batched, twice per step for
heun): each call is one `ParallelModel.forward` request to every rank. This measures that call
against the same `flux_call` in this one process, on a 1024x1024 latent (4096 image tokens) with a
512-token prompt whose tensors are rebuilt for every step, as ComfyUI does (the service must recognise
them by content and not send them again). Both sides run one thread and are interleaved, so they see
the same machine load. The "service" column is the round trip minus the forward the ranks timed
themselves: requests, the latent and the output through shared memory, the conditioning lookup, replies.
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
from ..backend.flux.forward import flux_call
from ..backend.flux.model import build_flux
from ..backend.flux.sampling import diffusers_model_fn
from ..testing.helpers import markdown_table, write_random_checkpoint
from ..testing.models import tiny_flux_config

# A small transformer with FLUX.1's real conditioning widths (T5-XXL 4096, CLIP-L 768), so the prompt a
# step must recognise is as large as a real one (8.4 MB at 512 tokens in float32).
CONFIG = tiny_flux_config(heads=4, head_dim=16, text_dim=4096, pooled_dim=768)
TEXT_TOKENS = 512


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=30, help="measured steps per configuration (default 30)")
    parser.add_argument("--size", type=int, default=1024, help="image side in pixels (default 1024)")
    parser.add_argument("--json", help="also write the results to this JSON file")


def step_inputs(size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    side = size // 8
    return {
        "x": torch.randn(1, 16, side, side, generator=g),
        "timestep": torch.tensor([0.5]),
        "context": torch.randn(1, TEXT_TOKENS, CONFIG["joint_attention_dim"], generator=g),
        "y": torch.randn(1, CONFIG["pooled_projection_dim"], generator=g),
        "guidance": torch.tensor([3.5]),
    }


def _median_ms(times: list[float]) -> float:
    return sorted(times)[len(times) // 2] * 1e3


def measure(
    checkpoint: str, layout: ParallelLayout, inputs: dict[str, torch.Tensor], steps: int
) -> dict[str, Any]:
    model_fn = diffusers_model_fn(build_flux(CONFIG, seed=0))
    local, driven, ranks = [], [], []
    with ParallelModel(["cpu"] * layout.world_size, threads=1) as flux, torch.no_grad():
        flux.load(checkpoint, layout=layout, dtype="float32")
        for i in range(steps + 2):  # two warm-up steps (the first sends the conditioning)
            fresh = {k: v.clone() for k, v in inputs.items()}  # ComfyUI builds new tensors each step
            started = time.perf_counter()
            flux_call(
                model_fn, fresh["x"], fresh["timestep"], fresh["context"], fresh["y"], fresh["guidance"]
            )
            one = time.perf_counter() - started
            started = time.perf_counter()
            flux.forward(**fresh)
            both = time.perf_counter() - started
            if i >= 2:
                local.append(one)
                driven.append(both)
                ranks.append(flux.last_forward_seconds)
        sent = flux.conditioning_bytes_sent
    return {
        "one_process_ms": _median_ms(local),
        "driven_ms": _median_ms(driven),
        "ranks_forward_ms": _median_ms(ranks),
        "service_ms": _median_ms([d - r for d, r in zip(driven, ranks, strict=True)]),
        "conditioning_sent_mb": sent / 1e6,
    }


def _row(layout: ParallelLayout, r: dict[str, Any]) -> tuple[str, ...]:
    name = f"{layout.world_size} ({layout})" if layout.world_size > 1 else "1 (no split)"
    return (
        name,
        f"{r['driven_ms']:.1f}",
        f"{r['one_process_ms']:.1f}",
        f"{r['ranks_forward_ms']:.1f}",
        f"{r['service_ms']:.2f}",
        f"{r['driven_ms'] - r['one_process_ms']:+.1f}",
        f"{r['conditioning_sent_mb']:.3f}",
    )


def run(args: argparse.Namespace) -> str:
    torch.set_num_threads(1)
    inputs = step_inputs(args.size)
    latent_mb = inputs["x"].numel() * 4 / 1e6
    cond_mb = (inputs["context"].numel() + inputs["y"].numel()) * 4 / 1e6
    layouts = [ParallelLayout(), ParallelLayout(tp=2), ParallelLayout(ring=2)]
    rows = {}
    with tempfile.TemporaryDirectory(prefix="rocm-parallel-bench-") as folder:
        checkpoint = str(Path(folder) / "tiny-flux.safetensors")
        write_random_checkpoint(checkpoint, CONFIG)
        for layout in layouts:
            rows[str(layout)] = measure(checkpoint, layout, inputs, args.steps)
            print(f"  measured {layout}", flush=True)
    header = (
        "workers (layout)", "step driven (ms)", "same forward, 1 process (ms)", "forward on the ranks (ms)",
        "service overhead (ms)", "driven - 1 process (ms)", "conditioning sent (MB)",
    )  # fmt: skip
    table = [_row(layout, r) for layout, r in zip(layouts, rows.values(), strict=True)]
    text = (
        f"### One ComfyUI-driven step: tiny FLUX, {args.size}x{args.size} px ({latent_mb:.2f} MB latent, "
        f"{(args.size // 16) ** 2} image tokens), {TEXT_TOKENS}-token prompt ({cond_mb:.2f} MB, rebuilt every "
        f"step), 1 thread per process, medians of {args.steps} steps interleaved with the same forward in "
        "one process\n\n" + markdown_table(header, table)
    )
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return text
