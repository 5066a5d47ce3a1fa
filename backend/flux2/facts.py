"""FLUX.2's facts that need no torch: the released configs, dims from a config and back, the reference
placements and ComfyUI's latent format. The family's record (family.py) and `plan` read them without
importing the model, its checkpoint layout or its call (ModelFamily.parts); those modules import them
from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..family import LatentFormat
from ..flux.dims import FluxDims

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

TIMESTEP_ZERO = "index_timestep_zero"
# ComfyUI's ref_latents_method values its FLUX.2 runs (the first is FLUX.2's default; comfy/ldm/flux/model.py
# treats anything unknown as "offset", the pack refuses it: backend/diffusion/checks.py)
REF_METHODS = ("index", "offset", "uxo", TIMESTEP_ZERO)

LATENT = LatentFormat(
    comfy_name="Flux2", channels=128, scale=1.0, shift=0.0, downscale=16,
    vae="the FLUX.2 VAE (flux2-vae.safetensors)", empty_node="EmptyFlux2LatentImage",
)  # fmt: skip


def dims(config: Mapping[str, Any]) -> FluxDims:
    """The shape facts of a Flux2Transformer2DModel config (mlp_ratio 3: SwiGLU)."""
    return FluxDims.from_diffusers_config(config)


def config_from_dims(dims: FluxDims) -> dict[str, Any]:
    """A Flux2Transformer2DModel config with these dims (the planner builds its meta model from it)."""
    return {
        **FLUX2_DEV,
        "in_channels": dims.in_channels,
        "num_layers": dims.double_blocks,
        "num_single_layers": dims.single_blocks,
        "attention_head_dim": dims.head_dim,
        "num_attention_heads": dims.heads,
        "joint_attention_dim": dims.text_dim,
        "mlp_ratio": dims.mlp_ratio,
        "axes_dims_rope": (dims.head_dim // 4,) * 4,
        "guidance_embeds": dims.guidance,
    }


__all__ = [
    "FLUX2_DEV",
    "FLUX2_KLEIN_4B",
    "FLUX2_KLEIN_9B",
    "LATENT",
    "REF_METHODS",
    "TIMESTEP_ZERO",
    "config_from_dims",
    "dims",
]
