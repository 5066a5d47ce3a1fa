"""One FLUX.2 model call as ComfyUI makes it (comfy/ldm/flux/model.py `Flux._forward` with FLUX.2's
params, read 2026-11-22), over diffusers' Flux2Transformer2DModel.

ComfyUI's FLUX.2 (comfy/model_detection.py: image_model "flux2", patch_size 1, axes_dim (32, 32, 32, 32),
txt_ids_dims [3], default_ref_method "index", ref_index_scale 10): the latent is already 128 channels at
1/16 of the pixels (comfy/latent_formats.py `Flux2`: latent_channels 128, spacial_downscale_ratio 16,
no scale or shift), so a patch is one latent pixel and nothing is padded. Image ids are (index, row,
column, 0), text ids (0, 0, 0, position). Reference latents (ReferenceLatent) become extra image tokens
after x's; with "index" the k-th has index 10k at the origin. The text is padded to 512 tokens before
this call, by `model_base.Flux2.extra_conds` (left padding with zeros), not here.

"index_timestep_zero" (ComfyUI >= 0.17, its "Edit Model Reference Method" node; upstream 44f1246c) places
the references as "index" does and modulates them as at timestep 0: ComfyUI runs the timestep embedding
for [t, 0] (a batch of 2B) and, in every block and the final layer, applies the t rows to the text and
image tokens and the 0 rows to the reference tokens (comfy/ldm/flux/model.py `timestep_zero_index`,
layers.py `apply_mod` with `modulation_dims`); attention stays joint over all tokens. Here the same: the
call doubles the timestep (and each sample's guidance), and each image-stream token carries its
modulation row as a 5th column of its ids (`ROW_COLUMN`). The ids are split like the tokens by context
parallelism (diffusers' `_cp_plan` and the pack's padding treat them as one tensor), so every rank knows
the rows of its own tokens without knowing how they were split; RoPE reads only the first four columns.
The family's block forwards (`enable_reference_rows`, and flux2/tp.py's under TP) modulate by token
ranges, as ComfyUI does: nothing of width [tokens, hidden] is made for the modulation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..flux.forward import reference_placements as flux1_placements
from .facts import TIMESTEP_ZERO  # torch-free: the family's record reads them

# model_fn(hidden_states, encoder_hidden_states, pooled (unused by FLUX.2), timestep, img_ids, txt_ids,
# guidance) -> velocity tokens; the contract FLUX.1's flux_call uses, so the service calls both alike.
ModelFn = Callable[..., torch.Tensor]

REF_INDEX_SCALE = 10.0  # comfy/model_detection.py flux2 `ref_index_scale`
# img_ids[..., ROW_COLUMN]: the modulation row of an image-stream token under index_timestep_zero (0: the
# step's timestep, 1: timestep 0); absent otherwise. FLUX.2's RoPE has four axes (0..3).
ROW_COLUMN = 4


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
    patch size 1 and FLUX.2's index steps; index_timestep_zero places them as index."""
    placement = "index" if method == TIMESTEP_ZERO else method
    return flux1_placements(height, width, refs, placement, patch=1, index_step=REF_INDEX_SCALE)


