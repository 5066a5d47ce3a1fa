"""FLUX.1's VAE (ae.safetensors): diffusers' AutoencoderKL, 16 latent channels, no quant convs, ldm keys.

ComfyUI builds it as `AutoencodingEngine` with comfy/ldm/modules/diffusionmodules/model.py's Encoder and
Decoder (comfy/sd.py VAE, `decoder.conv_in.weight` without `post_quant_conv`). diffusers' AutoencoderKL
computes the same: GroupNorm(32, eps 1e-6), SiLU, nearest x2 upsampling, the encoder's (0, 1, 0, 1) zero pad
before each stride-2 convolution, one-head mid-block attention scaled by 1/sqrt(channels) (ComfyUI's
`vae_attention` and diffusers' AttnProcessor2_0 both call torch's SDPA; ComfyUI's q/k/v are 1x1 convs,
diffusers' linears, the same products). The test tier checks the decode and encode against ComfyUI's own
within 1e-4 (tests/comfy/test_comfy_vae.py).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from ..vae.kind import VaeKind, VaePlannerFacts
from ..vae.ldm import convert_kl, is_ldm_kl, kl_config

RELEASED = {  # ae.safetensors (black-forest-labs/FLUX.1-dev, vae/config.json)
    "in_channels": 3, "out_channels": 3, "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4, "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2, "latent_channels": 16, "norm_num_groups": 32, "use_quant_conv": False,
    "use_post_quant_conv": False,
}  # fmt: skip


def build_vae(config: Mapping[str, Any], device: Any = "cpu", dtype: Any = None) -> Any:
    from diffusers import AutoencoderKL

    from ..family import build_diffusers

    return build_diffusers(AutoencoderKL, config, device=device, dtype=dtype, seed=None)


def matches(keys: Collection[str]) -> bool:
    return is_ldm_kl(keys) and "bn.running_mean" not in keys


FLUX1_VAE = VaeKind(
    name="flux1-vae",
    title="FLUX.1's VAE (ae.safetensors; any ldm AutoencoderKL file)",
    diffusers_class="AutoencoderKL",
    build=build_vae,
    matches=matches,
    config_from_shapes=kl_config,
    convert=convert_kl,
    latent_channels=lambda config: int(config["latent_channels"]),
    downscale=8,
    released=RELEASED,
    # live full-resolution maps at a band's peak: torch's MemTracker on the meta device, 512 px, 1 and 4
    # ranks, the released config (`bench vae`), in float32 and in bfloat16
    planner=VaePlannerFacts(decode_units=6.0, encode_units=5.1, decode_units_half=7.0, encode_units_half=5.0),
    widths=lambda c: (c["block_out_channels"][0], c["block_out_channels"][-1]),
)
