"""The parallel machinery every family uses: tensor parallelism (tensor.py), context parallelism
(context.py, lse.py), fp8-resident weights (weights.py), collectives counting (comm.py). The plans are the
families' (backend/flux/tp.py, backend/flux2/tp.py)."""

from .tensor import apply_tensor_parallel, parameter_bytes

__all__ = ["apply_tensor_parallel", "parameter_bytes"]
