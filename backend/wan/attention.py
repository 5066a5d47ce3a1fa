"""Wan's attention as ComfyUI computes it, on diffusers' `WanAttention` modules.

diffusers' `WanAttnProcessor` (0.42.1) is ComfyUI's `WanSelfAttention` / `WanT2VCrossAttention` /
`WanI2VCrossAttention` (comfy/ldm/wan/model.py) in all but one respect: an I2V model's cross-attention splits
its context into the CLIP image tokens and the text at `context.shape[1] - 512`, a hard-coded text length.
ComfyUI splits at the image tokens' count (`context_img_len = clip_fea.shape[-2]`, 257 for CLIP-H), and a
prompt longer than 512 tokens (the umt5 tokenizer pads to at least 512, never cuts) or a test's short text
would put the split elsewhere. With no `clip_fea` at all (WanImageToVideo without a CLIP vision output),
ComfyUI's slices `context[:, :None]` and `context[:, None:]` both take the whole text: the image branch
attends over the text too. `WanComfyAttnProcessor` is diffusers' processor with that split; the family's
model call sets the count on every cross-attention for each forward (`set_image_tokens`).

Heads are taken as `(-1, head_dim)` of the local projection, so a tensor-parallel shard (heads / tp) needs no
bookkeeping beyond the module's own. Context parallelism rebuilds this class with its `dispatch_attention_fn`
redirected (parallel/context.py), so the attention calls stay module-level `dispatch_attention_fn` calls.
"""

from __future__ import annotations

from typing import Any

import torch

# What `image_tokens` holds when the call has no CLIP image tokens: ComfyUI's `context_img_len = None`.
WHOLE_CONTEXT = None


def dispatch_attention_fn(*args: Any, **kwargs: Any) -> torch.Tensor:
    """diffusers' `dispatch_attention_fn`, imported at the first call (registering the family stays free of
    diffusers). Context parallelism swaps this module-level name in its copy of the processor."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn as dispatch

    return dispatch(*args, **kwargs)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' Wan rotation: interleaved pairs (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos), which is
    comfy/ldm/flux/math.py `apply_rope1` on the same pairs."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x1 * s + x2 * c
    return out.type_as(x)


class WanComfyAttnProcessor:
    """diffusers' WanAttnProcessor with ComfyUI's split of an I2V cross-attention's context (module doc)."""

    _attention_backend = None
    _parallel_config = None

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        head_dim = attn.head_dim
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        image_context = None
        if attn.add_k_proj is not None:
            count = getattr(attn, "image_tokens", WHOLE_CONTEXT)
            image_context = context[:, :count]
            context = context[:, count:]

        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (-1, head_dim))
        key = attn.norm_k(attn.to_k(context)).unflatten(2, (-1, head_dim))
        value = attn.to_v(context).unflatten(2, (-1, head_dim))
        if rotary_emb is not None:
            query, key = _rotate(query, *rotary_emb), _rotate(key, *rotary_emb)

        image_out = None
        if image_context is not None:
            key_img = attn.norm_added_k(attn.add_k_proj(image_context)).unflatten(2, (-1, head_dim))
            value_img = attn.add_v_proj(image_context).unflatten(2, (-1, head_dim))
            image_out = dispatch_attention_fn(
                query, key_img, value_img, attn_mask=None, dropout_p=0.0, is_causal=False,
                backend=self._attention_backend, parallel_config=None,
            )  # fmt: skip
            image_out = image_out.flatten(2, 3).type_as(query)

        out = dispatch_attention_fn(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
            backend=self._attention_backend,
            # the sequence is split only where queries and keys are the video tokens (self-attention); the
            # cross-attentions stay local: this rank's queries against the whole text (diffusers' choice)
            parallel_config=self._parallel_config if encoder_hidden_states is None else None,
        )  # fmt: skip
        out = out.flatten(2, 3).type_as(query)
        if image_out is not None:
            out = out + image_out  # ComfyUI: x = x + img_x
        return attn.to_out[1](attn.to_out[0](out))


def set_image_tokens(model: Any, count: int | None) -> None:
    """How many leading context tokens of this forward are CLIP image tokens (None: ComfyUI's whole-context
    slices, when an I2V model gets no clip_fea), on every cross-attention that has an image branch."""
    for block in getattr(model, "blocks", ()):
        attn = block.attn2
        if attn.add_k_proj is not None:
            attn.image_tokens = count


def use_comfy_processors(model: Any) -> None:
    """Every WanAttention of `model` on `WanComfyAttnProcessor`, with its head width recorded (the engine's TP
    divides `heads` of modules that carry `head_dim`)."""
    from diffusers.models.transformers.transformer_wan import WanAttention

    for module in model.modules():
        if isinstance(module, WanAttention):
            module.head_dim = module.inner_dim // module.heads
            module.set_processor(WanComfyAttnProcessor())


__all__ = ["WanComfyAttnProcessor", "set_image_tokens", "use_comfy_processors"]
