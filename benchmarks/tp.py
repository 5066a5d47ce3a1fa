"""`bench tp`: tensor parallelism per rank — parameter bytes, collectives per forward, compute time.

Everything here measures *one rank* of a larger world in one process with the `fake` process group:
sizes come from the meta device (FLUX.1-dev, bf16), collectives are counted at dispatch level during a
meta forward at the chosen resolution, and compute time is one rank's forward on the device present
(collectives are no-ops, so this is pure compute). Our plan is shown side by side with diffusers' own
`_tp_plan` (applied with torch's parallelize_module, bypassing only diffusers' device-type check).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..backend.config import ParallelLayout
from ..backend.family import ModelFamily, families
from ..backend.flux.dims import FluxDims
from ..backend.flux.model import FLUX_DEV, build_flux
from ..backend.text import GB, MB
from ..testing.fake import fake_process_group
from ..testing.helpers import markdown_table, median_seconds
from ..testing.meta import measure_on_meta
from ..testing.models import random_inputs, tiny_flux_config
from ..testing.parallel import apply_tensor_parallel

# What a CPU can time in seconds: FLUX.1's structure with 24 heads x 32 (hidden 768), 2 + 4 blocks.
CPU_CONFIG = tiny_flux_config(
    heads=24, head_dim=32, double_blocks=2, single_blocks=4, text_dim=512, pooled_dim=128
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--degrees", default="1,2,4,8", help="TP degrees to report (default 1,2,4,8)")
    parser.add_argument(
        "--size", type=int, default=1024, help="image side in pixels for collectives (default 1024)"
    )
    parser.add_argument(
        "--device", default=None, help="device for the compute timing (default: cuda if present)"
    )
    parser.add_argument(
        "--compute-size", type=int, default=None, help="image side for the timing (CPU 512, GPU 1024)"
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed forwards per degree after a warm-up; the median is kept"
    )
    parser.add_argument(
        "--model",
        choices=tuple(presets()),
        default="flux1-dev",
        help="flux1-dev: sizes, collectives and compute; other models (e.g. FLUX.2's): sizes (bf16 and "
        "fp8-resident) and collectives on the meta device",
    )
    parser.add_argument("--json", help="also write the rows to this JSON file")


# ---------------------------------------------------------------------------------------------- plans


def ours(model: nn.Module) -> nn.Module:
    return apply_tensor_parallel(model)


def diffusers_plan(model: nn.Module) -> nn.Module:
    """diffusers' `_tp_plan` (AdaLN replicated, one all-reduce per row-parallel linear) via DTensor."""
    import torch.distributed as dist
    from diffusers.hooks.tensor_parallel import _resolve_tp_plan, _styles
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    device = next(model.parameters()).device.type
    mesh = init_device_mesh("cpu" if device == "meta" else device, (dist.get_world_size(),))
    for block, plan in _resolve_tp_plan(model, model._tp_plan):
        parallelize_module(block, mesh, _styles(plan))
    return model


PLANS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "rocm-parallel": ours,
    "diffusers _tp_plan": diffusers_plan,
}


# ---------------------------------------------------------------------------------------------- measures


def sizes_and_collectives(plan: str, degree: int, size: int) -> dict[str, Any]:
    traced = measure_on_meta(
        FLUX_DEV,
        ParallelLayout(tp=degree),
        size,
        size,
        text_tokens=512,
        parallelize=PLANS[plan],
        memory=False,
    )
    log = traced["log"]
    return {
        "plan": plan,
        "degree": degree,
        "param_gb": traced["weights"] / GB,
        "all_reduce": log.counts["all_reduce"],
        "all_gather": log.counts["all_gather"],
        "payload_mb": sum(log.payload_bytes.values()) / MB,
        "wire_mb_per_rank": log.wire_bytes_per_rank(degree) / MB,
    }


def _materialize(model: nn.Module, device: torch.device, seed: int = 0) -> nn.Module:
    """Random weights for a meta (possibly sharded) model, straight on `device`: no full-size copy."""
    from torch.distributed.tensor import DTensor

    model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            local.normal_(0, 0.02, generator=g)
    return model


def compute_time(
    plan: str,
    degree: int,
    config: dict[str, Any],
    size: int,
    device: torch.device,
    dtype: torch.dtype,
    repeats: int,
    text_tokens: int | None = None,
) -> float:
    """Median seconds of one rank's forward under the fake group (no-op collectives): its compute alone.

    `text_tokens` defaults to 512 at 1024 px and up, else 128; a caller comparing against its own inputs
    passes its own count, or the compute it subtracts is a different forward's.
    """
    if text_tokens is None:
        text_tokens = 512 if size >= 1024 else 128
    dims = FluxDims.from_diffusers_config(config)
    with fake_process_group(degree):
        model = build_flux(config, device="meta", dtype=dtype)
        if degree > 1:
            PLANS[plan](model)
        _materialize(model, device)
        kwargs = random_inputs(dims, height=size, width=size, text_tokens=text_tokens)
        kwargs = kwargs.to(device, dtype).as_kwargs()
        with torch.inference_mode():
            return median_seconds(lambda: model(**kwargs), repeats, device)


# ---------------------------------------------------------------------------------------------- any model


def presets() -> dict[str, tuple[ModelFamily, dict[str, Any]]]:
    """The released models of every family, by the names `plan --model` uses."""
    return {name: (f, dict(config)) for f in families() for name, config in f.presets.items()}


