"""Model methods the parallelism tests run inside the workers (`WorkerGroup(methods=["model_methods"])`):
build a (tensor- or context-parallel) random FLUX and run forwards on it. Test-only: not in the package.

Requests and replies are this module's own records: the test process and the workers both import it, and
records travel by name, so the two need not share class identities.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from rocm_parallel.backend.config import ConfigError, ParallelLayout
from rocm_parallel.backend.dtypes import COMPUTE_DTYPES
from rocm_parallel.backend.flux.dims import FluxDims
from rocm_parallel.backend.flux.model import build_flux
from rocm_parallel.backend.parallel.tensor import parameter_bytes
from rocm_parallel.backend.parallel.weights import compute_dtype
from rocm_parallel.backend.runtime.transport import record
from rocm_parallel.backend.runtime.worker import WorkerContext, handler
from rocm_parallel.testing.models import ModelInputs
from rocm_parallel.testing.parallel import apply_context_parallel, apply_tensor_parallel


@record
@dataclass(frozen=True)
class BuildRandom:
    """A FLUX with random weights drawn from `seed` (identical on every rank), parallelised: `tp` shards
    the weights (tensor parallelism); `ring` x `ulysses` split the tokens (context parallelism,
    `attention` overrides its kernel). Their product must be the group's size. Also the resident key."""

    config: dict[str, Any]
    seed: int
    dtype: str
    tp: int = 1
    ring: int = 1
    ulysses: int = 1
    attention: str | None = None


@record
@dataclass(frozen=True)
class Built:
    rank: int
    parameter_bytes: int
    seconds: float = 0.0


@record
@dataclass(frozen=True)
class Inputs:
    """A transformer forward's keyword inputs (FluxInputs.as_kwargs(), or Flux2Inputs')."""

    inputs: dict[str, Any]
    return_dict: bool = False


@record
@dataclass(frozen=True)
class Output:
    rank: int
    output: torch.Tensor | None  # rank 0: the full output; the others: None
    seconds: float = 0.0
    type: str = ""  # the class the forward returned


@handler("build_random", BuildRandom)
def build_random(ctx: WorkerContext, request: BuildRandom) -> Built:
    """Build the random FLUX the request describes and keep it resident."""
    config, seed, dtype = request.config, request.seed, request.dtype
    tp, ring, ulysses, attention = request.tp, request.ring, request.ulysses, request.attention
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
    ctx.resident.set(model, request)
    return Built(ctx.rank, parameter_bytes(model), time.perf_counter() - started)


@handler("forward", Inputs)
def forward(ctx: WorkerContext, request: Inputs) -> Output:
    """One timed transformer forward on every rank; rank 0 returns the (full) output."""
    model = ctx.resident.require()
    dtype = compute_dtype(model)
    args = ModelInputs(request.inputs).to(ctx.device, dtype).as_kwargs()
    with torch.inference_mode():
        ctx.synchronize()
        started = time.perf_counter()
        out = model(**args, return_dict=False)[0]
        ctx.synchronize()
    seconds = time.perf_counter() - started
    return Output(ctx.rank, out.float().cpu() if ctx.rank == 0 else None, seconds)
