"""`bench call`: where the time of one model call goes, against the same forward in one process.

One call is `ParallelModel.forward` (what the ROCm Parallel Model's proxy runs for every ComfyUI model
call). Caller-side parts are timed by wrapping, in this process only, the functions that do them:
`ParallelModel.forward` (input checks, the resident group: the caller wrapper), `ConditioningSender.key_for`
(the conditioning key), `transport.pack` (the latent out, into a reused shared-memory file),
`WorkerGroup.call_all` (request, wait, replies). The ranks time their own forward (`reply.seconds`), and
the call waits for the slowest (`ParallelModel.last_forward_seconds`); one rank's compute alone is the same
shard's forward under the `fake` process group (no-op collectives, benchmarks/tp.py `compute_time`), so
the ranks' forward minus it is the collectives, with the ranks' start-up skew (a rank that starts first
waits for the other in the first collective). "reply" is what is left of call_all: sending the request,
the workers unpacking it and packing the output, and reading it back. Both sides use one thread per
process and are interleaved call by call.

The model is a small FLUX with FLUX.1's real conditioning widths (T5 4096, CLIP 768) at the given size, so
every message is as large as at real widths. `--widths real` takes FLUX.1-dev's own widths (24 heads x 128,
3072 hidden) with one double and one single block instead of 19 + 38: the messages and the per-call work
outside the ranks' forward are those of FLUX.1-dev, the collectives are those of one block of each kind,
and a forward fits a CPU (about 40 s at 1024 x 1024 on one core) where FLUX.1-dev's 57 blocks would not.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..backend.config import ParallelLayout
from ..backend.diffusion import forward_client
from ..backend.diffusion.api import ParallelModel
from ..backend.flux.forward import flux_call
from ..backend.flux.model import build_flux
from ..backend.flux.sampling import diffusers_model_fn
from ..backend.runtime import client
from ..testing.helpers import markdown_table, write_random_checkpoint
from ..testing.models import tiny_flux_config
from .step import CONFIG, TEXT_TOKENS, step_inputs
from .tp import compute_time

# Both keep FLUX.1's conditioning widths (T5 4096, CLIP 768): step_inputs builds the same prompt for either.
REAL_WIDTHS = tiny_flux_config(
    heads=24, head_dim=128, double_blocks=1, single_blocks=1, text_dim=4096, pooled_dim=768
)
WIDTHS = {"small": CONFIG, "real": REAL_WIDTHS}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--calls", type=int, default=20, help="measured calls per configuration (default 20)")
    parser.add_argument("--size", type=int, default=1024, help="image side in pixels (default 1024)")
    parser.add_argument(
        "--widths",
        choices=sorted(WIDTHS),
        default="small",
        help="small: 4 heads x 16 (default, milliseconds per forward); real: FLUX.1-dev's 24 heads x 128 with "
        "1 double + 1 single block (tens of seconds per forward on a CPU)",
    )


@contextlib.contextmanager
def timed(spent: dict[str, list[float]]) -> Iterator[None]:
    """Wrap the caller-side functions of one call so each call's time in them lands in `spent`."""
    targets = [
        (ParallelModel, "forward", "total"),
        (forward_client.ConditioningSender, "key_for", "key"),
        (client.WorkerGroup, "call_all", "call_all"),
        (client, "pack", "pack"),
    ]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]

    def wrap(fn: Any, label: str) -> Any:
        def timed_fn(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label].append(time.perf_counter() - started)

        return timed_fn

    for (owner, name, _), (_, _, label) in zip(originals, targets, strict=True):
        setattr(owner, name, wrap(getattr(owner, name), label))
    try:
        yield
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)


