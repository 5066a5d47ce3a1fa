"""Methods the loading tests run inside the workers (`WorkerGroup(methods=["load_checks"])`)."""

from __future__ import annotations

from typing import Any

from rocm_parallel.backend.checkpoint import load_model
from rocm_parallel.backend.parallel.tensor import parameter_bytes
from rocm_parallel.backend.worker import handler


@handler("load_shards")
def load_shards(ctx: Any, path: str, dtype: str, tp: int) -> dict[str, Any]:
    """What a worker will do: load its own shard onto its device and keep it resident for `forward`."""
    ctx.resident.clear()
    model = load_model(path, device=ctx.device, dtype=dtype, tp=tp)
    ctx.resident.set(model, {"checkpoint": path, "dtype": dtype, "tp": tp})
    return {"rank": ctx.rank, "parameter_bytes": parameter_bytes(model)}


@handler("resident_state")
def resident_state(ctx: Any) -> dict[str, Any]:
    """This rank's resident weights (its shard), on the CPU: what the LoRA tests compare bit for bit."""
    model = ctx.resident.require()
    return {"rank": ctx.rank, "state": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}}
