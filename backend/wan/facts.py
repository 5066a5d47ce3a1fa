"""Wan's facts that need no torch: the released configs, dims from a config and back, the patch and ComfyUI's
latent formats. The family's record (family.py) and `plan` read them without importing the model, its
checkpoint layout or its call (ModelFamily.parts); those modules import them from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..config import ModelDims
from ..family import LatentFormat

PATCH = (1, 2, 2)  # latent (frames, rows, columns) per token: the patch embedding's Conv3d kernel

HEAD_DIM = 128  # ComfyUI: num_heads = dim // 128 for every Wan it loads
IMAGE_DIM = 1280  # CLIP-H's penultimate states (ComfyUI's MLPProj(1280, dim))

WAN21_T2V_1_3B: dict[str, Any] = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 12,
    "attention_head_dim": HEAD_DIM,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 8960,
    "num_layers": 30,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "image_dim": None,
    "added_kv_proj_dim": None,
    "rope_max_seq_len": 1024,
    "pos_embed_seq_len": None,
}
WAN21_T2V_14B: dict[str, Any] = {
    **WAN21_T2V_1_3B,
    "num_attention_heads": 40,
    "ffn_dim": 13824,
    "num_layers": 40,
}
WAN21_I2V_14B: dict[str, Any] = {
    **WAN21_T2V_14B,
    "in_channels": 36,
    "image_dim": IMAGE_DIM,
    "added_kv_proj_dim": 40 * HEAD_DIM,
}
WAN22_I2V_A14B: dict[str, Any] = {**WAN21_T2V_14B, "in_channels": 36}
WAN22_TI2V_5B: dict[str, Any] = {
    **WAN21_T2V_1_3B,
    "num_attention_heads": 24,
    "in_channels": 48,
    "out_channels": 48,
    "ffn_dim": 14336,
    "num_layers": 30,
}


# comfy/latent_formats.py Wan21 (Wan 2.1 VAE, also Wan 2.2 A14B's) and Wan22 (Wan 2.2 VAE, TI2V-5B)
WAN21_LATENT = LatentFormat(
    comfy_name="Wan21",
    channels=16,
    scale=1.0,
    shift=0.0,
    downscale=8,
    vae="the Wan 2.1 VAE (wan_2.1_vae.safetensors)",
    empty_node="EmptyHunyuanLatentVideo",
    mean=(-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
          0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921),
    std=(2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
         3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160),
    dimensions=3,
    temporal_downscale=4,
)  # fmt: skip
WAN22_LATENT = LatentFormat(
    comfy_name="Wan22",
    channels=48,
    scale=1.0,
    shift=0.0,
    downscale=16,
    vae="the Wan 2.2 VAE (wan2.2_vae.safetensors)",
    empty_node="Wan22ImageToVideoLatent",
    mean=(-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
          -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
          -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
          -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
          -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
          0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667),
    std=(0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
         0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
         0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
         0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
         0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
         0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744),
    dimensions=3,
    temporal_downscale=4,
)  # fmt: skip


@dataclass(frozen=True)
class WanDims(ModelDims):
    """ModelDims plus Wan's block count, its channels in and out and whether it has the I2V image branch."""

    blocks: int = 0
    in_channels: int = 16
    out_channels: int = 16
    image: bool = False


def dims(config: Mapping[str, Any]) -> WanDims:
    """The shape facts of a WanTransformer3DModel config: GELU MLPs of `ffn_dim`, umt5's text width."""
    heads, head_dim = int(config["num_attention_heads"]), int(config["attention_head_dim"])
    out = int(config.get("out_channels") or config["in_channels"])
    return WanDims(
        heads=heads,
        head_dim=head_dim,
        mlp=int(config["ffn_dim"]),
        text_dim=int(config["text_dim"]),
        token_channels=out * PATCH[0] * PATCH[1] * PATCH[2],
        blocks=int(config["num_layers"]),
        in_channels=int(config["in_channels"]),
        out_channels=out,
        image=config.get("image_dim") is not None,
    )


def config_from_dims(dims: WanDims) -> dict[str, Any]:
    """A WanTransformer3DModel config with these dims (the planner builds its meta model from it)."""
    image = getattr(dims, "image", False)
    return {
        **WAN21_T2V_1_3B,
        "num_attention_heads": dims.heads,
        "attention_head_dim": dims.head_dim,
        "in_channels": getattr(dims, "in_channels", dims.token_channels // 4),
        "out_channels": getattr(dims, "out_channels", dims.token_channels // 4),
        "text_dim": dims.text_dim,
        "ffn_dim": dims.mlp,
        "num_layers": getattr(dims, "blocks", 0),
        "image_dim": 1280 if image else None,
        "added_kv_proj_dim": dims.hidden if image else None,
    }


__all__ = [
    "HEAD_DIM",
    "IMAGE_DIM",
    "PATCH",
    "WAN21_I2V_14B",
    "WAN21_LATENT",
    "WAN21_T2V_1_3B",
    "WAN21_T2V_14B",
    "WAN22_I2V_A14B",
    "WAN22_LATENT",
    "WAN22_TI2V_5B",
    "WanDims",
    "config_from_dims",
    "dims",
]
