"""`bench video`: a video model's weights per GPU (meta count) and the planner's layouts for a video size.

For each model (`plan --model`'s names; `name:2` for two resident models of its shape, as Wan 2.2 A14B's
high- and low-noise experts are in ComfyUI's two-loader graph):

* weights per GPU at TP 1/2/4/8, bf16 and fp8: one rank of the model built on the meta device under the
  `fake` process group and sharded by the engine's own tensor parallelism, each parameter counted in the
  dtype the loader holds it in (checkpoint/load.py: fp8 linear weights at one byte, the modules the model
  class keeps in float32 at four), next to the planner's figure for the same layout (`plan.weight_bytes`);
* the planner's best layouts for `--size` x `--frames` on 2, 4 and 8 GPUs of `--memory-gb`, at the call
  batch of cfg > 1 (cond + uncond), with every resident model's weights and one's activations per GPU.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from torch import nn

from ..backend.checkpoint.load import kept_in_fp32
from ..backend.cli import plan_models
from ..backend.config import ParallelLayout
from ..backend.plan import Setup, plan, weight_bytes
from ..backend.text import GB
from ..testing.fake import fake_process_group
from ..testing.helpers import markdown_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models",
        default="wan2.1-t2v-14b,wan2.2-i2v-a14b:2",
        help="models as `plan --model` names them, ':2' for two resident models of that shape",
    )
    parser.add_argument("--degrees", default="1,2,4,8", help="TP degrees for the weights table")
    parser.add_argument("--size", default="1280x720", help="video width x height in pixels (720p)")
    parser.add_argument("--frames", type=int, default=81, help="video frames (81: Wan's 5 s at 16 fps)")
    parser.add_argument("--devices", default="2,4,8", help="GPU counts for the planner's table")
    parser.add_argument("--memory-gb", type=float, default=24.0, help="memory per GPU for the planner")
    parser.add_argument("--json", help="also write the rows to this JSON file")


def _models(text: str) -> list[tuple[str, int]]:
    out = []
    for item in text.split(","):
        name, _, count = item.partition(":")
        out.append((name, int(count or 1)))
    return out


def held_bytes(model: nn.Module, compute_bytes: int, fp8: bool) -> int:
    """Bytes of this rank's parameters as the loader holds them (checkpoint/load.py resident_dtype)."""
    total = 0
    for name, p in model.named_parameters():
        module_name, _, param = name.rpartition(".")
        linear = isinstance(model.get_submodule(module_name), nn.Linear) and param == "weight"
        if kept_in_fp32(model, name):
            size = max(compute_bytes, 4)
        else:
            size = 1 if fp8 and linear else compute_bytes
        total += size * p.numel()
    return total


def weights_rows(models: list[tuple[str, int]], degrees: list[int]) -> list[dict[str, Any]]:
    rows = []
    for name, count in models:
        family, config = plan_models()[name]
        dims = family.dims(config)
        for degree in degrees:
            with fake_process_group(degree):
                model = family.build(config, device="meta", dtype=torch.bfloat16)
                if degree > 1:
                    family.tensor_parallel(model)
                bf16, fp8 = held_bytes(model, 2, False), held_bytes(model, 2, True)
            layout = ParallelLayout(tp=degree)
            planned = (
                weight_bytes(dims, layout, 2, family=family.name),
                weight_bytes(dims, layout, 2, family=family.name, linear_bytes=1),
            )
            rows.append({"model": name, "resident": count, "tp": degree, "bf16": count * bf16, "fp8": count * fp8,
                         "planner_equal": planned == (bf16, fp8)})  # fmt: skip
            print(
                f"  {name} x{count} TP {degree}: {count * bf16 / GB:.2f} / {count * fp8 / GB:.2f} GB",
                flush=True,
            )
    return rows


def planner_rows(
    models: list[tuple[str, int]], width: int, height: int, frames: int, devices: list[int], memory: float
) -> list[dict[str, Any]]:
    rows = []
    for name, count in models:
        family, config = plan_models()[name]
        for weight_dtype in ("compute", "fp8_e4m3fn"):
            for n in devices:
                setup = Setup(
                    family.dims(config), width, height, batch=2, frames=frames, text_tokens=family.text.tokens,
                    devices=n, memory_gb=memory, family=family.name, weight_dtype=weight_dtype,
                )  # fmt: skip
                found = []
                for e in plan(setup):
                    per_gpu = count * e.weights + e.activations  # every resident model, one runs at a time
                    found.append((per_gpu <= e.usable, e, per_gpu))
                # the fastest that fits; when none does, the one closest to fitting
                found.sort(key=lambda f: (not f[0], f[1].step_s if f[0] else f[2]))
                fits, best, per_gpu = found[0]
                rows.append({
                    "model": name, "resident": count, "weights": "bf16" if weight_dtype == "compute" else "fp8",
                    "devices": n, "layout": best.name, "fits": fits, "weights_gb": count * best.weights / GB,
                    "activations_gb": best.activations / GB, "per_gpu_gb": per_gpu / GB, "step_s": best.step_s,
                    "tokens": setup.image_tokens,
                })  # fmt: skip
                print(f"  {name} x{count} {weight_dtype} {n} GPUs: {best.name}", flush=True)
    return rows


def run(args: argparse.Namespace) -> str:
    models = _models(args.models)
    width, height = (int(v) for v in args.size.lower().split("x"))
    weights = weights_rows(models, [int(d) for d in args.degrees.split(",")])
    planned = planner_rows(
        models, width, height, args.frames, [int(d) for d in args.devices.split(",")], args.memory_gb
    )
    by_model: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
    for r in weights:
        by_model.setdefault((r["model"], r["resident"]), {})[r["tp"]] = r
    degrees = sorted({r["tp"] for r in weights})
    weights_table = markdown_table(
        ["model", "resident", *[f"TP {d}" for d in degrees], "= planner"],
        [
            [name, f"{count} model{'s' if count > 1 else ''}",
             *[f"{rows[d]['bf16'] / GB:.2f} / {rows[d]['fp8'] / GB:.2f}" for d in degrees],
             "yes" if all(rows[d]["planner_equal"] for d in degrees) else "no"]
            for (name, count), rows in by_model.items()
        ],
    )  # fmt: skip
    planner_table = markdown_table(
        ["model", "weights", "GPUs", "layout", "weights/GPU (GB)", "activations/GPU (GB)", "fits",
         "predicted step (s)"],
        [
            [f"{r['model']}{' (both experts)' if r['resident'] > 1 else ''}", r["weights"], r["devices"],
             r["layout"], f"{r['weights_gb']:.1f}", f"{r['activations_gb']:.1f}",
             "yes" if r["fits"] else f"no ({r['per_gpu_gb']:.1f} GB)", f"{r['step_s']:.1f}"]
            for r in planned
        ],
    )  # fmt: skip
    lines = [
        "Weights per GPU (GB) as the loader holds them, one rank counted on the meta device (fake process group, "
        "the engine's TP); bf16 / fp8 linear weights (the float32-kept modules at 4 bytes in both)",
        "",
        weights_table,
        "",
        f"The planner at {width}x{height} x {args.frames} frames ({planned[0]['tokens']} video tokens), cfg > 1 "
        f"(a call batch of 2), {args.memory_gb:g} GB GPUs: the fastest layout whose resident weights and "
        "activations fit (when none does: the one closest to fitting)",
        "",
        planner_table,
    ]
    table = "\n".join(lines)
    print("\n" + table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"weights": weights, "planner": planned}, f, indent=2)
    return table
