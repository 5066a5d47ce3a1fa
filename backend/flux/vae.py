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
    # MemTracker on the meta device (`python -m rocm_parallel bench vae --calibrate`)
    planner=VaePlannerFacts(decode_units=4.0, encode_units=4.0),
    widths=lambda c: (c["block_out_channels"][0], c["block_out_channels"][-1]),
)