def meta_sizes_and_collectives(
    family: ModelFamily, config: dict[str, Any], plan: str, degree: int, size: int
) -> dict[str, Any]:
    """One rank of TP=`degree` on the meta device under the fake group: bytes and one forward's collectives.

    fp8-resident bytes: the same rule as the fp8 work's loader and planner: linear (2-D) weights stay fp8
    at 1 byte and are upcast per layer; norm scales (1-D) stay in the compute dtype.
    """
    traced = measure_on_meta(
        config,
        ParallelLayout(tp=degree),
        size,
        size,
        text_tokens=512,
        parallelize=PLANS[plan],
        memory=False,
        family=family.name,
    )
    log = traced["log"]
    return {
        "plan": plan,
        "degree": degree,
        "bf16_gb": traced["weights"] / GB,
        "fp8_gb": (traced["linear_elements"] + 2 * traced["other_elements"]) / GB,
        "all_reduce": log.counts["all_reduce"],
        "all_gather": log.counts["all_gather"],
        "payload_mb": sum(log.payload_bytes.values()) / MB,
        "wire_mb_per_rank": log.wire_bytes_per_rank(degree) / MB,
    }


def run_sizes(args: argparse.Namespace) -> str:
    family, config = presets()[args.model]
    degrees = [int(d) for d in args.degrees.split(",")]
    rows = []
    for degree in degrees:
        for plan in PLANS if degree > 1 else list(PLANS)[:1]:
            rows.append(meta_sizes_and_collectives(family, config, plan, degree, args.size))
            print(f"  measured {plan} at TP={degree}", flush=True)
    dims = family.dims(config)
    tokens = (args.size // 16) ** 2
    out = [
        f"### Tensor parallelism: {args.model} ({dims.heads} heads x {dims.head_dim}, {dims.double_blocks}+"
        f"{dims.single_blocks} blocks), {args.size}x{args.size} ({tokens} image + 512 text tokens)",
        "",
        "Per rank, one transformer forward, on the meta device under the fake process group. fp8-resident:",
        "every linear weight at 1 byte, norm scales bf16. Payloads in bf16; wire MB assume ring algorithms.",
        "",
        markdown_table(
            [
                "TP",
                "plan",
                "bf16/rank (GB)",
                "fp8/rank (GB)",
                "all-reduces",
                "all-gathers",
                "payload (MB)",
                "sent/rank (MB)",
            ],
            [
                [
                    r["degree"],
                    r["plan"] if r["degree"] > 1 else "(one device)",
                    f"{r['bf16_gb']:.2f}",
                    f"{r['fp8_gb']:.2f}",
                    r["all_reduce"],
                    r["all_gather"],
                    f"{r['payload_mb']:.0f}",
                    f"{r['wire_mb_per_rank']:.0f}",
                ]
                for r in rows
            ],
        ),
    ]
    text = "\n".join(out)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "rows": rows}, f, indent=2)
    return text


# ---------------------------------------------------------------------------------------------- report


def run(args: argparse.Namespace) -> str:
    if getattr(args, "model", "flux1-dev") != "flux1-dev":
        return run_sizes(args)
    degrees = [int(d) for d in args.degrees.split(",")]
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    config, dtype = (FLUX_DEV, torch.bfloat16) if on_gpu else (CPU_CONFIG, torch.float32)
    compute_size = args.compute_size or (1024 if on_gpu else 512)
    if device.type == "cpu":
        torch.set_num_threads(1)  # one core: steadier timings on a machine shared with other work

    rows: list[dict[str, Any]] = []
    for degree in degrees:
        for plan in PLANS:
            row = sizes_and_collectives(plan, degree, args.size)
            row["forward_ms"] = 1e3 * compute_time(
                plan, degree, config, compute_size, device, dtype, args.repeats
            )
            rows.append(row)
            print(f"  measured {plan} at TP={degree}", flush=True)

    dims = FluxDims.from_diffusers_config(config)
    tokens = (args.size // 16) ** 2
    model_name = (
        "FLUX.1-dev bf16"
        if on_gpu
        else (
            f"scaled-down FLUX ({dims.heads}x{dims.head_dim}, {dims.double_blocks}+{dims.single_blocks} blocks) fp32"
        )
    )
    out = [
        f"### Tensor parallelism: FLUX.1-dev, bf16, {args.size}x{args.size} ({tokens} image + 512 text tokens)",
        "",
        "Per rank, one transformer forward. Parameters and collectives from the meta device under the fake",
        "process group; wire MB assume ring algorithms (all-reduce 2(N-1)/N x payload, all-gather (N-1)/N).",
        "",
        markdown_table(
            [
                "TP",
                "plan",
                "params/rank (GB)",
                "all-reduces",
                "all-gathers",
                "payload (MB)",
                "sent/rank (MB)",
            ],
            [
                [
                    r["degree"],
                    r["plan"],
                    f"{r['param_gb']:.2f}",
                    r["all_reduce"],
                    r["all_gather"],
                    f"{r['payload_mb']:.0f}",
                    f"{r['wire_mb_per_rank']:.0f}",
                ]
                for r in rows
            ],
        ),
        "",
        f"### One rank's compute per forward: {model_name}, {compute_size}x{compute_size}, on {device.type}",
        "",
        markdown_table(
            ["TP", "plan", "forward (ms, median)", "vs TP=1"],
            [
                [
                    r["degree"],
                    r["plan"],
                    f"{r['forward_ms']:.1f}",
                    f"{rows[i % len(PLANS)]['forward_ms'] / r['forward_ms']:.2f}x",
                ]
                for i, r in enumerate(rows)
            ],
        ),
    ]
    text = "\n".join(out)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "model": model_name, "rows": rows}, f, indent=2)
    return text
