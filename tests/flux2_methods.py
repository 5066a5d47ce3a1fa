"""FLUX.2 model methods the parity tests run inside the workers (`WorkerGroup(methods=[...])`).

Test-only, plain-data arguments and results, like model_methods.py (which builds FLUX.1).
"""

from __future__ import annotations

from typing import Any

import torch

from rocm_parallel.backend.config import FluxDims, ParallelLayout
from rocm_parallel.backend.flux2.model import build_flux2
from rocm_parallel.backend.parallel.context import apply_context_parallel
from rocm_parallel.backend.parallel.tensor import apply_tensor_parallel, parameter_bytes
from rocm_parallel.backend.worker import WorkerContext, handler
from rocm_parallel.testing.models import ModelInputs


@handler("build_random_flux2")
def build_random_flux2(
    ctx: WorkerContext, config: dict[str, Any], seed: int, tp: int = 1, ring: int = 1, ulysses: int = 1
) -> dict[str, Any]:
    """A float32 FLUX.2 with random weights from `seed` (identical on every rank), parallelised."""
    layout = ParallelLayout(tp=tp, ring=ring, ulysses=ulysses)
    layout.validate(FluxDims.from_diffusers_config(config), devices=ctx.world_size)
    ctx.resident.clear()
    model = build_flux2(config, seed=seed)
    if ring * ulysses > 1:
        apply_context_parallel(model, ring_degree=ring, ulysses_degree=ulysses)
    else:
        apply_tensor_parallel(model)
    ctx.resident.set(
        model, {"random_flux2": config, "seed": seed, "tp": tp, "ring": ring, "ulysses": ulysses}
    )
    return {"rank": ctx.rank, "parameter_bytes": parameter_bytes(model)}


@handler("forward_flux2")
def forward_flux2(ctx: WorkerContext, inputs: dict[str, Any], return_dict: bool = False) -> dict[str, Any]:
    """One forward on every rank; rank 0 returns the full output."""
    model = ctx.resident.require()
    with torch.inference_mode():
        out = model(**ModelInputs(inputs).as_kwargs(), return_dict=return_dict)
    sample = out.sample if return_dict else out[0]
    return {"rank": ctx.rank, "output": sample.cpu() if ctx.rank == 0 else None, "type": type(out).__name__}
