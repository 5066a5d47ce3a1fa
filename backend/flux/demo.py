"""The main job on an embedded default: a full FLUX sampling run split across the devices present.

A built-in random FLUX is written as a BFL/ComfyUI single-file checkpoint (the format users keep in
models/diffusion_models/), loaded by the worker group in each layout (tensor parallel, then ring
attention), sampled exactly like ComfyUI's KSampler(euler, simple), and checked against the same
sampling in this one process. With two or more GPUs it uses them all; otherwise two CPU workers.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..checkpoint import save_checkpoint
from ..config import ConfigError
from ..diffusion.api import ParallelModel
from ..runtime.client import validate_devices
from ..text import MB, markdown_table
from .dims import FluxDims
from .keys import rope_axes
from .model import FLUX_DEV, build_flux
from .sampling import diffusers_model_fn, sample_flux

# Every code path of FLUX.1 at a size a laptop CPU runs in a second: 8 heads x 64, 2 + 4 blocks.
DEMO_CONFIG = {
    **FLUX_DEV,
    "num_layers": 2,
    "num_single_layers": 4,
    "attention_head_dim": 64,
    "num_attention_heads": 8,
    "joint_attention_dim": 256,
    "pooled_projection_dim": 64,
    "axes_dims_rope": rope_axes(64),
}
TEXT_TOKENS = 64
LAYOUTS = ("tp", "context")  # ring / Ulysses degrees: the context layout's, filled by the group


def default_devices() -> list[str]:
    """All GPUs when there are two or more (one GPU would show no parallelism), else two CPU workers:
    the demo runs anywhere (the API's and the nodes' 'all' refuse a machine without GPUs instead)."""
    gpus = torch.cuda.device_count()
    return [f"cuda:{i}" for i in range(gpus)] if gpus >= 2 else ["cpu", "cpu"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--devices",
        help="'all', '0,1', 'cuda:0,cuda:1' or 'cpu x2' (default: all GPUs when 2 or more, else 'cpu x2')",
    )
    parser.add_argument(
        "--size", type=int, default=256, help="image side in pixels (multiple of 16; default 256)"
    )
    parser.add_argument("--steps", type=int, default=4, help="denoising steps (default 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layouts", default="tp,context", help="layouts to run: tp, context (default both)")


def _layouts(text: str) -> list[str]:
    """'tp,context' -> ['tp', 'context']; anything else is refused before anything runs (cli: one line)."""
    layouts = [part.strip() for part in text.split(",")]
    wrong = [layout for layout in layouts if layout not in LAYOUTS]
    if wrong or not layouts:
        raise ConfigError(
            f"--layouts {text!r}: {wrong[0] if wrong else text!r} is not a demo layout; use {' or '.join(LAYOUTS)}, or both: 'tp,context'"
        )
    return layouts


def _progress(label: str) -> Callable[[int, int], None]:
    def show(step: int, total: int) -> None:
        bar = "#" * int(20 * step / total)
        sys.stderr.write(f"\r  {label:<8} [{bar:<20}] step {step}/{total}")
        if step == total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return show


def run(args: argparse.Namespace) -> int:
    layouts = _layouts(args.layouts)
    devices = validate_devices(args.devices) if args.devices else default_devices()
    on_gpu = devices[0].startswith("cuda")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    dims = FluxDims.from_diffusers_config(DEMO_CONFIG)
    tokens = (args.size // 16) ** 2
    print(
        f"FLUX demo: random FLUX.1-dev-shaped model ({dims.heads} heads x {dims.head_dim}, {dims.double_blocks} "
        f"double + {dims.single_blocks} single blocks), {args.size}x{args.size} px = {tokens} image + "
        f"{TEXT_TOKENS} text tokens, {args.steps} euler/simple steps, {str(dtype).removeprefix('torch.')}"
    )
    g = torch.Generator().manual_seed(args.seed)
    positive = [[torch.randn(1, TEXT_TOKENS, dims.text_dim, generator=g),
                 {"pooled_output": torch.randn(1, dims.pooled_dim, generator=g), "guidance": 3.5}]]  # fmt: skip
    latent = {"samples": torch.zeros(1, 16, args.size // 8, args.size // 8)}  # EmptySD3LatentImage
    job = {"seed": args.seed, "steps": args.steps}

    model = build_flux(DEMO_CONFIG, seed=args.seed)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    started = time.perf_counter()
    expected = sample_flux(diffusers_model_fn(model), latent["samples"], positive, **job)
    single = time.perf_counter() - started
    print(f"single process on cpu: {single:.2f} s ({single / args.steps * 1e3:.0f} ms/step)")

    rows, ok = [], True
    with tempfile.TemporaryDirectory(prefix="rocm-parallel-demo-") as folder:
        checkpoint = Path(folder) / "demo-flux-dev.safetensors"
        save_checkpoint(torch.nn.Module.to(model, dtype), checkpoint)
        del model
        started = time.perf_counter()
        with ParallelModel(devices, threads=1 if not on_gpu else None) as flux:
            flux.start()  # now, to time it apart from loading
            print(
                f"started {len(devices)} workers on {', '.join(devices)} in {time.perf_counter() - started:.2f} s "
                f"(pids {' '.join(map(str, flux.group.pids))})"
            )
            for layout in layouts:
                t0 = time.perf_counter()
                reports = flux.load(checkpoint, layout=layout, dtype=str(dtype).removeprefix("torch."))
                t1 = time.perf_counter()
                out = flux.sample(positive, latent, **job, progress=_progress(layout))
                t2 = time.perf_counter()
                diff = (out["samples"] - expected).abs().max().item()
                tolerance = 1e-4 if dtype == torch.float32 else 0.1
                ok &= diff <= tolerance
                rows.append([f"{layout} ({flux.resident.layout})",
                             f"{reports[0].parameter_bytes / MB:.1f}", f"{t1 - t0:.2f}", f"{t2 - t1:.2f}",
                             f"{(t2 - t1) / args.steps * 1e3:.0f}", f"{diff:.1e} (<= {tolerance:g})"])  # fmt: skip

    print()
    header = ["layout", "MB/rank", "load (s)", "sample (s)", "ms/step", "max |diff| vs 1 process"]
    print(markdown_table(header, rows, align=" --- "))
    print("\nOK: every layout reproduced the single-process image" if ok else "\nMISMATCH")
    return 0 if ok else 1
