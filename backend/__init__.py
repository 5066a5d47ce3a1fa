"""The pack's engine. Never imports ComfyUI; imports torch lazily where it can so that the nodes load fast.

Its rooms: `runtime/` (the worker group: start, workers, transport, liveness, cancel, pre-flight; it imports
no model code), `resident/` (what every resident model shares: slots, status, eviction, host placement),
`diffusion/` (the diffusion model's job: the API, the checks, the service), `encoders/` and `vae/` (the
text encoders' and the VAE's), the families' folders, `parallel/`, `plan/` and `checkpoint/`.
docs/architecture.md draws them.
"""

from .runtime import preflight as _preflight


def _gloo_cost(devices: int, gbps: float, latency_us: float) -> str:
    from .diffusion.auto import gloo_cost  # the planner: imported when a group on gloo asks

    return gloo_cost(devices, gbps, latency_us)


_preflight.PRICES.append(_gloo_cost)  # the runtime's group says what gloo costs (runtime/preflight.py)
