"""FLUX.2 model methods the parity tests run inside the workers (`WorkerGroup(methods=[...])`).

Test-only, with records like model_methods.py's (which builds FLUX.1; its `Built`, `Inputs` and `Output`
serve here too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from model_methods import Built, Inputs, Output

from rocm_parallel.backend.config import ParallelLayout
from rocm_parallel.backend.flux.dims import FluxDims
from rocm_parallel.backend.flux2.model import build_flux2
from rocm_parallel.backend.parallel.tensor import parameter_bytes
from rocm_parallel.backend.runtime.transport import record
from rocm_parallel.backend.runtime.worker import WorkerContext, handler
from rocm_parallel.testing.models import ModelInputs
from rocm_parallel.testing.parallel import apply_context_parallel, apply_tensor_parallel


@record
@dataclass(frozen=True)
class BuildRandomFlux2:
    """A float32 FLUX.2 with random weights from `seed` (identical on every rank), parallelised."""

    config: dict[str, Any]
    seed: int
    tp: int = 1
    ring: int = 1
    ulysses: int = 1


@handler("build_random_flux2", BuildRandomFlux2)
def build_random_flux2(ctx: WorkerContext, request: BuildRandomFlux2) -> Built:
    """Build the random FLUX.2 the request describes and keep it resident."""
    config, seed, tp, ring, ulysses = request.config, request.seed, request.tp, request.ring, request.ulysses
    layout = ParallelLayout(tp=tp, ring=ring, ulysses=ulysses)
    layout.validate(FluxDims.from_diffusers_config(config), devices=ctx.world_size)
    ctx.resident.clear()
    model = build_flux2(config, seed=seed)
    if ring * ulysses > 1:
        apply_context_parallel(model, ring_degree=ring, ulysses_degree=ulysses)
    else:
        apply_tensor_parallel(model)
    ctx.resident.set(model, request)
    return Built(ctx.rank, parameter_bytes(model))


@handler("forward_flux2", Inputs)
def forward_flux2(ctx: WorkerContext, request: Inputs) -> Output:
    """One forward on every rank; rank 0 returns the full output."""
    model = ctx.resident.require()
    with torch.inference_mode():
        out = model(**ModelInputs(request.inputs).as_kwargs(), return_dict=request.return_dict)
    sample = out.sample if request.return_dict else out[0]
    return Output(ctx.rank, sample.cpu() if ctx.rank == 0 else None, type=type(out).__name__)
