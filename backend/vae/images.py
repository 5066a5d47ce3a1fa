"""ComfyUI's VAE arithmetic around a decode and an encode (comfy/sd.py `VAE.decode` / `VAE.encode`), repeated
here because the backend never imports ComfyUI:

* decode: a 5-D latent for a 2-D VAE keeps its first frame; the VAE's output is cast to float32 (ComfyUI's
  intermediate dtype), then `process_output`: (x + 1) / 2 clamped to 0..1, channels last
  ([B, H, W, C], or [B, T, H, W, C] for a 3-D VAE: VAE Decode folds T into the batch);
* encode: `vae_encode_crop_pixels` (each side cropped to a multiple of the downscale, centred; channels
  beyond the VAE's dropped), channels first, `process_input` (x * 2 - 1), the VAE's dtype; a 3-D VAE takes
  the batch of images as the frames of one video ([1, C, B, H, W]).
"""

from __future__ import annotations

import torch

from ..config import ConfigError
from .kind import VaeKind


def decoder_input(kind: VaeKind, samples: torch.Tensor) -> torch.Tensor:
    """ComfyUI's LATENT samples as its VAE decodes them (a 2-D VAE given a 5-D latent takes frame 0)."""
    if not kind.frames and samples.ndim == 5:
        samples = samples[:, :, 0]
    return samples


def decoded_image(x: torch.Tensor) -> torch.Tensor:
    """The VAE's output [B, C, (T,) H, W] as ComfyUI's VAE Decode returns it: float32, 0..1, channels last."""
    return (x.to(torch.float32) + 1.0).div_(2.0).clamp_(0.0, 1.0).movedim(1, -1)


def crop_pixels(kind: VaeKind, pixels: torch.Tensor) -> torch.Tensor:
    """comfy/sd.py `vae_encode_crop_pixels`: [B, H, W, C] cropped to whole latent pixels, centred, and to
    the VAE's image channels."""
    ratio = kind.downscale
    for d in range(1, pixels.ndim - 1):
        size = pixels.shape[d]
        whole = (size // ratio) * ratio
        if whole != size:
            pixels = pixels.narrow(d, (size % ratio) // 2, whole)
    if pixels.shape[-1] > kind.image_channels:
        pixels = pixels[..., : kind.image_channels]
    elif pixels.shape[-1] < kind.image_channels:
        raise ConfigError(
            f"the image has {pixels.shape[-1]} channels; {kind.title} encodes {kind.image_channels}: "
            "convert it to RGB first"
        )
    return pixels


def encoder_input(kind: VaeKind, pixels: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """ComfyUI's IMAGE [B, H, W, C] (cropped) as its VAE encodes it: channels first, x * 2 - 1, in `dtype`;
    a 3-D VAE's batch becomes the frames of one video."""
    x = pixels.movedim(-1, 1)
    if kind.frames and x.ndim == 4:
        x = x.movedim(1, 0).unsqueeze(0)
    return (x * 2.0 - 1.0).to(dtype)


__all__ = ["crop_pixels", "decoded_image", "decoder_input", "encoder_input"]
