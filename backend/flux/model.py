"""FLUX.1 transformer configurations (the released checkpoints') and the builder."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..family import build_diffusers
from .facts import FLUX_DEV, FLUX_FILL, FLUX_SCHNELL  # the released configs (torch-free: plan reads them)


def build_flux(
    config: dict[str, Any],
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int | None = 0,
    init_scale: float = 0.05,
) -> nn.Module:
    """diffusers' FluxTransformer2DModel; random weights when `seed` is set (drawn on the CPU, so every
    process builds the identical model), none on 'meta' (family.build_diffusers)."""
    from diffusers import FluxTransformer2DModel

    return build_diffusers(FluxTransformer2DModel, config, device, dtype, seed, init_scale)


__all__ = ["FLUX_DEV", "FLUX_FILL", "FLUX_SCHNELL", "build_flux"]
