"""GGUF models split across GPUs: bytes per GPU of the released models, and host memory while loading.

1. Bytes per GPU at TP 1 / 2 / 4 of FLUX.1-dev Q8_0, FLUX.2 [dev] Q4_K and Qwen-Image Q4_K, counted from a
   file header alone: the header a converted file of the released config has (every tensor's shape and
   GGML type, no data: `meta_header`), read through the loader's own rules (which parameters stay
   quantized, `resident_dtype`; which rows and blocks a rank keeps, `parameter_pieces` on the family's
   meta model). The planner's figure (its per-type bytes per value, `Setup.linear_bytes`) stands beside it.
   Types per tensor follow ComfyUI-GGUF: tools/convert.py (1-D and tiny tensors F32) and llama.cpp with
   its lcpp.patch (FLUX's embedders and final layer kept in the source's BF16; a row that is not whole
   super-blocks F16); a plain Q4_K file, not the _S / _M mixes that raise a few layers a type.
2. Host memory while loading: a random GGUF model (FLUX's structure, narrower) loaded by one rank of a fake
   world per process, as bench load does: peak RSS growth against the rank's share. Compute dtype bf16.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path
from typing import Any

from ..backend.text import GB, MiB, markdown_table

MODELS = (("flux1-dev", "Q8_0"), ("flux2-dev", "Q4_K"), ("qwen-image", "Q4_K"))
# llama.cpp + lcpp.patch keep these FLUX tensors unquantized (in the source file's BF16)
KEPT = ("txt_in.", "img_in.", "time_in.", "vector_in.", "guidance_in.", "final_layer.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--degrees", default="1,2,4", help="comma-separated TP degrees")
    parser.add_argument("--hidden", type=int, default=1536, help="RSS part: hidden width (heads of 128)")
    parser.add_argument("--double-blocks", type=int, default=3)
    parser.add_argument("--single-blocks", type=int, default=6)
    parser.add_argument("--quant", default="Q8_0", help="RSS part: the file's quantization")
    parser.add_argument("--skip-rss", action="store_true", help="only the header count")
    parser.add_argument(
        "--dir", default=None, help="where to write the RSS part's file (default: a temp dir)"
    )


def header_type(key: str, shape: tuple[int, ...], qtype: str) -> str:
    """The GGML type a converted + quantized file stores tensor `key` in (module docstring)."""
    from ..backend.dtypes import GGUF_BLOCKS

    if len(shape) == 1 or math.prod(shape) <= 1024:
        return "F32"
    if any(key.startswith(k) for k in KEPT):
        return "BF16"
    return "F16" if shape[-1] % GGUF_BLOCKS[qtype][0] else qtype


def meta_header(family: Any, config: dict[str, Any], qtype: str) -> Any:
    """The CheckpointInfo of a GGUF file of `config` in `qtype`, built from shapes alone (no file, no data)."""
    from ..backend.checkpoint.files import StoredTensor
    from ..backend.checkpoint.gguf import tensor_bytes
    from ..backend.checkpoint.info import CheckpointInfo

    shapes = family.bfl_shapes(config)
    stored = {k: StoredTensor("meta.gguf", k, s, header_type(k, s, qtype), 0) for k, s in shapes.items()}
    sources = {name: (stored[s.key], s.rows) for name, s in family.sources(config).items()}
    return CheckpointInfo(
        path="meta.gguf", format="bfl", files=("meta.gguf",), prefix="", stored_dtypes=(qtype,), config=config,
        variant=family.variant(config), parameters=sum(math.prod(s) for s in shapes.values()),
        stored_bytes=sum(tensor_bytes(t) for t in stored.values()), sources=sources, family=family.name,
        quantization="gguf",
    )  # fmt: skip


def held_bytes(info: Any, model: Any, resolved: dict[str, Any], degree: int, rank: int) -> int:
    """Bytes rank `rank` of `degree` holds once `load_model` (bf16 compute, weights kept quantized) is done."""
    import torch
    from torch import nn

    from ..backend.checkpoint.load import full_shape, resident_dtype
    from ..backend.parallel.ggml import byte_shape
    from ..backend.parallel.tensor import parameter_pieces

    total = 0
    for name, (stored, rows) in info.sources.items():
        shape = full_shape(stored, rows)
        pieces = parameter_pieces(resolved, name, shape, rank, degree, info.dims)
        held = shape if pieces is None else pieces.shape(shape)
        module_name, _, param = name.rpartition(".")
        linear = isinstance(model.get_submodule(module_name), nn.Linear) and param == "weight"
        dtype = resident_dtype(stored, linear, "default", torch.bfloat16)
        total += math.prod(byte_shape(held, stored.dtype)) if dtype == torch.uint8 else 2 * math.prod(held)
    return total


def header_table(degrees: list[int]) -> str:
    from ..backend.cli import plan_models
    from ..backend.config import ParallelLayout
    from ..backend.parallel.tensor import resolve_plan
    from ..backend.plan import weight_bytes
    from ..backend.plan.setup import Setup

    rows = []
    for model_name, qtype in MODELS:
        family, config = plan_models()[model_name]
        info = meta_header(family, config, qtype)
        model = family.build(config, device="meta")
        resolved = resolve_plan(model, family.tp.plan)
        linear = Setup(info.dims, family=family.name, weight_dtype=qtype).linear_bytes
        for degree in degrees:
            held = [held_bytes(info, model, resolved, degree, r) for r in range(degree)]
            planned = weight_bytes(
                info.dims, ParallelLayout(tp=degree), 2, family=family.name, linear_bytes=linear
            )
            rows.append([f"{model_name} {qtype}", f"{info.stored_bytes / GB:.2f}", str(degree),
                         f"{max(held) / GB:.2f}", f"{planned / GB:.2f}"])  # fmt: skip
    header = ["model, file type", "file (GB)", "TP", "held per GPU (GB)", "planner (GB)"]
    return markdown_table(header, rows, ["---", "---:", "---:", "---:", "---:"])


def rss_table(args: argparse.Namespace, degrees: list[int]) -> str:
    import torch

    from ..testing.gguf_files import save_gguf
    from ..testing.models import tiny_flux_config
    from .load import _measure

    config = tiny_flux_config(
        heads=args.hidden // 128, head_dim=128, double_blocks=args.double_blocks,
        single_blocks=args.single_blocks, text_dim=4096, pooled_dim=768,
    )  # fmt: skip
    from ..backend.flux.family import FLUX1

    g = torch.Generator().manual_seed(0)
    state = {k: torch.randn(s, generator=g) * 0.05 for k, s in FLUX1.parameter_shapes(config).items()}
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / f"flux-bench-{args.quant}.gguf"
        save_gguf(state, path, args.quant, "flux1")
        del state
        size = path.stat().st_size
        for degree in degrees:
            for rank in range(degree):
                spec = {"path": str(path), "degree": degree, "rank": rank, "dtype": "bfloat16"}
                got = _measure({**spec, "variant": "sharded"})
                rows.append([str(degree), str(rank), f"{got['shard'] / MiB:.0f}", f"{got['peak'] / MiB:.0f}",
                             f"{got['peak'] / got['shard']:.2f}"])  # fmt: skip
                print("| " + " | ".join(rows[-1]) + " |", flush=True)
    head = (
        f"File: GGUF {args.quant}, hidden {args.hidden}, {args.double_blocks} double + {args.single_blocks} "
        f"single blocks, {size / MiB:.0f} MiB on disk; compute bf16, weights kept quantized.\n\n"
    )
    header = ["TP", "rank", "share (MiB)", "peak RSS growth (MiB)", "peak / share"]
    return head + markdown_table(header, rows, ["---:", "---:", "---:", "---:", "---:"])


def run(args: argparse.Namespace) -> str:
    degrees = [int(d) for d in args.degrees.split(",")]
    out = header_table(degrees)
    print(out, flush=True)
    if not args.skip_rss:
        if args.hidden % 128:
            raise SystemExit(f"--hidden={args.hidden} must be a multiple of the head width 128")
        rss = rss_table(args, degrees)
        print("\n" + rss, flush=True)
        out += "\n\n" + rss
    return out
