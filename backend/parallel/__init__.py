"""The parallel machinery every family uses: tensor parallelism (tensor.py), context parallelism
(context.py, lse.py), fp8-resident weights (weights.py), collectives counting (comm.py). The plans are the
families' (backend/flux/tp.py, backend/flux2/tp.py)."""

from typing import Any

__all__ = ["apply_tensor_parallel", "parameter_bytes"]


def __getattr__(name: str) -> Any:
    """tensor.py's entry points, imported on first use: importing this package (for the torch-free splits.py
    the planner reads) must not import torch."""
    if name in __all__:
        from . import tensor

        return getattr(tensor, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
