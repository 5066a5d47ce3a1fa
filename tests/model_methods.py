"""Model methods the parallelism tests run inside the workers (`WorkerGroup(methods=["model_methods"])`):
build a (tensor- or context-parallel) random FLUX and run forwards on it. Test-only: not in the package.

Arguments and results are plain data (dicts, numbers, CPU tensors) so the client and the worker need
not share class identities: inside ComfyUI the pack's module names differ from the worker's.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from rocm_parallel.backend.config import ConfigError, FluxDims, ParallelLayout
from rocm_parallel.backend.dtypes import COMPUTE_DTYPES
from rocm_parallel.backend.flux.model import build_flux
from rocm_parallel.backend.parallel.context import apply_context_parallel
from rocm_parallel.backend.parallel.tensor import apply_tensor_parallel, parameter_bytes
from rocm_parallel.backend.parallel.weights import compute_dtype
from rocm_parallel.backend.worker import WorkerContext, handler
from rocm_parallel.testing.models import ModelInputs


@handler("build_random")
def build_random(
    ctx: WorkerContext,
    config: dict[str, Any],
    seed: int,
    dtype: str,
    tp: int = 1,
    ring: int = 1,
    ulysses: int = 1,
    attention: str | None = None,
) -> dict[str, Any]:
    """Build a FLUX with random weights drawn from `seed` (identical on every rank) and parallelise it.

    `tp` shards the weights (tensor parallelism); `ring` x `ulysses` split the tokens (context
    parallelism, `attention` overrides its kernel). Their product must be the group's size.
    """
    if dtype not in (d.name for d in COMPUTE_DTYPES):
        raise ConfigError(
            f"dtype={dtype!r} is not supported; use {', '.join(d.name for d in COMPUTE_DTYPES)}"
        )
    layout = ParallelLayout(tp=tp, ring=ring, ulysses=ulysses)
    layout.validate(FluxDims.from_diffusers_config(config), devices=ctx.world_size)
    ctx.resident.clear()
    started = time.perf_counter()
    model = build_flux(config, device="cpu", dtype=getattr(torch, dtype), seed=seed)
    if layout.ring * layout.ulysses > 1:
        model.to(ctx.device)
        apply_context_parallel(model, ring_degree=ring, ulysses_degree=ulysses, attention=attention)
    else:
        apply_tensor_parallel(model)
        model.to(ctx.device)
    ctx.synchronize()
    key = {"random": config, "seed": seed, "dtype": dtype, "tp": tp, "ring": ring, "ulysses": ulysses}
    ctx.resident.set(model, {**key, "attention": attention})
    return {
        "rank": ctx.rank,
        "parameter_bytes": parameter_bytes(model),
        "seconds": time.perf_counter() - started,
    }


@handler("forward")
def forward(ctx: WorkerContext, inputs: dict[str, Any]) -> dict[str, Any]:
    """One timed transformer forward on every rank; rank 0 returns the (full) output."""
    model = ctx.resident.require()
    dtype = compute_dtype(model)
    args = ModelInputs(inputs).to(ctx.device, dtype).as_kwargs()
    with torch.inference_mode():
        ctx.synchronize()
        started = time.perf_counter()
        out = model(**args, return_dict=False)[0]
        ctx.synchronize()
    seconds = time.perf_counter() - started
    return {"rank": ctx.rank, "seconds": seconds, "output": out.float().cpu() if ctx.rank == 0 else None}
