"""`bench caches`: ComfyUI's step-cache nodes on ComfyUI's own FLUX and on the ROCm Parallel Model.

Needs a ComfyUI checkout (`COMFYUI_PATH`, with its dependencies on PYTHONPATH, as the comfy tier). For
each cache node this ComfyUI ships that wraps whole model calls (EasyCache, LazyCache) and for no cache,
ComfyUI's KSampler samples one image with ComfyUI's own model (loaded by ComfyUI from the same random
weights) and with the parallel MODEL (TP 2 on two CPU workers, one thread each); the table gives the model
calls that really ran and the median seconds per image, runs of the same node interleaved so both models
see the same machine load.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ..backend.checkpoint import diffusers_to_bfl, save_checkpoint
from ..backend.config import ParallelLayout
from ..backend.diffusion.api import ParallelModel
from ..backend.flux.model import build_flux
from ..testing.helpers import TEST_CONFIG, markdown_table

# node id -> (module, class) in ComfyUI 0.33.0 (comfy_extras/nodes_easycache.py)
NODES = {
    "EasyCache": ("comfy_extras.nodes_easycache", "EasyCacheNode"),
    "LazyCache": ("comfy_extras.nodes_easycache", "LazyCacheNode"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=24, help="sampling steps (default 24)")
    parser.add_argument("--size", type=int, default=128, help="image side in pixels (default 128)")
    parser.add_argument("--runs", type=int, default=3, help="timed images per model and node (default 3)")
    parser.add_argument("--cfg", type=float, default=2.5, help="cfg, with a negative prompt (default 2.5)")
    parser.add_argument("--sampler", default="dpmpp_2m", help="ComfyUI sampler (default dpmpp_2m)")
    parser.add_argument(
        "--workers",
        type=int,
        choices=(1, 2),
        default=2,
        help="CPU workers of the parallel MODEL: 2 (TP 2, default) or 1 (no split: the pack's own cost alone)",
    )


def _import_comfy() -> None:
    path = os.environ.get("COMFYUI_PATH")
    if not path:
        raise SystemExit(
            "bench caches needs COMFYUI_PATH (a ComfyUI checkout, its dependencies on PYTHONPATH)"
        )
    sys.path.insert(0, path)
    argv, sys.argv = sys.argv, [sys.argv[0], "--cpu"]
    try:
        importlib.import_module("comfy.options").enable_args_parsing()
        importlib.import_module("nodes")
    finally:
        sys.argv = argv


def _own_model(model: torch.nn.Module) -> Any:
    """ComfyUI's own loader on the BFL weights, its detection told the small widths it cannot read."""
    detection = importlib.import_module("comfy.model_detection")
    original = detection.detect_unet_config
    config = dict(model.config)
    widths = {
        "hidden_size": config["num_attention_heads"] * config["attention_head_dim"],
        "num_heads": config["num_attention_heads"],
        "context_in_dim": config["joint_attention_dim"],
        "axes_dim": list(config["axes_dims_rope"]),
    }
    detection.detect_unet_config = lambda sd, prefix, metadata=None: {
        **original(sd, prefix, metadata=metadata),
        **widths,
    }
    try:
        bfl = diffusers_to_bfl(model.state_dict())
        load = importlib.import_module("comfy.sd").load_diffusion_model_state_dict
        return load(bfl, model_options={"dtype": torch.float32})
    finally:
        detection.detect_unet_config = original


def _parallel_model(checkpoint: str, flux: ParallelModel, workers: int) -> Any:
    from ..nodes import comfy_model
    from ..nodes.inputs import LayoutRequest, ParallelHandle
    from ..nodes.registry import Registry

    registry = Registry(factory=lambda devices: flux)
    handle = ParallelHandle(checkpoint, Path(checkpoint).name, ("cpu",) * workers, "float32")
    return comfy_model.parallel_model(handle, LayoutRequest(ParallelLayout(tp=workers)), registry)


def _with_node(model: Any, node: str | None) -> Any:
    if node is None:
        return model
    module, name = NODES[node]
    cls = getattr(importlib.import_module(module), name)
    return cls.execute(model, 0.2, 0.15, 0.95, False)[0]  # the node's defaults


def _sample(model: Any, args: argparse.Namespace) -> float:
    g = torch.Generator().manual_seed(0)
    text, pooled = TEST_CONFIG["joint_attention_dim"], TEST_CONFIG["pooled_projection_dim"]
    positive = [
        [torch.randn(1, 8, text, generator=g), {"pooled_output": torch.randn(1, pooled, generator=g)}]
    ]
    negative = [
        [torch.randn(1, 8, text, generator=g), {"pooled_output": torch.randn(1, pooled, generator=g)}]
    ]
    latent = {"samples": torch.zeros(1, 16, args.size // 8, args.size // 8)}
    ksampler = importlib.import_module("nodes").common_ksampler
    started = time.perf_counter()
    with torch.no_grad():
        ksampler(model, 1, args.steps, args.cfg, args.sampler, "simple", positive, negative, latent)
    return time.perf_counter() - started


def run(args: argparse.Namespace) -> str:
    _import_comfy()
    torch.set_num_threads(1)
    weights = build_flux(TEST_CONFIG, seed=0)
    own = _own_model(weights)
    own_calls: list[int] = []
    own.model.diffusion_model.img_in.register_forward_pre_hook(lambda *_: own_calls.append(1))
    nodes = [None, *(n for n, (m, c) in NODES.items() if hasattr(importlib.import_module(m), c))]
    rows = []
    with tempfile.TemporaryDirectory(prefix="rocm-parallel-bench-") as folder:
        checkpoint = str(Path(folder) / "tiny-flux.safetensors")
        save_checkpoint(weights, checkpoint)
        with ParallelModel(["cpu"] * args.workers, threads=1) as flux:
            ours = _parallel_model(checkpoint, flux, args.workers)
            runner = ours.model.diffusion_model.runner
            _sample(ours, args)  # load the model, first (warm-up) run
            plain: dict[str, float] = {}
            ours_name = f"TP {args.workers}" if args.workers > 1 else "1 worker (no split)"
            for node in nodes:
                times: dict[str, list[float]] = {"own": [], "ours": []}
                calls = {}
                for _ in range(args.runs):
                    own_calls.clear()
                    times["own"].append(_sample(_with_node(own, node), args))
                    calls["own"] = len(own_calls)
                    before = runner.calls
                    times["ours"].append(_sample(_with_node(ours, node), args))
                    calls["ours"] = runner.calls - before
                for side, label in (
                    ("own", "ComfyUI's own model"),
                    ("ours", f"ROCm Parallel Model, {ours_name}"),
                ):
                    seconds = statistics.median(times[side])
                    plain.setdefault(side, seconds)
                    rows.append((node or "none", label, f"{calls[side]} of {args.steps}",
                                 f"{seconds:.3f}", f"{plain[side] / seconds:.2f}x"))  # fmt: skip
                print(f"  measured {node or 'no cache'}", flush=True)
    header = ("cache node", "model", "model calls run", "seconds per image", "speed-up vs no cache")
    text = (
        f"### ComfyUI's step caches: test FLUX ({TEST_CONFIG['num_attention_heads']} heads x "
        f"{TEST_CONFIG['attention_head_dim']}), {args.size}x{args.size} px, KSampler {args.sampler} simple, "
        f"{args.steps} steps, cfg {args.cfg:g} with a negative prompt (one batched call per step), the nodes' "
        f"default settings, 1 thread per process, median of {args.runs} images\n\n"
        + markdown_table(header, rows)
    )
    print(text)
    return text
