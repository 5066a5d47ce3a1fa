"""FLUX.2 transformer configurations, builders and inputs (diffusers' Flux2Transformer2DModel).

Sources (checked 2026-11-22):
* diffusers 0.42.1 `models/transformers/transformer_flux2.py`: the defaults of
  `Flux2Transformer2DModel.__init__` are FLUX.2 [dev]: 8 double + 48 single blocks, 48 heads x 128
  (hidden 6144), joint_attention_dim 15360 (Mistral-3-Small features, 3 layers x 5120), in_channels 128,
  mlp_ratio 3 (SwiGLU), RoPE axes (32, 32, 32, 32) with theta 2000, no biases, guidance embedder.
* diffusers `scripts/convert_flux2_to_diffusers.py` ("klein-4b" / "klein-9b"): [klein] 4B is 5 + 20
  blocks, 24 heads, joint_attention_dim 7680 (Qwen3-4B, 3 x 2560); [klein] 9B is 8 + 24 blocks,
  32 heads, 12288 (Qwen3-8B, 3 x 4096); both without a guidance embedder.
* Position ids (diffusers `pipeline_flux2.py`): four axes (t, h, w, l); image tokens (0, row, col, 0),
  text tokens (0, 0, 0, index).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..flux.model import build_random

FLUX2_DEV: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 128,
    "num_layers": 8,
    "num_single_layers": 48,
    "attention_head_dim": 128,
    "num_attention_heads": 48,
    "joint_attention_dim": 15360,
    "timestep_guidance_channels": 256,
    "mlp_ratio": 3.0,
    "axes_dims_rope": (32, 32, 32, 32),
    "rope_theta": 2000,
    "eps": 1e-6,
    "guidance_embeds": True,
}
FLUX2_KLEIN_4B: dict[str, Any] = {
    **FLUX2_DEV,
    "num_layers": 5,
    "num_single_layers": 20,
    "num_attention_heads": 24,
    "joint_attention_dim": 7680,
    "guidance_embeds": False,
}
FLUX2_KLEIN_9B: dict[str, Any] = {
    **FLUX2_DEV,
    "num_layers": 8,
    "num_single_layers": 24,
    "num_attention_heads": 32,
    "joint_attention_dim": 12288,
    "guidance_embeds": False,
}


def tiny_flux2_config(
    heads: int = 4,
    head_dim: int = 16,
    double_blocks: int = 2,
    single_blocks: int = 2,
    guidance: bool = True,
    text_dim: int = 32,
    in_channels: int = 16,
) -> dict[str, Any]:
    """A structurally complete FLUX.2 with small widths (every code path of [dev], in milliseconds).

    RoPE: four even axes summing to head_dim, like [dev]'s (32, 32, 32, 32) of 128.
    """
    if head_dim % 8:
        raise ValueError(f"head_dim={head_dim} must be a multiple of 8 for the 4-axis rotary embedding")
    return {
        **FLUX2_DEV,
        "in_channels": in_channels,
        "num_layers": double_blocks,
        "num_single_layers": single_blocks,
        "attention_head_dim": head_dim,
        "num_attention_heads": heads,
        "joint_attention_dim": text_dim,
        "axes_dims_rope": (head_dim // 4,) * 4,
        "guidance_embeds": guidance,
    }


def build_flux2(
    config: dict[str, Any],
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int | None = 0,
    init_scale: float = 0.05,
) -> nn.Module:
    """diffusers' Flux2Transformer2DModel; random weights from `seed` (drawn on CPU), none on 'meta'."""
    from diffusers import Flux2Transformer2DModel

    return build_random(Flux2Transformer2DModel, config, device, dtype, seed, init_scale)


@dataclass(frozen=True)
class Flux2Inputs:
    """Keyword arguments of one Flux2Transformer2DModel forward."""

    hidden_states: torch.Tensor  # [B, S_img, in_channels]
    encoder_hidden_states: torch.Tensor  # [B, S_txt, joint_attention_dim]
    timestep: torch.Tensor
    img_ids: torch.Tensor  # [S_img, 4]
    txt_ids: torch.Tensor  # [S_txt, 4]
    guidance: torch.Tensor | None

    def as_kwargs(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def to(self, device: str | torch.device, dtype: torch.dtype | None = None) -> Flux2Inputs:
        activations = ("hidden_states", "encoder_hidden_states")
        return Flux2Inputs(
            **{
                k: None if v is None else v.to(device=device, dtype=dtype if k in activations else None)
                for k, v in self.as_kwargs().items()
            }
        )


def flux2_image_ids(rows: int, cols: int) -> torch.Tensor:
    """(t, h, w, l) = (0, row, col, 0) for a rows x cols token grid, row-major."""
    ids = torch.zeros(rows, cols, 4)
    ids[..., 1] = torch.arange(rows)[:, None]
    ids[..., 2] = torch.arange(cols)[None, :]
    return ids.reshape(rows * cols, 4)


def flux2_text_ids(tokens: int) -> torch.Tensor:
    """(t, h, w, l) = (0, 0, 0, index) for each text token."""
    ids = torch.zeros(tokens, 4)
    ids[:, 3] = torch.arange(tokens)
    return ids
