"""Methods the loading tests run inside the workers (`WorkerGroup(methods=["load_checks"])`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from model_methods import Built

from rocm_parallel.backend.checkpoint import load_model
from rocm_parallel.backend.parallel.tensor import parameter_bytes
from rocm_parallel.backend.runtime.transport import record
from rocm_parallel.backend.runtime.worker import handler


@record
@dataclass(frozen=True)
class LoadShards:
    """Load this rank's shard of the checkpoint at `path` (also the resident key)."""

    path: str
    dtype: str
    tp: int


@record
@dataclass(frozen=True)
class ResidentState:
    rank: int
    state: dict[str, torch.Tensor]


@handler("load_shards", LoadShards)
def load_shards(ctx: Any, request: LoadShards) -> Built:
    """What a worker will do: load its own shard onto its device and keep it resident for `forward`."""
    ctx.resident.clear()
    model = load_model(request.path, device=ctx.device, dtype=request.dtype, tp=request.tp)
    ctx.resident.set(model, request)
    return Built(ctx.rank, parameter_bytes(model))


@handler("resident_state")
def resident_state(ctx: Any) -> ResidentState:
    """This rank's resident weights (its shard), on the CPU: what the LoRA tests compare bit for bit."""
    model = ctx.resident.require()
    return ResidentState(ctx.rank, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()})


@record
@dataclass(frozen=True)
class EncoderWeights:
    """This rank's linear weights of the text encoder in `slot`, as held, with their scales."""

    slot: str


@handler("encoder_weights", EncoderWeights)
def encoder_weights(ctx: Any, request: EncoderWeights) -> ResidentState:
    """Every linear weight of the resident encoder as this rank holds it (dtype and slice) and, as
    `<layer>.scale_weight`, the scale it shares with the other ranks."""
    model = ctx.residents[request.slot].model
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            out[f"{name}.weight"] = module.weight.detach().cpu().clone()
            if getattr(module, "scale_weight", None) is not None:
                out[f"{name}.scale_weight"] = module.scale_weight.detach().cpu().clone()
    return ResidentState(ctx.rank, out)
