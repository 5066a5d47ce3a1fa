"""Whether a tensor holds only finite values: one check for the loader, every model call and every step.

`torch.aminmax` is one vectorised pass with no temporary; `torch.isfinite(t).all()` allocates a bool mask
of the tensor's size first and runs 5-15x slower on a CPU (a 1024x1024 latent, 1 MB: 0.7-1.3 ms against
0.05-0.3 ms, one thread; two of them per model call were half the caller's time in `bench call`). NaN
propagates into both ends of aminmax and an inf is one of them, so both ends finite means all finite.
"""

from __future__ import annotations

import torch

from ..parallel.weights import is_fp8

CHUNK = 1 << 26  # elements per pass: bounds the float16 copy an fp8 tensor is checked in (no fp8 min/max)


def all_finite(tensor: torch.Tensor) -> bool:
    """True when `tensor` holds no NaN or inf (always for integer and empty tensors)."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    flat = tensor.detach().reshape(-1)
    for start in range(0, flat.numel(), CHUNK):
        chunk = flat[start : start + CHUNK]
        if is_fp8(chunk.dtype):
            chunk = chunk.to(torch.float16)  # holds every fp8 value, and its NaN, exactly
        ends = torch.stack(torch.aminmax(chunk))
        if not bool(torch.isfinite(ends).all()):  # one device sync for both ends
            return False
    return True


def non_finite_kind(tensor: torch.Tensor) -> str:
    """'NaN' or 'inf', for a message about a tensor `all_finite` refused (a slow path, run once)."""
    values = tensor.detach().to(torch.float16) if is_fp8(tensor.dtype) else tensor.detach()
    return "NaN" if bool(torch.isnan(values).any()) else "inf"