def _median_ms(values: list[float]) -> float:
    return sorted(values)[len(values) // 2] * 1e3


def measure(
    config: dict[str, Any],
    checkpoint: str,
    layout: ParallelLayout,
    inputs: dict[str, torch.Tensor],
    calls: int,
) -> dict:
    model_fn = diffusers_model_fn(build_flux(config, seed=0))
    spent: dict[str, list[float]] = defaultdict(list)
    local, ranks = [], []
    with ParallelModel(["cpu"] * layout.world_size, threads=1) as flux, torch.no_grad():
        flux.load(checkpoint, layout=layout, dtype="float32")
        for i in range(calls + 2):  # two warm-up calls (the first sends the conditioning)
            fresh = {k: v.clone() for k, v in inputs.items()}  # ComfyUI builds new tensors each step
            started = time.perf_counter()
            flux_call(
                model_fn, fresh["x"], fresh["timestep"], fresh["context"], fresh["y"], fresh["guidance"]
            )
            one = time.perf_counter() - started
            with timed(spent):
                flux.forward(**fresh)
            if i < 2:
                spent.clear()
                continue
            local.append(one)
            ranks.append(flux.last_forward_seconds)
    r = {k: _median_ms(v) for k, v in spent.items()}
    r["one_process"] = _median_ms(local)
    r["ranks"] = _median_ms(ranks)
    r["wrapper"] = _median_ms([t - c for t, c in zip(spent["total"], spent["call_all"], strict=True)])
    r["wrapper"] -= r["key"]  # key_for runs inside the forward client, outside call_all
    # per call, then the median: a difference of two medians of seconds-long calls is noise at this scale
    r["not_forward"] = _median_ms([t - k for t, k in zip(spent["total"], ranks, strict=True)])
    r["reply"] = _median_ms(
        [c - p - k for c, p, k in zip(spent["call_all"], spent["pack"], ranks, strict=True)]
    )
    return r


def run(args: argparse.Namespace) -> str:
    torch.set_num_threads(1)
    config = WIDTHS[args.widths]
    inputs = step_inputs(args.size)
    layouts = [ParallelLayout(), ParallelLayout(tp=2)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="rocm-parallel-bench-") as folder:
        checkpoint = str(Path(folder) / "tiny-flux.safetensors")
        write_random_checkpoint(checkpoint, config)
        for layout in layouts:
            r = measure(config, checkpoint, layout, inputs, args.calls)
            degree = layout.world_size
            compute = (
                compute_time(
                    "rocm-parallel",
                    degree,
                    config,
                    args.size,
                    torch.device("cpu"),
                    torch.float32,
                    min(5, args.calls),
                    text_tokens=TEXT_TOKENS,
                )
                * 1e3
            )
            collectives = max(r["ranks"] - compute, 0.0) if degree > 1 else 0.0
            rows.append((
                f"{degree} ({layout})" if degree > 1 else "1 (no split)", f"{r['total']:.1f}",
                f"{r['one_process']:.1f}", f"{r['wrapper']:.2f}", f"{r['key']:.2f}", f"{r['pack']:.2f}",
                f"{compute:.1f}", f"{collectives:.1f}", f"{r['reply']:.2f}", f"{r['not_forward']:.2f}",
            ))  # fmt: skip
            print(f"  measured {layout}", flush=True)
    header = (
        "workers (layout)", "call (ms)", "same forward, 1 process (ms)", "caller wrapper (ms)",
        "conditioning key (ms)", "latent out (ms)", "one rank's compute (ms)", "collectives (ms)",
        "request + reply (ms)", "not the ranks' forward (ms)",
    )  # fmt: skip
    model = (
        "small FLUX with FLUX.1's conditioning widths"
        if args.widths == "small"
        else "FLUX.1-dev's widths (24 heads x 128), 1 double + 1 single block"
    )
    text = (
        f"### One model call, broken down: {model}, {args.size}x{args.size} "
        f"px, 512-token prompt rebuilt every call, 1 thread per process, medians of {args.calls} calls "
        "interleaved with the same forward in one process\n\n" + markdown_table(header, rows)
    )
    print(text)
    return text
