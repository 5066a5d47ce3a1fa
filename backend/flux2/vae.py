"""FLUX.2's VAE (flux2-vae.safetensors): diffusers' AutoencoderKLFlux2, ldm keys plus batch-norm statistics.

ComfyUI builds it as comfy/ldm/models/autoencoder.py `AutoencoderKL` with `batch_norm_latent`: its LATENT is
the 32-channel latent cut into 2 x 2 patches (128 channels at 1/16 of the pixels) and normalised by the
file's running mean and variance (eps 1e-4). Its decode undoes that first (z * sqrt(var + eps) + mean, then
the patches back to rows and columns), its encode does it last (F.batch_norm with the running statistics);
diffusers' AutoencoderKLFlux2 holds the same statistics but leaves both steps to its pipeline, so
`to_model` / `from_model` repeat ComfyUI's, in its operation order. The rest is the ldm encoder and decoder
(backend/flux/vae.py says why diffusers' computes the same numbers).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch

from ..vae.kind import VaeKind, VaePlannerFacts
from ..vae.ldm import convert_kl, is_ldm_kl, kl_config

PATCH = 2  # comfy/ldm/models/autoencoder.py: self.ps = [2, 2]


RELEASED = {  # flux2-vae.safetensors (black-forest-labs/FLUX.2-dev, vae/config.json)
    "in_channels": 3, "out_channels": 3, "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4, "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2, "latent_channels": 32, "norm_num_groups": 32, "use_quant_conv": True,
    "use_post_quant_conv": True,
}  # fmt: skip


def build_vae(config: Mapping[str, Any], device: Any = "cpu", dtype: Any = None) -> Any:
    from diffusers import AutoencoderKLFlux2

    from ..family import build_diffusers

    return build_diffusers(AutoencoderKLFlux2, config, device=device, dtype=dtype, seed=None)


def matches(keys: Collection[str]) -> bool:
    return is_ldm_kl(keys) and "bn.running_mean" in keys


def _statistics(model: Any, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    bn = model.bn
    return bn.running_mean.to(z.device, z.dtype), bn.running_var.to(z.device, z.dtype)


def to_model(model: Any, z: torch.Tensor) -> torch.Tensor:
    """ComfyUI's 128-channel latent -> the decoder's 32 channels at twice the rows and columns."""
    mean, var = _statistics(model, z)
    view = (1, -1, 1, 1)
    z = z * torch.sqrt(var.view(view) + model.bn.eps) + mean.view(view)
    b, c, h, w = z.shape
    z = z.reshape(b, c // (PATCH * PATCH), PATCH, PATCH, h, w)  # "... (c pi pj) i j -> ... c (i pi) (j pj)"
    return z.permute(0, 1, 4, 2, 5, 3).reshape(b, c // (PATCH * PATCH), h * PATCH, w * PATCH)


def from_model(model: Any, z: torch.Tensor) -> torch.Tensor:
    """The encoder's 32-channel mean -> ComfyUI's normalised 128-channel latent."""
    b, c, h, w = z.shape
    z = z.reshape(b, c, h // PATCH, PATCH, w // PATCH, PATCH).permute(0, 1, 3, 5, 2, 4)
    z = z.reshape(b, c * PATCH * PATCH, h // PATCH, w // PATCH)
    mean, var = _statistics(model, z)
    return torch.nn.functional.batch_norm(z, mean, var, momentum=model.bn.momentum, eps=model.bn.eps)


FLUX2_VAE = VaeKind(
    name="flux2-vae",
    title="FLUX.2's VAE (flux2-vae.safetensors)",
    diffusers_class="AutoencoderKLFlux2",
    build=build_vae,
    matches=matches,
    config_from_shapes=kl_config,
    convert=lambda state, config: convert_kl(state, config, keep=("bn.",)),
    latent_channels=lambda config: int(config["latent_channels"]) * PATCH * PATCH,
    downscale=16,
    released=RELEASED,
    # live full-resolution maps at a band's peak: torch's MemTracker on the meta device, 512 px, 1 and 4
    # ranks, the released config (`bench vae`), in float32 and in bfloat16
    planner=VaePlannerFacts(decode_units=6.0, encode_units=5.1, decode_units_half=7.0, encode_units_half=5.0),
    widths=lambda c: (c["block_out_channels"][0], c["block_out_channels"][-1]),
    to_model=to_model,
    from_model=from_model,
)
