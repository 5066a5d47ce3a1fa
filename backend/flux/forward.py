"""One FLUX model call as ComfyUI makes it: any latent size in, the velocity of the same size out.

ComfyUI's `Flux.forward` (comfy/ldm/flux/model.py, 0.3.64) pads the latent to the 2x2 patch size with
circular padding (`comfy.ldm.common_dit.pad_to_patch_size`), patchifies it, numbers the patches from
0, runs the transformer and crops the output back. diffusers' FluxTransformer2DModel takes the tokens
and ids directly, so this module does ComfyUI's part around it, in ComfyUI's order, for the worker's
`forward` service (every model call of a ComfyUI sampler) and for the built-in Euler loop alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from .facts import PATCH  # torch-free: the family's record reads them

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


def image_ids(latent_height: int, latent_width: int) -> torch.Tensor:
    """Position ids of the 2x2-patched latent: [(H/2)(W/2), 3] with (0, row, column)."""
    h, w = latent_height // 2, latent_width // 2
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    return ids.reshape(h * w, 3)


def text_ids(tokens: int) -> torch.Tensor:
    """Position ids of the text tokens: all zero."""
    return torch.zeros(tokens, 3)


def image_tokens(height: int, width: int) -> int:
    """How many image tokens a latent of height x width becomes (after padding to the patch size)."""
    return ((height + 1) // PATCH) * ((width + 1) // PATCH)


def patch_ids(height: int, width: int, index: int = 0, h_offset: int = 0, w_offset: int = 0) -> torch.Tensor:
    """comfy/ldm/flux/model.py `Flux.process_img` ids of a latent of height x width (any size, padded to
    the patch size): (index, row + h_offset, column + w_offset) per patch, offsets given in latent pixels
    and rounded to patches as ComfyUI does. Float32 like `image_ids` (integers, exact)."""
    h_len, w_len = (height + PATCH // 2) // PATCH, (width + PATCH // 2) // PATCH
    h_off, w_off = (h_offset + PATCH // 2) // PATCH, (w_offset + PATCH // 2) // PATCH
    ids = torch.zeros(h_len, w_len, 3)
    ids[..., 0] = index
    ids[..., 1] = torch.arange(h_off, h_off + h_len, dtype=torch.float32)[:, None]
    ids[..., 2] = torch.arange(w_off, w_off + w_len, dtype=torch.float32)[None, :]
    return ids.reshape(h_len * w_len, 3)


def reference_placements(
    height: int,
    width: int,
    refs: Sequence[tuple[int, int]],
    method: str = "offset",
    patch: int = PATCH,
    index_step: float = 1,
) -> list[tuple[float, int, int]]:
    """(index, h_offset, w_offset) of each reference latent of size (h, w), for a main latent of height x
    width: the loop of comfy/ldm/flux/model.py `Flux._forward` over `ref_latents`, verbatim.

    offset (Kontext's default): index 1, each reference placed right of or below the previous ones,
    whichever keeps the canvas squarer; index: index 1, 2, ... at the origin; uxo: index 0, placed
    diagonally past the main latent. FLUX.2 runs the same loop with `patch` 1 and index steps of 10.
    """
    h_len, w_len = (height + patch // 2) // patch, (width + patch // 2) // patch
    h = w = index = 0
    out = []
    for ref_h, ref_w in refs:
        if method == "index":
            index += index_step
            h_offset = w_offset = 0
        elif method == "uxo":
            index = 0
            h_offset, w_offset = h_len * patch + h, w_len * patch + w
            h += ref_h
            w += ref_w
        else:
            index, h_offset, w_offset = 1, 0, 0
            if ref_h + h > ref_w + w:
                w_offset = w
            else:
                h_offset = h
            h = max(h, ref_h + h_offset)
            w = max(w, ref_w + w_offset)
        out.append((index, h_offset, w_offset))
    return out


def flux_call(
    model_fn: ModelFn,
    x: torch.Tensor,
    timestep: torch.Tensor,
    context: torch.Tensor,
    y: torch.Tensor,
    guidance: torch.Tensor | None = None,
    ref_latents: Sequence[torch.Tensor] = (),
    ref_latents_method: str = "offset",
) -> torch.Tensor:
    """ComfyUI's `Flux.forward(x, timestep, context, y, guidance, ref_latents, ref_latents_method=)` over
    a diffusers `model_fn` (`y`: CLIP-L's pooled vector).

    x: [B, C, H, W] in sampler space, any H and W; C is the latent's 16 plus, for Fill, the masked image
    and mask ComfyUI concatenates (`c_concat`). ref_latents (Kontext's ReferenceLatent, already through
    the latent format's process_in as ComfyUI's `Flux.extra_conds` does): [B, 16, h, w] each, any size;
    they become extra image tokens after x's, with their own ids, and their outputs are dropped.
    Returns the model output [B, out channels, H, W] in the model's dtype (callers cast, as ComfyUI does
    with `.float()`).
    """
    _, _, h, w = x.shape
    padded = pad_to_patch(x)
    ph, pw = padded.shape[-2:]
    img = patchify(padded)
    img_ids = image_ids(ph, pw).to(x.device)
    tokens = img.shape[1]
    if ref_latents:
        sizes = [(r.shape[-2], r.shape[-1]) for r in ref_latents]
        placed = reference_placements(h, w, sizes, ref_latents_method)
        img = torch.cat([img, *(patchify(pad_to_patch(r.to(img.dtype))) for r in ref_latents)], dim=1)
        ids = [patch_ids(rh, rw, *p) for (rh, rw), p in zip(sizes, placed, strict=True)]
        img_ids = torch.cat([img_ids, *(i.to(x.device) for i in ids)], dim=0)
    txt_ids = text_ids(context.shape[1]).to(x.device)
    out = model_fn(img, context, y, timestep, img_ids, txt_ids, guidance)
    return unpatchify(out[:, :tokens], ph, pw)[:, :, :h, :w]
