"""Checkpoint-loading benchmark: peak host memory per rank, sharded loader vs a naive full load.

Writes a random BFL-layout FLUX of a few hundred MB (FLUX's structure, narrower), then loads it once
per rank and per variant, each in a fresh process run one after another (peak RSS is per process):

* sharded: `load_model(path, tp=N)`, each rank reading only its slices from disk;
* naive:   `safetensors.torch.load_file` + key conversion + `load_state_dict` + `apply_tensor_parallel`.

Peak = VmHWM at the end minus the RSS after imports (the peak mark is reset after imports).
Ranks run as one rank of a fake world (`fake_process_group`): what a worker does, minus collectives,
which loading has none of.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..backend.text import MiB

PACK_ROOT = Path(__file__).resolve().parents[1]

# Same trick as the worker bootstrap (client.py): import the backend from PACK_ROOT as
# `rocm_parallel` without running the pack's ComfyUI __init__.
_CHILD = (
    "import sys, types; root = sys.argv[1]; pkg = types.ModuleType('rocm_parallel'); "
    "pkg.__path__ = [root]; sys.modules['rocm_parallel'] = pkg; "
    "from rocm_parallel.benchmarks.load import child; child(sys.argv[2])"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=1024, help="hidden width (heads of 128)")
    parser.add_argument("--double-blocks", type=int, default=3)
    parser.add_argument("--single-blocks", type=int, default=6)
    parser.add_argument("--degrees", default="1,2,4", help="comma-separated TP degrees")
    parser.add_argument("--dtype", default="bfloat16", help="stored and compute dtype")
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temp dir)")


def write_checkpoint(path: Path, config: dict[str, Any], dtype: str) -> int:
    """Random weights drawn straight from the meta model's shapes (no model is built, so writing stays
    cheap), written by the one checkpoint writer in the BFL layout."""
    import torch

    from ..backend.checkpoint import save_checkpoint
    from ..backend.flux.family import FLUX1

    g = torch.Generator().manual_seed(0)
    state = {
        k: (torch.randn(s, generator=g) * 0.05).to(getattr(torch, dtype))
        for k, s in FLUX1.parameter_shapes(config).items()
    }
    save_checkpoint(state, path, FLUX1)
    return path.stat().st_size


def _peak_rss() -> int:
    """This process's peak resident set (VmHWM), in bytes.

    Not `getrusage().ru_maxrss`: across exec, Linux carries into it the peak of the forked copy of the
    parent, so a child of a large parent reports at least the parent's size (seen here: ~870 MiB).
    VmHWM belongs to the process's own memory and is reset by writing 5 to /proc/self/clear_refs.
    """
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) * 1024


def _settle() -> int:
    """Release what imports freed, reset the peak mark, and return the RSS: the baseline.

    Without the reset the peak would still hold the import-time high; without malloc_trim, heap
    freed by the imports would be reused by the load without showing up as growth.
    """
    import ctypes
    import gc

    import psutil

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")  # Linux >= 4.0: reset VmHWM
    except OSError as err:
        raise SystemExit(f"bench load needs Linux (glibc, /proc/self/clear_refs): {err}") from None
    return psutil.Process().memory_info().rss


def child(spec_json: str) -> None:
    """One measurement, in its own process; prints a JSON line."""
    spec = json.loads(spec_json)
    import torch

    torch.set_num_threads(1)
    from diffusers import FluxTransformer2DModel  # noqa: F401  (imported before the baseline)
    from safetensors.torch import load_file

    from ..backend.checkpoint import bfl_to_diffusers, inspect_checkpoint, load_model
    from ..backend.flux.model import build_flux
    from ..backend.parallel.tensor import parameter_bytes
    from ..testing.fake import fake_process_group
    from ..testing.parallel import apply_tensor_parallel

    dtype = getattr(torch, spec["dtype"])
    path, degree, rank = spec["path"], spec["degree"], spec["rank"]
    info = inspect_checkpoint(path)
    build_flux(info.config, device="meta")  # first build pays diffusers' lazy imports outside the measurement
    baseline = _settle()
    start = time.perf_counter()
    with fake_process_group(degree, rank):
        if spec["variant"] == "sharded":
            model = load_model(path, dtype=dtype, tp=degree)
        else:
            state = {k: v.to(dtype) for k, v in bfl_to_diffusers(load_file(path)).items()}
            model = build_flux(info.config, device="meta", dtype=dtype)
            model.load_state_dict(state, assign=True)
            del state
            apply_tensor_parallel(model)
        # load_file's tensors are views of the file's memory map whose pages only become resident when
        # read: read every parameter once, as moving it to the GPU would (a no-op cost for `sharded`).
        for p in model.parameters():
            # max, not sum, on GGUF's raw blocks (uint8): an integer sum accumulates through an int64 copy
            p.sum() if p.is_floating_point() else p.max()
    seconds = time.perf_counter() - start
    peak = _peak_rss()
    print(json.dumps({"peak": peak - baseline, "shard": parameter_bytes(model), "seconds": seconds}))


def _measure(spec: dict[str, Any]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(PACK_ROOT), json.dumps(spec)],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode:
        raise RuntimeError(f"bench load child {spec} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> str:
    from ..testing.models import tiny_flux_config

    if args.hidden % 128:
        raise SystemExit(f"--hidden={args.hidden} must be a multiple of the head width 128")
    config = tiny_flux_config(
        heads=args.hidden // 128,
        head_dim=128,
        double_blocks=args.double_blocks,
        single_blocks=args.single_blocks,
        text_dim=4096,
        pooled_dim=768,
    )
    degrees = [int(d) for d in args.degrees.split(",")]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "flux-bench.safetensors"
        size = write_checkpoint(path, config, args.dtype)
        lines = [
            f"Checkpoint: BFL layout, hidden {args.hidden}, {args.double_blocks} double + "
            f"{args.single_blocks} single blocks, {args.dtype}, {size / MiB:.0f} MiB on disk.",
            "",
            "| TP | rank | shard (MiB) | sharded peak (MiB) | peak / shard | naive peak (MiB) | naive / shard |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        print("\n".join(lines), flush=True)
        for degree in degrees:
            for rank in range(degree):
                spec = {"path": str(path), "degree": degree, "rank": rank, "dtype": args.dtype}
                sharded = _measure({**spec, "variant": "sharded"})
                naive = _measure({**spec, "variant": "naive"})
                shard = sharded["shard"]
                s_peak, n_peak = sharded["peak"], naive["peak"]
                line = (
                    f"| {degree} | {rank} | {shard / MiB:.0f} | {s_peak / MiB:.0f} | {s_peak / shard:.2f} | "
                    f"{n_peak / MiB:.0f} | {n_peak / shard:.2f} |"
                )
                print(line, flush=True)
                lines.append(line)
    return "\n".join(lines)
