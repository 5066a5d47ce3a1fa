"""One Qwen-Image model call as ComfyUI makes it, over diffusers' QwenImageTransformer2DModel.

ComfyUI's `QwenImageTransformer2DModel._forward` (comfy/ldm/qwen_image/model.py; 0.33.0 lines 436-568,
0.3.75 lines 375-482), in its order:

* x is the Wan 2.1 latent format's 5-D [B, 16, T=1, H, W] (latent_dimensions 3: comfy/sample.py
  `fix_empty_latent_channels` unsqueezes a 4-D empty latent), padded circularly to 2x2 patches and
  patchified with channel order (c, ph, pw). A 4-D latent is taken too and returned 4-D.
* Image ids (index, row - h_len // 2, column - w_len // 2): *centred* positions, h_len = ceil(H / 2).
  diffusers' own QwenEmbedRope centres an odd grid one row off (5 rows: -3..1 where ComfyUI has -2..2)
  and starts the text after the references too, which moves outputs by O(1e-2) on odd sizes; so the family
  replaces `pos_embed` with `ComfyRope`, which computes ComfyUI's angles (comfy/ldm/flux/math.py `rope`:
  omega and angle in float64, then float32) from ComfyUI's ids, handed over through diffusers' `img_shapes`
  argument (`ComfyShapes`: the per-sample shapes diffusers' `modulate_index` reads, plus the ids).
* Reference latents (ReferenceLatent, TextEncodeQwenImageEdit[Plus]; after the latent format's process_in)
  become extra image tokens after x's, each centred on its own grid: "index" (ComfyUI's default) and
  "index_timestep_zero" number them 1, 2, ...; "negative_index" -1, -2, ... (0.33); anything else ("offset",
  "uxo") places them at index 1 right of / below the previous ones. "index_timestep_zero" (0.33, Edit-2511's
  default) modulates the reference tokens at timestep 0: diffusers' `zero_cond_t`, set per call.
* Text ids: txt_start + j on all three axes, txt_start = max(w_len // 2, h_len // 2) of the main latent.
* The text mask (0.33's `attention_mask`; 0.3.75 never passes one): 1 = real token. The caller turns it into
  a boolean key mask (backend/diffusion/checks.py `text_key_mask`); diffusers takes it as `encoder_hidden_states_mask`
  and drops the padded text keys from every attention, as ComfyUI's additive -max mask does.
* timestep: sigma, as ComfyUI passes it (ModelSamplingAuraFlow / ModelSamplingFlux, multiplier 1); both
  models multiply it by 1000 in their sinusoidal embedding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .facts import PATCH, REF_METHODS  # torch-free: the family's record reads them

THETA = 10000.0

# model_fn(hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep, img_shapes, zero_cond_t)
# -> output tokens [B, S_image_and_references, 4 x out channels]
ModelFn = Callable[..., torch.Tensor]


# --------------------------------------------------------------------------------------------------
# ComfyUI's positions


def image_ids(t: int, h: int, w: int, index: float = 0, h_offset: int = 0, w_offset: int = 0) -> torch.Tensor:
    """`process_img` ids of a latent of T x H x W latent pixels (any size, padded to the patch): [T*h*w, 3]."""
    h_len, w_len = (h + PATCH // 2) // PATCH, (w + PATCH // 2) // PATCH
    h_off, w_off = (h_offset + PATCH // 2) // PATCH, (w_offset + PATCH // 2) // PATCH
    ids = torch.zeros(t, h_len, w_len, 3)
    if t > 1:
        ids[..., 0] = torch.arange(t, dtype=torch.float32)[:, None, None]
    else:
        ids[..., 0] = index
    ids[..., 1] = torch.arange(h_off, h_off + h_len, dtype=torch.float32)[None, :, None] - (h_len // 2)
    ids[..., 2] = torch.arange(w_off, w_off + w_len, dtype=torch.float32)[None, None, :] - (w_len // 2)
    return ids.reshape(-1, 3)


def text_ids(tokens: int, h: int, w: int) -> torch.Tensor:
    """The text's ids for a main latent of H x W latent pixels: txt_start + j on every axis."""
    h_len, w_len = (h + PATCH // 2) // PATCH, (w + PATCH // 2) // PATCH
    start = round(max(w_len // 2, h_len // 2))
    return (start + torch.arange(tokens, dtype=torch.float32))[:, None].repeat(1, 3)


def reference_placements(refs: Sequence[tuple[int, int]], method: str) -> list[tuple[int, int, int]]:
    """(index, h_offset, w_offset) per reference of (h, w) latent pixels: `_forward`'s loop (0.33; 0.3.75's
    is the same without the two newer methods, which it never receives)."""
    h = w = index = 0
    out = []
    for ref_h, ref_w in refs:
        if method in ("index", "index_timestep_zero"):
            index, h_off, w_off = index + 1, 0, 0
        elif method == "negative_index":
            index, h_off, w_off = index - 1, 0, 0
        else:
            index, h_off, w_off = 1, 0, 0
            if ref_h + h > ref_w + w:
                w_off = w
            else:
                h_off = h
            h, w = max(h, ref_h + h_off), max(w, ref_w + w_off)
        out.append((index, h_off, w_off))
    return out


def rope_angles(ids: torch.Tensor, axes: Sequence[int], theta: float = THETA) -> torch.Tensor:
    """Complex rotations [S, sum(axes) / 2] of ids [S, 3], as comfy/ldm/flux/math.py `rope` computes them:
    omega and the angle in float64 from float32 positions, cos and sin rounded to float32."""
    parts = []
    for i, dim in enumerate(axes):
        scale = torch.linspace(0, (dim - 2) / dim, steps=dim // 2, dtype=torch.float64)
        omega = 1.0 / (theta**scale)
        angle = ids[:, i].to(torch.float32).to(torch.float64)[:, None] * omega[None, :]
        parts.append(torch.complex(torch.cos(angle).float(), torch.sin(angle).float()))
    return torch.cat(parts, dim=-1)


class ComfyShapes(list):
    """diffusers' `img_shapes` (per sample: [(t, h, w) of the image, then of each reference]) carrying
    ComfyUI's ids for `ComfyRope`. Built on every rank from the call's shapes; never sent anywhere."""

    def __init__(self, shapes: Sequence[Any], img_ids: torch.Tensor, txt_ids: torch.Tensor) -> None:
        super().__init__(shapes)
        self.img_ids, self.txt_ids = img_ids, txt_ids

    def to(self, *args: Any, **kwargs: Any) -> ComfyShapes:
        """Positions stay where they are (float32 on the CPU): the angles are computed there in float64."""
        return self


class ComfyRope(nn.Module):
    """Stands in for diffusers' QwenEmbedRope: the same outputs (image and text rotations, which diffusers'
    `_cp_plan` splits like the tokens), from ComfyUI's ids. `pad` (set by context parallelism for one
    forward) pads both to whole per-rank pieces, as the token streams are padded."""

    def __init__(self, axes: Sequence[int]) -> None:
        super().__init__()
        self.axes = tuple(int(a) for a in axes)
        self.pad: Callable[[torch.Tensor, int], torch.Tensor] | None = None

    def forward(
        self, video_fhw: Any, device: torch.device | None = None, max_txt_seq_len: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(video_fhw, ComfyShapes):
            raise TypeError(
                "this model's RoPE takes ComfyUI's positions (qwen_image.forward.ComfyShapes); call it through "
                "the family's model call (qwen_image.forward.qwen_call), not with diffusers' img_shapes"
            )
        img = rope_angles(video_fhw.img_ids, self.axes).to(device)
        txt = rope_angles(video_fhw.txt_ids, self.axes).to(device)
        if self.pad is not None:
            img, txt = self.pad(img, 0), self.pad(txt, 0)
        if max_txt_seq_len is not None and int(max_txt_seq_len) != txt.shape[0]:
            raise RuntimeError(f"a text of {int(max_txt_seq_len)} tokens but {txt.shape[0]} text positions")
        return img, txt


# --------------------------------------------------------------------------------------------------
# The call


def pad_to_patch(x: torch.Tensor) -> torch.Tensor:
    """comfy.ldm.common_dit.pad_to_patch_size(x, (1, 2, 2)): circular padding of H and W to even sizes."""
    pad_h, pad_w = (-x.shape[-2]) % PATCH, (-x.shape[-1]) % PATCH
    if not pad_h and not pad_w:
        return x
    return F.pad(x, (0, pad_w, 0, pad_h, 0, 0), mode="circular")


def patchify(x: torch.Tensor) -> torch.Tensor:
    """[B, C, T, H, W] (even H, W) -> [B, T*(H/2)*(W/2), 4C], channel order (c, ph, pw)."""
    b, c, t, h, w = x.shape
    x = x.reshape(b, c, t, h // 2, 2, w // 2, 2).permute(0, 2, 3, 5, 1, 4, 6)
    return x.reshape(b, t * (h // 2) * (w // 2), c * 4)


def unpatchify(tokens: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Inverse of `patchify` for a latent of `shape` [B, C, T, H, W] (even H, W)."""
    b, c, t, h, w = shape
    x = tokens.reshape(b, t, h // 2, w // 2, c, 2, 2).permute(0, 4, 1, 2, 5, 3, 6)
    return x.reshape(b, c, t, h, w)


def _five_d(x: torch.Tensor) -> torch.Tensor:
    return x if x.ndim == 5 else x.unsqueeze(2)


def qwen_call(
    model_fn: ModelFn,
    x: torch.Tensor,
    timestep: torch.Tensor,
    context: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    ref_latents: Sequence[torch.Tensor] = (),
    ref_latents_method: str = "index",
) -> torch.Tensor:
    """ComfyUI's QwenImage `forward(x, timestep, context, attention_mask, ref_latents, ref_latents_method=)`
    over a diffusers `model_fn` (`qwen_model_fn`).

    x: [B, 16, 1, H, W] (or [B, 16, H, W]) in sampler space, any H and W; context: [B, T, text_dim];
    attention_mask: [B, T] boolean (True = a real token) or None.
    Returns [B, 16, 1, H, W] (or 4-D, as x) in the model's dtype.
    """
    ref_method = ref_latents_method
    if ref_method not in REF_METHODS:
        raise ValueError(f"ref_latents_method={ref_method!r} is not one of {', '.join(REF_METHODS)}")
    four_d = x.ndim == 4
    x = _five_d(x)
    _, _, t, h, w = x.shape
    padded = pad_to_patch(x)
    tokens = [patchify(padded)]
    ids = [image_ids(t, h, w)]
    shapes = [(t, padded.shape[-2] // PATCH, padded.shape[-1] // PATCH)]
    refs = [_five_d(r) for r in ref_latents]
    placed = reference_placements([(r.shape[-2], r.shape[-1]) for r in refs], ref_method)
    for r, (index, h_off, w_off) in zip(refs, placed, strict=True):
        rp = pad_to_patch(r.to(x.dtype))
        tokens.append(patchify(rp))
        ids.append(image_ids(r.shape[2], r.shape[-2], r.shape[-1], index, h_off, w_off))
        shapes.append((r.shape[2], rp.shape[-2] // PATCH, rp.shape[-1] // PATCH))
    img_shapes = ComfyShapes([shapes] * x.shape[0], torch.cat(ids), text_ids(context.shape[1], h, w))
    # ComfyUI zeroes the references' timestep only when there are references (`if index > 0`)
    zero = ref_method == "index_timestep_zero" and bool(refs)
    out = model_fn(torch.cat(tokens, dim=1), context, attention_mask, timestep, img_shapes, zero)
    out = unpatchify(out[:, : tokens[0].shape[1]], padded.shape)[..., :h, :w]
    return out.squeeze(2) if four_d else out


def set_zero_cond_t(model: Any, zero: bool) -> None:
    """Whether this call modulates the reference tokens at timestep 0 (diffusers' `zero_cond_t`, read by the
    model's forward and by every block's)."""
    if getattr(model, "zero_cond_t", None) == zero:
        return
    model.zero_cond_t = zero
    for block in getattr(model, "transformer_blocks", ()):
        block.zero_cond_t = zero


def qwen_model_fn(model: nn.Module) -> ModelFn:
    """Adapt diffusers' QwenImageTransformer2DModel (with `ComfyRope`) to the `model_fn` contract."""

    @torch.no_grad()
    def model_fn(
        hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep, img_shapes, zero
    ):
        set_zero_cond_t(model, zero)
        return model(
            hidden_states=hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            encoder_hidden_states_mask=encoder_hidden_states_mask,
            timestep=timestep,
            img_shapes=img_shapes,
            return_dict=False,
        )[0]

    return model_fn


__all__ = [
    "REF_METHODS",
    "ComfyRope",
    "ComfyShapes",
    "image_ids",
    "patchify",
    "qwen_call",
    "qwen_model_fn",
    "reference_placements",
    "rope_angles",
    "set_zero_cond_t",
    "text_ids",
    "unpatchify",
]
