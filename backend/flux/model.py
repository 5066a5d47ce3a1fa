"""FLUX.1 transformer configurations (the released checkpoints') and the builder."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..family import build_diffusers

# diffusers `FluxTransformer2DModel` configs of the released checkpoints (black-forest-labs/FLUX.1-*).
FLUX_DEV: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}
FLUX_SCHNELL: dict[str, Any] = {**FLUX_DEV, "guidance_embeds": False}
# FLUX.1 Fill [dev]: the masked image (16) and the 8x8 mask (64) enter with the latent (16), 2x2 patched.
FLUX_FILL: dict[str, Any] = {**FLUX_DEV, "in_channels": 384, "out_channels": 64}


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
