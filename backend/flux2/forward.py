"""One FLUX.2 model call as ComfyUI makes it (comfy/ldm/flux/model.py `Flux._forward` with FLUX.2's
params, read 2026-11-22), over diffusers' Flux2Transformer2DModel.

ComfyUI's FLUX.2 (comfy/model_detection.py: image_model "flux2", patch_size 1, axes_dim (32, 32, 32, 32),
txt_ids_dims [3], default_ref_method "index", ref_index_scale 10): the latent is already 128 channels at
1/16 of the pixels (comfy/latent_formats.py `Flux2`: latent_channels 128, spacial_downscale_ratio 16,
no scale or shift), so a patch is one latent pixel and nothing is padded. Image ids are (index, row,
column, 0), text ids (0, 0, 0, position). Reference latents (ReferenceLatent) become extra image tokens
after x's; with "index" the k-th has index 10k at the origin. The text is padded to 512 tokens before
this call, by `model_base.Flux2.extra_conds` (left padding with zeros), not here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..flux.forward import reference_placements as flux1_placements

# model_fn(hidden_states, encoder_hidden_states, pooled (unused by FLUX.2), timestep, img_ids, txt_ids,
# guidance) -> velocity tokens; the contract FLUX.1's flux_call uses, so the service calls both alike.
ModelFn = Callable[..., torch.Tensor]

REF_INDEX_SCALE = 10.0  # comfy/model_detection.py flux2 `ref_index_scale`
REF_METHODS = ("index", "offset", "uxo")


def flux2_ids(
    height: int, width: int, index: float = 0.0, h_offset: int = 0, w_offset: int = 0
) -> torch.Tensor:
    """`Flux.process_img` ids with patch size 1: (index, row + h_offset, column + w_offset, 0)."""
    ids = torch.zeros(height, width, 4)
    ids[..., 0] = index
    ids[..., 1] = torch.arange(h_offset, h_offset + height, dtype=torch.float32)[:, None]
    ids[..., 2] = torch.arange(w_offset, w_offset + width, dtype=torch.float32)[None, :]
    return ids.reshape(height * width, 4)


def flux2_text_ids(tokens: int) -> torch.Tensor:
    """ComfyUI's FLUX.2 text ids: the 4th axis counts the tokens (txt_ids_dims [3])."""
    ids = torch.zeros(tokens, 4)
    ids[:, 3] = torch.arange(tokens, dtype=torch.float32)
    return ids


def reference_placements(
    height: int, width: int, refs: Sequence[tuple[int, int]], method: str = "index"
) -> list[tuple[float, int, int]]:
    """(index, h_offset, w_offset) of each reference: `Flux._forward`'s loop (FLUX.1's, shared) with
    patch size 1 and FLUX.2's index steps."""
    return flux1_placements(height, width, refs, method, patch=1, index_step=REF_INDEX_SCALE)


def tokens_of(latent: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, H*W, C] (rearrange "b c h w -> b (h w) c")."""
    return latent.flatten(2).transpose(1, 2)


def flux2_call(
    model_fn: ModelFn,
    x: torch.Tensor,
    timestep: torch.Tensor,
    context: torch.Tensor,
    pooled: torch.Tensor | None,
    guidance: torch.Tensor | None,
    ref_latents: Sequence[torch.Tensor] = (),
    ref_method: str = "index",
) -> torch.Tensor:
    """ComfyUI's FLUX.2 `Flux.forward(x, timestep, context, None, guidance, ref_latents, ...)`.

    x: [B, 128, H, W] in sampler space; context: [B, T, joint_attention_dim]. Returns [B, 128, H, W].
    """
    b, _, h, w = x.shape
    img = tokens_of(x)
    img_ids = flux2_ids(h, w).to(x.device)
    if ref_latents:
        sizes = [(r.shape[-2], r.shape[-1]) for r in ref_latents]
        placed = reference_placements(h, w, sizes, ref_method)
        img = torch.cat([img, *(tokens_of(r.to(img.dtype)) for r in ref_latents)], dim=1)
        ids = [flux2_ids(rh, rw, *p) for (rh, rw), p in zip(sizes, placed, strict=True)]
        img_ids = torch.cat([img_ids, *(i.to(x.device) for i in ids)], dim=0)
    txt_ids = flux2_text_ids(context.shape[1]).to(x.device)
    out = model_fn(img, context, pooled, timestep, img_ids, txt_ids, guidance)
    return out[:, : h * w].transpose(1, 2).reshape(b, -1, h, w)


def flux2_model_fn(model: torch.nn.Module) -> ModelFn:
    """Adapt diffusers' Flux2Transformer2DModel to the `model_fn` contract (no pooled projection)."""

    @torch.no_grad()
    def model_fn(hidden_states, encoder_hidden_states, pooled, timestep, img_ids, txt_ids, guidance):
        return model(
            hidden_states=hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            timestep=timestep,
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=guidance,
            return_dict=False,
        )[0]

    return model_fn
