"""The main job on an embedded default: a built-in random FLUX split across the devices present.

With two or more GPUs it uses them all; otherwise two CPU worker processes over gloo. It prints what
ran where and how long, and checks the parallel result against a single-process forward.
"""

from __future__ import annotations

import argparse
import time

import torch

from .client import WorkerGroup
from .config import FluxDims
from .flux.model import build_flux, random_inputs, tiny_flux_config

# Every code path of FLUX.1 at a size a laptop CPU runs in a second: 8 heads x 64, 2 + 4 blocks.
DEMO_CONFIG = tiny_flux_config(
    heads=8, head_dim=64, double_blocks=2, single_blocks=4, text_dim=256, pooled_dim=64
)


def default_devices() -> list[str]:
    gpus = torch.cuda.device_count()
    return [f"cuda:{i}" for i in range(gpus)] if gpus >= 2 else ["cpu", "cpu"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--devices", help="comma-separated, e.g. cuda:0,cuda:1 or cpu,cpu (default: all GPUs, else 2 CPU)"
    )
    parser.add_argument("--size", type=int, default=256, help="image side in pixels (multiple of 16)")
    parser.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (GPU default)")
    parser.add_argument("--repeats", type=int, default=3, help="timed forwards after one warm-up")


def _line(*cells: object) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def run(args: argparse.Namespace) -> int:
    devices = args.devices.split(",") if args.devices else default_devices()
    on_gpu = devices[0].startswith("cuda")
    dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    dims = FluxDims.from_diffusers_config(DEMO_CONFIG)
    inputs = random_inputs(dims, height=args.size, width=args.size, text_tokens=64)
    print(
        f"FLUX demo: {dims.heads} heads x {dims.head_dim}, {dims.double_blocks} double + {dims.single_blocks} "
        f"single blocks, {args.size}x{args.size} px = {inputs.hidden_states.shape[1]} image + 64 text tokens, {dtype}"
    )

    started = time.perf_counter()
    threads = 1 if not on_gpu else None
    with WorkerGroup(devices, threads=threads) as group:
        print(f"started {group.world_size} workers in {time.perf_counter() - started:.2f} s")
        built = group.call_all("build_random", config=DEMO_CONFIG, seed=0, dtype=dtype, tp=group.world_size)
        ran = group.call_all("forward", inputs=inputs.as_kwargs(), repeats=args.repeats)
        pids = group.pids

    print(f"\ntensor parallel over {len(devices)} devices (TP={len(devices)}):")
    print(_line("rank", "device", "pid", "parameters (MB)", "build (s)", "forward (ms)"))
    print(_line(*["---"] * 6))
    for rank, (b, r) in enumerate(zip(built, ran, strict=True)):
        print(
            _line(
                rank,
                devices[rank],
                pids[rank],
                f"{b['parameter_bytes'] / 1e6:.2f}",
                f"{b['seconds']:.2f}",
                f"{r['seconds'] * 1e3:.1f}",
            )
        )

    torch.set_num_threads(1)
    model = build_flux(DEMO_CONFIG, seed=0, dtype=getattr(torch, dtype))
    with torch.inference_mode():
        kwargs = inputs.to("cpu", getattr(torch, dtype)).as_kwargs()
        t0 = time.perf_counter()
        expected = model(**kwargs, return_dict=False)[0]
        single = time.perf_counter() - t0
    diff = (ran[0]["output"] - expected.float()).abs().max().item()
    full_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
    print(f"\nsingle process on cpu: {full_mb:.2f} MB of parameters, forward {single * 1e3:.1f} ms")
    tolerance = 1e-4 if dtype == "float32" else 5e-2
    verdict = "OK" if diff <= tolerance else "MISMATCH"
    print(f"parallel vs single-process output: max |diff| = {diff:.2e} (tolerance {tolerance:.0e}) {verdict}")
    return 0 if verdict == "OK" else 1
