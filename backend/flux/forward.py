"""One FLUX model call as ComfyUI makes it: any latent size in, the velocity of the same size out.

ComfyUI's `Flux.forward` (comfy/ldm/flux/model.py, 0.3.64) pads the latent to the 2x2 patch size with
circular padding (`comfy.ldm.common_dit.pad_to_patch_size`), patchifies it, numbers the patches from
0, runs the transformer and crops the output back. diffusers' FluxTransformer2DModel takes the tokens
and ids directly, so this module does ComfyUI's part around it, in ComfyUI's order, for the worker's
`forward` service (every model call of a ComfyUI sampler) and for the built-in Euler loop alike.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .model import image_ids

PATCH = 2

# model_fn(hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids, guidance)
# -> velocity tokens: exactly diffusers' FluxTransformer2DModel forward (timestep = sigma in [0, 1]).
ModelFn = Callable[..., torch.Tensor]


def pad_to_patch(x: torch.Tensor) -> torch.Tensor:
    """comfy.ldm.common_dit.pad_to_patch_size: wrap around (circular) to a multiple of 2 per side."""
    pad_h, pad_w = (-x.shape[-2]) % PATCH, (-x.shape[-1]) % PATCH
    if not pad_h and not pad_w:
        return x
    return F.pad(x, (0, pad_w, 0, pad_h), mode="circular")


def patchify(latent: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] (even H, W) -> [B, (H/2)(W/2), 4C] with channel order (c, ph, pw), rows first."""
    b, c, h, w = latent.shape
    x = latent.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpatchify(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Inverse of `patchify` for a latent of height x width (both even)."""
    b, _, d = tokens.shape
    c = d // 4
    x = tokens.reshape(b, height // 2, width // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, height, width)


def text_ids(tokens: int) -> torch.Tensor:
    """Position ids of the text tokens: all zero."""
    return torch.zeros(tokens, 3)


def image_tokens(height: int, width: int) -> int:
    """How many image tokens a latent of height x width becomes (after padding to the patch size)."""
    return ((height + 1) // PATCH) * ((width + 1) // PATCH)


def flux_call(
    model_fn: ModelFn,
    x: torch.Tensor,
    timestep: torch.Tensor,
    context: torch.Tensor,
    pooled: torch.Tensor,
    guidance: torch.Tensor | None,
) -> torch.Tensor:
    """ComfyUI's `Flux.forward(x, timestep, context, y, guidance)` over a diffusers `model_fn`.

    x: [B, C, H, W] in sampler space, any H and W; returns the model output [B, C, H, W] in the
    model's dtype (callers cast, as ComfyUI does with `.float()`).
    """
    _, _, h, w = x.shape
    padded = pad_to_patch(x)
    ph, pw = padded.shape[-2:]
    img_ids = image_ids(ph, pw).to(x.device)
    txt_ids = text_ids(context.shape[1]).to(x.device)
    out = model_fn(patchify(padded), context, pooled, timestep, img_ids, txt_ids, guidance)
    return unpatchify(out, ph, pw)[:, :, :h, :w]