def tokens_of(latent: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, H*W, C] (rearrange "b c h w -> b (h w) c")."""
    return latent.flatten(2).transpose(1, 2)


def flux2_call(
    model_fn: ModelFn,
    x: torch.Tensor,
    timestep: torch.Tensor,
    context: torch.Tensor,
    y: torch.Tensor | None = None,
    guidance: torch.Tensor | None = None,
    ref_latents: Sequence[torch.Tensor] = (),
    ref_latents_method: str = "index",
) -> torch.Tensor:
    """ComfyUI's FLUX.2 `Flux.forward(x, timestep, context, None, guidance, ref_latents, ...)`.

    x: [B, 128, H, W] in sampler space; context: [B, T, joint_attention_dim]; `y` (FLUX.1's pooled vector)
    is ignored, as ComfyUI's Flux2 ignores it. Returns [B, 128, H, W].
    With references and index_timestep_zero, the model is called with the timesteps [t, 0] (2B values),
    each sample's guidance twice, and the image ids' modulation rows (module docstring).
    """
    b, _, h, w = x.shape
    img = tokens_of(x)
    img_ids = flux2_ids(h, w).to(x.device)
    if ref_latents:
        sizes = [(r.shape[-2], r.shape[-1]) for r in ref_latents]
        placed = reference_placements(h, w, sizes, ref_latents_method)
        img = torch.cat([img, *(tokens_of(r.to(img.dtype)) for r in ref_latents)], dim=1)
        ids = [flux2_ids(rh, rw, *p) for (rh, rw), p in zip(sizes, placed, strict=True)]
        img_ids = torch.cat([img_ids, *(i.to(x.device) for i in ids)], dim=0)
        if ref_latents_method == TIMESTEP_ZERO:
            rows = torch.zeros(img_ids.shape[0], 1, device=img_ids.device)
            rows[h * w :] = 1.0  # the reference tokens: timestep 0's modulation
            img_ids = torch.cat([img_ids, rows], dim=1)
            timestep = torch.cat([timestep, timestep * 0])
            guidance = None if guidance is None else torch.cat([guidance, guidance])
    txt_ids = flux2_text_ids(context.shape[1]).to(x.device)
    out = model_fn(img, context, None, timestep, img_ids, txt_ids, guidance)
    return out[:, : h * w].transpose(1, 2).reshape(b, -1, h, w)


def flux2_model_fn(model: torch.nn.Module) -> ModelFn:
    """Adapt diffusers' Flux2Transformer2DModel to the `model_fn` contract (no pooled projection); image ids
    with a modulation-row column (index_timestep_zero) switch the model to the row-aware block forwards."""

    @torch.no_grad()
    def model_fn(hidden_states, encoder_hidden_states, pooled, timestep, img_ids, txt_ids, guidance):
        if img_ids.shape[-1] > ROW_COLUMN:
            enable_reference_rows(model)
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


# --------------------------------------------------------------------------------------------------
# Modulation by token ranges (index_timestep_zero)

# (start, end, row) over one rank's tokens of a stream: ComfyUI's `modulation_dims`.
Ranges = tuple[tuple[int, int, int], ...]


@dataclass
class ReferenceRows:
    """One forward's modulation rows over this rank's image-stream tokens; None outside index_timestep_zero.

    Filled from the image ids' row column when RoPE is computed (after context parallelism split the ids
    like the tokens), emptied when the model's forward starts and ends, so a stale value is never used.
    """

    image: Ranges | None = None

    def single(self, text: int) -> Ranges | None:
        """The single blocks' ranges: this rank's `text` tokens first (the step's timestep), then the image."""
        if self.image is None:
            return None
        return ((0, text, 0), *((a + text, b + text, r) for a, b, r in self.image))


def row_ranges(rows: torch.Tensor) -> Ranges:
    """Runs of equal rows: [0, 0, 1, 1, 0] -> ((0, 2, 0), (2, 4, 1), (4, 5, 0)). One host sync per forward."""
    values = [int(v) for v in rows.round().tolist()]
    out, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            out.append((start, i, values[start]))
            start = i
    return tuple(out)


def modulation_rows(mod: torch.Tensor, batch: int) -> list[torch.Tensor]:
    """A shared modulation of R x `batch` rows ([R*B, C], the timesteps [t, 0]) as R tensors [B, 1, C]."""
    if mod.ndim == 3:
        mod = mod.squeeze(1)
    if mod.shape[0] % batch:
        raise RuntimeError(f"modulation of {mod.shape[0]} rows for a batch of {batch}")
    return [m.unsqueeze(1) for m in mod.reshape(-1, batch, mod.shape[-1]).unbind(0)]


def modulate(
    x: torch.Tensor, shift: Sequence[torch.Tensor], scale: Sequence[torch.Tensor], ranges: Ranges | None
) -> torch.Tensor:
    """`(1 + scale) * x + shift` (diffusers' arithmetic), row r's parameters on each range of row r."""
    if ranges is None:
        return (1 + scale[0]) * x + shift[0]
    out = torch.empty_like(x)
    for a, b, r in ranges:
        out[:, a:b] = (1 + scale[r]) * x[:, a:b] + shift[r]
    return out


def gated_add(
    x: torch.Tensor, gate: Sequence[torch.Tensor], y: torch.Tensor, ranges: Ranges | None
) -> torch.Tensor:
    """`x + gate * y` with row r's gate on each range of row r."""
    if ranges is None:
        return x + gate[0] * y
    out = torch.empty_like(x)
    for a, b, r in ranges:
        out[:, a:b] = x[:, a:b] + gate[r] * y[:, a:b]
    return out


def split_rows(mod: torch.Tensor, batch: int, sets: int) -> list[list[list[torch.Tensor]]]:
    """[set][shift|scale|gate][row] -> [B, 1, hidden]: `Flux2Modulation.split` of each row."""
    from diffusers.models.transformers.transformer_flux2 import Flux2Modulation

    per_row = [Flux2Modulation.split(m, sets) for m in modulation_rows(mod, batch)]
    return [[[row[s][k] for row in per_row] for k in range(3)] for s in range(sets)]


def double_block_rows_forward(
    block: nn.Module,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb_mod_img: torch.Tensor,
    temb_mod_txt: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' Flux2TransformerBlock.forward (0.42.1) with the image stream modulated by token ranges
    (the text stream by the step's timestep, row 0); without rows, diffusers' own forward."""
    ranges = block.rp_rows.image
    if ranges is None:
        return block.rp_original_forward(
            hidden_states, encoder_hidden_states, temb_mod_img, temb_mod_txt, image_rotary_emb,
            joint_attention_kwargs,
        )  # fmt: skip
    batch = hidden_states.shape[0]
    (shift_msa, scale_msa, gate_msa), (shift_mlp, scale_mlp, gate_mlp) = split_rows(temb_mod_img, batch, 2)
    (c_shift_msa, c_scale_msa, c_gate_msa), (c_shift_mlp, c_scale_mlp, c_gate_mlp) = split_rows(
        temb_mod_txt, batch, 2
    )
    norm_h = modulate(block.norm1(hidden_states), shift_msa, scale_msa, ranges)
    norm_c = modulate(block.norm1_context(encoder_hidden_states), c_shift_msa, c_scale_msa, None)
    attn, c_attn = block.attn(
        hidden_states=norm_h,
        encoder_hidden_states=norm_c,
        image_rotary_emb=image_rotary_emb,
        **(joint_attention_kwargs or {}),
    )
    hidden_states = gated_add(hidden_states, gate_msa, attn, ranges)
    norm_h = modulate(block.norm2(hidden_states), shift_mlp, scale_mlp, ranges)
    hidden_states = gated_add(hidden_states, gate_mlp, block.ff(norm_h), ranges)
    encoder_hidden_states = gated_add(encoder_hidden_states, c_gate_msa, c_attn, None)
    norm_c = modulate(block.norm2_context(encoder_hidden_states), c_shift_mlp, c_scale_mlp, None)
    encoder_hidden_states = gated_add(encoder_hidden_states, c_gate_mlp, block.ff_context(norm_c), None)
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


def single_block_rows_forward(
    block: nn.Module,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor | None,
    temb_mod: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
    split_hidden_states: bool = False,
    text_seq_len: int | None = None,
) -> Any:
    """diffusers' Flux2SingleTransformerBlock.forward (0.42.1) with [text | image] modulated by token
    ranges (text and image: the step's timestep; references: timestep 0); without rows, diffusers' own."""
    rows: ReferenceRows = block.rp_rows
    if rows.image is None:
        return block.rp_original_forward(
            hidden_states, encoder_hidden_states, temb_mod, image_rotary_emb, joint_attention_kwargs,
            split_hidden_states, text_seq_len,
        )  # fmt: skip
    if encoder_hidden_states is not None:
        text_seq_len = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    image = rows.image[-1][1]  # this rank's image-stream tokens
    ranges = rows.single(hidden_states.shape[1] - image)
    ((shift, scale, gate),) = split_rows(temb_mod, hidden_states.shape[0], 1)
    norm = modulate(block.norm(hidden_states), shift, scale, ranges)
    attn = block.attn(hidden_states=norm, image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {}))
    hidden_states = gated_add(hidden_states, gate, attn, ranges)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    if split_hidden_states:
        return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]
    return hidden_states


def norm_out_rows_forward(
    module: nn.Module, x: torch.Tensor, conditioning_embedding: torch.Tensor
) -> torch.Tensor:
    """diffusers' AdaLayerNormContinuous.forward with the step's timestep rows only: under
    index_timestep_zero the reference tokens' outputs are dropped, as ComfyUI drops them."""
    emb = module.linear(module.silu(conditioning_embedding).to(x.dtype))
    emb = emb[: x.shape[0]]
    scale, shift = torch.chunk(emb, 2, dim=1)
    return module.norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]


def enable_reference_rows(model: nn.Module) -> ReferenceRows:
    """Install (once per model) the row-aware forwards of index_timestep_zero: the double blocks' (unless
    tensor parallelism installed its own, flux2/tp.py, which reads the same rows), the single blocks', the
    final norm's, and the hooks that fill and empty the rows. Without rows, every forward is diffusers' own.
    """
    rows = getattr(model, "_rp_reference_rows", None)
    if rows is not None:
        return rows
    rows = ReferenceRows()
    axes = len(model.pos_embed.axes_dim)

    def take_rows(_module: nn.Module, args: tuple[Any, ...]) -> Any:
        ids = args[0]
        if ids.shape[-1] <= axes:  # the text ids, or a forward without rows
            return None
        rows.image = row_ranges(ids.reshape(-1, ids.shape[-1])[:, axes])
        return (ids[..., :axes], *args[1:])

    def clear(*_: Any) -> None:
        rows.image = None

    for block in model.transformer_blocks:
        block.rp_rows = rows
        if not hasattr(block, "tp_group"):  # TP's fused forward reads block.rp_rows itself
            block.rp_original_forward = block.forward
            block.forward = double_block_rows_forward.__get__(block)
    for block in model.single_transformer_blocks:
        block.rp_rows = rows
        block.rp_original_forward = block.forward
        block.forward = single_block_rows_forward.__get__(block)
    model.norm_out.forward = norm_out_rows_forward.__get__(model.norm_out)
    model.pos_embed.register_forward_pre_hook(take_rows)
    model.register_forward_pre_hook(clear)
    model.register_forward_hook(clear)
    model._rp_reference_rows = rows
    return rows
