"""FLUX.1's facts that need no torch: the released configs, dims from a config and back, the patch, the
reference placements and ComfyUI's latent format. The family's record (family.py) and `plan` read them
without importing the model, its checkpoint layout or its call (ModelFamily.parts); those modules import
them from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..config import ConfigError
from ..family import LatentFormat
from .dims import FluxDims

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

PATCH = 2  # ComfyUI's FLUX patchify: 2 x 2 latent pixels per token

# ComfyUI's `ref_latents_method` values (comfy_extras/nodes_flux.py FluxKontextMultiReferenceLatentMethod;
# the node maps "uso" to "uxo"); comfy/ldm/flux/model.py treats anything else as "offset".
REF_METHODS = ("offset", "index", "uxo")

# comfy/latent_formats.py `Flux`.
LATENT_CHANNELS = 16
SHIFT_FACTOR = 0.1159
SCALE_FACTOR = 0.3611
LATENT = LatentFormat(
    comfy_name="Flux",
    channels=16,
    scale=SCALE_FACTOR,
    shift=SHIFT_FACTOR,
    downscale=8,
    vae="the FLUX VAE (ae.safetensors)",
    empty_node="EmptySD3LatentImage",
)
VARIANTS = ("dev", "schnell")


def variant(config: Mapping[str, Any]) -> str:
    """'dev' (a guidance embedder: FluxGuidance's value is an input) or 'schnell' (none)."""
    return "dev" if config["guidance_embeds"] else "schnell"


def rope_axes(head_dim: int) -> tuple[int, int, int]:
    """RoPE axes for a head width: FLUX's (16, 56, 56) of 128, the same proportions for small models.

    RoPE has no weights, so a checkpoint cannot tell; every axis is even and they sum to head_dim.
    """
    b = (head_dim - head_dim // 8) // 4 * 2
    return (head_dim - 2 * b, b, b)


def dims(config: Mapping[str, Any]) -> FluxDims:
    """The shape facts of a FluxTransformer2DModel config (mlp_ratio is FLUX.1's built-in 4)."""
    return FluxDims.from_diffusers_config(config)


def config_from_dims(dims: FluxDims) -> dict[str, Any]:
    """A FluxTransformer2DModel config with these dims (the planner builds its meta model from it).

    FluxTransformer2DModel has no MLP-ratio option: dims with another ratio (FLUX.2's 3) are no FLUX.1.
    """
    if dims.mlp_ratio != 4.0:
        raise ConfigError(
            f"FLUX.1's transformer has MLP ratio 4, these dims have {dims.mlp_ratio:g}; "
            "price the model as the family its checkpoint is (CheckpointInfo.family)"
        )
    return {
        "patch_size": 1,
        "in_channels": dims.in_channels,
        "num_layers": dims.double_blocks,
        "num_single_layers": dims.single_blocks,
        "attention_head_dim": dims.head_dim,
        "num_attention_heads": dims.heads,
        "joint_attention_dim": dims.text_dim,
        "pooled_projection_dim": dims.pooled_dim,
        "guidance_embeds": dims.guidance,
        "axes_dims_rope": rope_axes(dims.head_dim),
    }


__all__ = [
    "FLUX_DEV",
    "FLUX_FILL",
    "FLUX_SCHNELL",
    "LATENT",
    "LATENT_CHANNELS",
    "PATCH",
    "REF_METHODS",
    "SCALE_FACTOR",
    "SHIFT_FACTOR",
    "VARIANTS",
    "config_from_dims",
    "dims",
    "rope_axes",
    "variant",
]
