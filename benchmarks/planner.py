"""`bench planner`: the planner's per-GPU figures next to what the engine does on the meta device.

For each layout, one rank of FLUX (FLUX.1-dev by default) is built on the meta device under the `fake`
process group and parallelised by the engine itself (`apply_tensor_parallel` / `apply_context_parallel`):

* weights: the parameter bytes the rank holds (must equal the plan exactly);
* collectives: counted during one forward by `CountCollectives` (kinds, counts, payload bytes);
* activations: torch's MemTracker peak of that forward (weights excluded; see
  `testing.meta.measure_on_meta`, the tracer the tests use too).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..backend.config import FluxDims, ParallelLayout
from ..backend.flux.model import FLUX_DEV
from ..backend.plan import Setup, count_by_kind, estimate, payload_by_kind
from ..backend.text import GB
from ..testing.helpers import markdown_row
from ..testing.meta import measure_on_meta

LAYOUTS = "1x1x1,2x1x1,4x1x1,8x1x1,1x2x1,1x4x1,1x1x2,1x1x4,1x2x2"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layouts", default=LAYOUTS, help="tp x ring x ulysses, comma-separated")
    parser.add_argument("--sizes", default="1024", help="square image sides in pixels")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--text-tokens", type=int, default=512, help="T5 tokens (512: as bench cp)")
    parser.add_argument("--json", help="also write the rows to this JSON file")


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
    return {
        "layout": str(layout),
        "size": size,
        "planned_weights": planned.weights,
        "measured_weights": measured["weights"],
        "planned_activations": planned.activations,
        "measured_activations": measured["activations"],
        "planned_counts": count_by_kind(planned.collectives),
        "measured_counts": measured["counts"],
        "planned_payload": payload_by_kind(planned.collectives),
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
        weights = f"{r['planned_weights'] / GB:.3f} {same_w} {r['measured_weights'] / GB:.3f}"
        lines.append(
            markdown_row([f"{r['size']}x{r['size']}", r["layout"], weights, f"{r['planned_activations'] / GB:.3f}",
                          f"{r['measured_activations'] / GB:.3f}", f"{err:+.1%}", f"{counts}: {same_c}", same_p])
        )  # fmt: skip
    table = "\n".join(lines)
    print("\n" + table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return table
