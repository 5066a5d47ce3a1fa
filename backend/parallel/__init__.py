"""Parallel layouts for FLUX: tensor parallelism (tensor.py)."""

from .tensor import FLUX_TP_PLAN, apply_tensor_parallel, parameter_bytes

__all__ = ["FLUX_TP_PLAN", "apply_tensor_parallel", "parameter_bytes"]
