"""Qwen-Image's facts that need no torch: the released configs, dims from a config and back, the patch, the
reference placements and ComfyUI's latent format. The family's record (family.py) and `plan` read them
without importing the model, its checkpoint layout or its call (ModelFamily.parts); those modules import
them from here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..config import ModelDims
from ..wan.facts import WAN21_LATENT

QWEN_IMAGE: dict[str, Any] = {
    "patch_size": 2,
    "in_channels": 64,
    "out_channels": 16,
    "num_layers": 60,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 3584,
    "guidance_embeds": False,
    "axes_dims_rope": (16, 56, 56),
}
QWEN_IMAGE_EDIT_2511: dict[str, Any] = {**QWEN_IMAGE, "zero_cond_t": True}

PATCH = 2
REF_METHODS = ("index", "offset", "uxo", "negative_index", "index_timestep_zero")
# ComfyUI's marker of an Edit-2511 file (an empty tensor: no weights), a buffer of its QwenImage model.
TIMESTEP_ZERO_MARKER = "__index_timestep_zero__"

# comfy/latent_formats.py Wan21 (0.3.75 and 0.33.0), the same numbers as diffusers' AutoencoderKLQwenImage
# config `latents_mean` / `latents_std`: Wan 2.1's latent format at one frame, with Qwen-Image's VAE and node.
LATENT = dataclasses.replace(
    WAN21_LATENT,
    vae="the Qwen-Image VAE (qwen_image_vae.safetensors)",
    empty_node="EmptySD3LatentImage",
    temporal_downscale=1,
)


def rope_axes(head_dim: int) -> tuple[int, int, int]:
    """RoPE axes (frame, row, column) for a head width: the released (16, 56, 56) of 128, in proportion for
    small models. Every axis is even and they sum to head_dim."""
    b = (head_dim - head_dim // 8) // 4 * 2
    return (head_dim - 2 * b, b, b)


@dataclass(frozen=True)
class QwenDims(ModelDims):
    """ModelDims plus Qwen-Image's block count (dual-stream blocks only)."""

    blocks: int = 0


def dims(config: Mapping[str, Any]) -> QwenDims:
    """The shape facts of a QwenImageTransformer2DModel config: dual-stream blocks only, GELU MLPs 4 x
    hidden, no pooled text vector, no guidance embedder."""
    heads, head_dim = int(config["num_attention_heads"]), int(config["attention_head_dim"])
    return QwenDims(
        heads=heads,
        head_dim=head_dim,
        mlp=4 * heads * head_dim,
        text_dim=int(config["joint_attention_dim"]),
        token_channels=int(config["in_channels"]),
        blocks=int(config["num_layers"]),
    )


def config_from_dims(dims: QwenDims) -> dict[str, Any]:
    """A QwenImageTransformer2DModel config with these dims (the planner builds its meta model from it)."""
    return {
        **QWEN_IMAGE,
        "in_channels": dims.token_channels,
        "num_layers": dims.blocks,
        "attention_head_dim": dims.head_dim,
        "num_attention_heads": dims.heads,
        "joint_attention_dim": dims.text_dim,
        "axes_dims_rope": rope_axes(dims.head_dim),
    }


__all__ = [
    "LATENT",
    "PATCH",
    "QWEN_IMAGE",
    "QWEN_IMAGE_EDIT_2511",
    "REF_METHODS",
    "TIMESTEP_ZERO_MARKER",
    "QwenDims",
    "config_from_dims",
    "dims",
    "rope_axes",
]
