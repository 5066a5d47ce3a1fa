"""`bench planner`: the planner's per-GPU figures next to what the engine does on the meta device.

For each layout, one rank of FLUX (FLUX.1-dev by default) is built on the meta device under the `fake`
process group and parallelised by the engine itself (the layout's device mesh, `parallel/mesh.py`
`parallelize`: TP on the tp group, CP on the ring x ulysses sub-mesh, the batch split around the call):

* weights: the parameter bytes the rank holds (must equal the plan exactly);
* collectives: counted during one forward by `CountCollectives` per mesh dimension (by the process group
  each ran on: kinds, counts, payload bytes);
* activations: torch's MemTracker peak of that forward (weights excluded; see
  `testing.meta.measure_on_meta`, the tracer the tests use too).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..backend.cli import plan_models
from ..backend.config import ConfigError, ParallelLayout
from ..backend.plan import Setup, count_by_kind, estimate, payload_by_kind
from ..backend.text import GB
from ..testing.helpers import markdown_row
from ..testing.meta import measure_on_meta

LAYOUTS = (
    "single,tp2,tp4,tp8,ring2,ring4,ulysses2,ulysses4,ring2xulysses2,"
    "tp2xring2,tp2xulysses2,batch2xtp2,batch2xring2,tp2xring2xulysses2"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--layouts",
        default=LAYOUTS,
        type=_layout_list,
        help="layouts as the API takes them ('batch2xtp2'), comma-separated",
    )
    parser.add_argument(
        "--model", choices=tuple(plan_models()), default="flux1-dev", help="model, as `plan --model` takes it"
    )
    parser.add_argument("--sizes", default="1024", help="square image sides in pixels")
    parser.add_argument("--batch", type=int, default=2, help="the model call's batch (2: cond + uncond)")
    parser.add_argument("--text-tokens", type=int, default=512, help="T5 tokens (512: as bench cp)")
    parser.add_argument("--json", help="also write the rows to this JSON file")


def _layouts(text: str) -> list[ParallelLayout]:
    return [ParallelLayout.parse(item) for item in text.split(",")]


def _layout_list(text: str) -> str:
    """--layouts checked when the command line is read (a documented command that no longer parses fails
    tests/test_docs_commands.py, not minutes into a run)."""
    try:
        _layouts(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return text


def _by_dimension(comms: list) -> dict[str, int]:
    """'dim:kind' -> count, the planner's (a group serving two dimensions is counted under both names by
    the engine: 'ring|cp' when ring is the only CP degree)."""
    out: dict[str, int] = {}
    for c in comms:
        out[f"{c.dim}:{c.kind}"] = out.get(f"{c.dim}:{c.kind}", 0) + c.count
    return out


def _measured_by_dimension(measured: dict[tuple[str, str], tuple[int, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for (dim, kind), (count, _) in measured.items():
        for name in dim.split("|")[:1]:  # a shared group: its first dimension (the collective's own)
            out[f"{name}:{kind}"] = out.get(f"{name}:{kind}", 0) + count
    return out


def compare(
    layout: ParallelLayout, size: int, batch: int, text_tokens: int, model: str = "flux1-dev"
) -> dict[str, Any]:
    family, config = plan_models()[model]
    setup = Setup(
        family.dims(config), size, size, batch, text_tokens, devices=layout.world_size, family=family.name
    )
    planned = estimate(setup, layout)
    measured = measure_on_meta(config, layout, size, size, batch, text_tokens, family=family.name)
    return {
        "planned_by_dimension": _by_dimension(planned.collectives),
        "measured_by_dimension": _measured_by_dimension(measured["by_dimension"]),
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


def _same_dims(r: dict[str, Any]) -> bool:
    """Planner and engine agree per dimension ('cp' is counted under 'ring' or 'ulysses' when that group
    is diffusers' flattened one too)."""
    planned = dict(r["planned_by_dimension"])
    measured = r["measured_by_dimension"]
    for key in [k for k in planned if k.startswith("cp:")]:
        if key not in measured:
            for alias in ("ring", "ulysses"):
                other = f"{alias}:{key[3:]}"
                if other in planned and measured.get(other) == planned[other] + planned[key]:
                    planned[other] += planned.pop(key)
                    break
    return planned == measured


def run(args: argparse.Namespace) -> str:
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        for layout in _layouts(args.layouts):
            rows.append(compare(layout, size, args.batch, args.text_tokens, args.model))
            print(f"  measured {rows[-1]['layout']} at {size}", flush=True)
    lines = [
        f"{args.model}, bf16, call batch {args.batch}, {args.text_tokens} text tokens, rank 0, one forward: planner "
        "vs the engine on the meta device (fake process group; MemTracker peak, weights excluded)",
        "",
        "| image | layout | weights plan / engine (GB) | activations plan (GB) | MemTracker (GB) | error | "
        "collectives plan = counted | payload plan = counted | per mesh dimension |",
        "|---|---|---|---:|---:|---:|---|---|---|",
    ]
    for r in rows:
        err = r["planned_activations"] / r["measured_activations"] - 1
        same_w = "=" if r["planned_weights"] == r["measured_weights"] else "≠"
        same_c = "yes" if r["planned_counts"] == r["measured_counts"] else f"no ({r['measured_counts']})"
        same_p = "yes" if r["planned_payload"] == r["measured_payload"] else f"no ({r['measured_payload']})"
        counts = ", ".join(f"{n} {k}" for k, n in sorted(r["planned_counts"].items())) or "none"
        dims = ", ".join(f"{k} {n}" for k, n in sorted(r["planned_by_dimension"].items())) or "-"
        dims += "" if _same_dims(r) else f" (counted: {r['measured_by_dimension']})"
        weights = f"{r['planned_weights'] / GB:.3f} {same_w} {r['measured_weights'] / GB:.3f}"
        lines.append(
            markdown_row([f"{r['size']}x{r['size']}", r["layout"], weights, f"{r['planned_activations'] / GB:.3f}",
                          f"{r['measured_activations'] / GB:.3f}", f"{err:+.1%}", f"{counts}: {same_c}", same_p,
                          dims])
        )  # fmt: skip
    table = "\n".join(lines)
    print("\n" + table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return table
