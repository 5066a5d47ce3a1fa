"""Methods the context-parallel tests run inside the workers (`WorkerGroup(methods=["cp_checks"])`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rocm_parallel.backend.runtime.transport import record
from rocm_parallel.backend.runtime.worker import handler


@record
@dataclass(frozen=True)
class ContextState:
    rank: int
    kernel: str
    lse_shape: Any
    processors: tuple[str, ...]
    padding_left: bool
    routed: int  # all-gathers diffusers routed through host memory so far (-1: the route is not installed)


@record
@dataclass(frozen=True)
class Route:
    through_host: bool


@handler("context_state")
def context_state(ctx: Any) -> ContextState:
    """What apply_context_parallel chose on this rank: kernel, LSE guard layout, processors installed."""
    model = ctx.resident.require()
    state = model._rp_context_state
    processors = {type(m.processor).__name__ for m in model.modules() if getattr(m, "processor", None)}
    return ContextState(
        rank=ctx.rank,
        kernel=state.kernel.name,
        lse_shape=state.lse_shape,
        processors=tuple(sorted(processors)),
        padding_left=state.padding is not None,
        routed=_routed(),
    )


def _routed() -> int:
    from diffusers.models import attention_dispatch

    from rocm_parallel.backend.parallel.comm import HostGatherFuncol

    stand_in = attention_dispatch.funcol
    return stand_in.routed if isinstance(stand_in, HostGatherFuncol) else -1


@handler("route_collectives_through_host", Route)
def route_collectives_through_host(ctx: Any, request: Route) -> None:
    """Models made context-parallel from now on gather through host memory as they do on a GPU over gloo
    (comm.collectives_need_host), so the route runs on CPU; False undoes it, stand-in included."""
    import importlib

    import torch.distributed._functional_collectives as funcol

    from rocm_parallel.backend.parallel import comm, context

    context.collectives_need_host = (
        (lambda backend, device: True) if request.through_host else comm.collectives_need_host
    )
    if not request.through_host:
        for name in comm.DIFFUSERS_GATHERING_MODULES:
            importlib.import_module(name).funcol = funcol
