"""Methods the context-parallel tests run inside the workers (`WorkerGroup(methods=["cp_checks"])`)."""

from __future__ import annotations

from typing import Any

from rocm_parallel.backend.worker import handler


@handler("context_state")
def context_state(ctx: Any) -> dict[str, Any]:
    """What apply_context_parallel chose on this rank: kernel, LSE guard layout, processors installed."""
    model = ctx.resident.require()
    state = model._rp_context_state
    processors = {type(m.processor).__name__ for m in model.modules() if getattr(m, "processor", None)}
    return {
        "rank": ctx.rank,
        "kernel": state.kernel.name,
        "lse_shape": state.lse_shape,
        "processors": sorted(processors),
        "padding_left": state.padding is not None,
    }
