"""`bench planner`: the planner's per-GPU figures next to what the engine does on the meta device.

For each layout, one rank of FLUX (FLUX.1-dev by default) is built on the meta device under the `fake`
process group and parallelised by the engine itself (`apply_tensor_parallel` / `apply_context_parallel`):

* weights: the parameter bytes the rank holds (must equal the plan exactly);
* collectives: counted during one forward by `CountCollectives` (kinds, counts, payload bytes);
* activations: torch's MemTracker peak of that forward (weights excluded). Attention runs the CPU flash
  kernel on meta, standing in for the GPUs' flash kernels: without it SDPA on meta falls back to the
  math path and materialises the score matrix, which no GPU path does.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..config import FluxDims, ParallelLayout
from ..flux.model import FLUX_DEV, build_flux, random_inputs
from ..parallel.comm import CountCollectives
from ..parallel.context import apply_context_parallel
from ..parallel.fake import fake_process_group
from ..parallel.tensor import apply_tensor_parallel, parameter_bytes
from ..plan import GB, Setup, estimate

LAYOUTS = "1x1x1,2x1x1,4x1x1,8x1x1,1x2x1,1x4x1,1x1x2,1x1x4,1x2x2"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layouts", default=LAYOUTS, help="tp x ring x ulysses, comma-separated")
    parser.add_argument("--sizes", default="1024", help="square image sides in pixels")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--text-tokens", type=int, default=512, help="T5 tokens (512: as bench cp)")
    parser.add_argument("--json", help="also write the rows to this JSON file")


@contextmanager
def flash_attention_on_meta() -> Iterator[None]:
    """Route diffusers' native SDPA call to the flash kernel (meta has kernels for it, no score matrix)."""
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention

    def flash(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
              is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:  # fmt: skip
        if attn_mask is not None or enable_gqa:
            return original(
                query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
            )
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        return op(query, key, value, dropout_p, is_causal, scale=scale)[0]

    functional.scaled_dot_product_attention = flash
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = original


def measure_on_meta(
    config: dict[str, Any],
    layout: ParallelLayout,
    width: int,
    height: int,
    batch: int = 1,
    text_tokens: int = 512,
    dtype: torch.dtype = torch.bfloat16,
    rank: int = 0,
) -> dict[str, Any]:
    """One rank of `layout` on the meta device: parameter bytes, collectives and peak activations."""
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.set_flush_denormal(True)  # the fake group's all-gathers return uninitialised memory
    dims = FluxDims.from_diffusers_config(config)
    with fake_process_group(layout.world_size, rank=rank):
        model = build_flux(config, device="meta", dtype=dtype)
        if layout.tp > 1:
            apply_tensor_parallel(model)
        if layout.ring * layout.ulysses > 1:
            apply_context_parallel(model, layout.ring, layout.ulysses)
        weights = parameter_bytes(model)
        for p in model.parameters():
            p.requires_grad_(True)  # MemTracker hooks every parameter's gradient; TP shards have none
        inputs = random_inputs(dims, batch, height, width, text_tokens, device="meta").to("meta", dtype)
        tracker = MemTracker()
        tracker.track_external(model)
        with flash_attention_on_meta(), tracker, CountCollectives() as counter, torch.no_grad():
            model(**inputs.as_kwargs(), return_dict=False)
    peak = tracker.get_tracker_snapshot("peak")[torch.device("meta")]
    activations = sum(v for k, v in peak.items() if "ACT" in str(k) or "TEMP" in str(k))
    return {
        "weights": weights,
        "activations": activations,
        "counts": dict(counter.log.counts),
        "payload": dict(counter.log.payload_bytes),
    }


def _layouts(text: str) -> list[ParallelLayout]:
    out = []
    for item in text.split(","):
        tp, ring, ulysses = (int(v) for v in item.split("x"))
        out.append(ParallelLayout(tp=tp, ring=ring, ulysses=ulysses))
    return out


def compare(layout: ParallelLayout, size: int, batch: int, text_tokens: int) -> dict[str, Any]:
    dims = FluxDims.from_diffusers_config(FLUX_DEV)
    setup = Setup(dims, size, size, batch, text_tokens, devices=layout.world_size)
    planned = estimate(setup, layout)
    measured = measure_on_meta(FLUX_DEV, layout, size, size, batch, text_tokens)
    counts: dict[str, int] = {}
    payload: dict[str, int] = {}
    for c in planned.collectives:
        counts[c.kind] = counts.get(c.kind, 0) + c.count
        payload[c.kind] = payload.get(c.kind, 0) + c.count * c.payload
    return {
        "layout": str(layout),
        "size": size,
        "planned_weights": planned.weights,
        "measured_weights": measured["weights"],
        "planned_activations": planned.activations,
        "measured_activations": measured["activations"],
        "planned_counts": counts,
        "measured_counts": measured["counts"],
        "planned_payload": payload,
        "measured_payload": measured["payload"],
    }


def run(args: argparse.Namespace) -> str:
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        for layout in _layouts(args.layouts):
            rows.append(compare(layout, size, args.batch, args.text_tokens))
            print(f"  measured {rows[-1]['layout']} at {size}", flush=True)
    lines = [
        f"FLUX.1-dev, bf16, batch {args.batch}, {args.text_tokens} text tokens, rank 0, one forward: planner "
        "vs the engine on the meta device (fake process group; MemTracker peak, weights excluded)",
        "",
        "| image | layout | weights plan / engine (GB) | activations plan (GB) | MemTracker (GB) | error | "
        "collectives plan = counted | payload plan = counted |",
        "|---|---|---|---:|---:|---:|---|---|",
    ]
    for r in rows:
        err = r["planned_activations"] / r["measured_activations"] - 1
        same_w = "=" if r["planned_weights"] == r["measured_weights"] else "≠"
        same_c = "yes" if r["planned_counts"] == r["measured_counts"] else f"no ({r['measured_counts']})"
        same_p = "yes" if r["planned_payload"] == r["measured_payload"] else f"no ({r['measured_payload']})"
        counts = ", ".join(f"{n} {k}" for k, n in sorted(r["planned_counts"].items())) or "none"
        lines.append(
            f"| {r['size']}x{r['size']} | {r['layout']} | {r['planned_weights'] / GB:.3f} {same_w} "
            f"{r['measured_weights'] / GB:.3f} | {r['planned_activations'] / GB:.3f} | "
            f"{r['measured_activations'] / GB:.3f} | {err:+.1%} | {counts}: {same_c} | {same_p} |"
        )
    table = "\n".join(lines)
    print("\n" + table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return table
