"""FLUX.2 transformer configurations (the released checkpoints') and the builder (diffusers'
Flux2Transformer2DModel).

Sources (checked 2026-11-22):
* diffusers 0.42.1 `models/transformers/transformer_flux2.py`: the defaults of
  `Flux2Transformer2DModel.__init__` are FLUX.2 [dev]: 8 double + 48 single blocks, 48 heads x 128
  (hidden 6144), joint_attention_dim 15360 (Mistral-3-Small features, 3 layers x 5120), in_channels 128,
  mlp_ratio 3 (SwiGLU), RoPE axes (32, 32, 32, 32) with theta 2000, no biases, guidance embedder.
* diffusers `scripts/convert_flux2_to_diffusers.py` ("klein-4b" / "klein-9b"): [klein] 4B is 5 + 20
  blocks, 24 heads, joint_attention_dim 7680 (Qwen3-4B, 3 x 2560); [klein] 9B is 8 + 24 blocks,
  32 heads, 12288 (Qwen3-8B, 3 x 4096); both without a guidance embedder.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..family import build_diffusers
from .facts import FLUX2_DEV, FLUX2_KLEIN_4B, FLUX2_KLEIN_9B  # torch-free: plan reads them


def build_flux2(
    config: dict[str, Any],
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int | None = 0,
    init_scale: float = 0.05,
) -> nn.Module:
    """diffusers' Flux2Transformer2DModel; random weights from `seed` (drawn on CPU), none on 'meta'."""
    from diffusers import Flux2Transformer2DModel

    return build_diffusers(Flux2Transformer2DModel, config, device, dtype, seed, init_scale)


__all__ = ["FLUX2_DEV", "FLUX2_KLEIN_4B", "FLUX2_KLEIN_9B", "build_flux2"]
