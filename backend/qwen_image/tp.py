"""Qwen-Image's tensor-parallel spec: the plan over diffusers' QwenImageTransformer2DModel, as data, and the
block forwards that reduce the image and text streams together (backend/parallel/tensor.py applies it).

diffusers' own `_tp_plan` (transformer_qwenimage.py, 0.42.1) splits Q/K/V, the two out-projections and the
two MLPs, and leaves the AdaLN modulation replicated ("intentionally absent"): `img_mod` / `txt_mod` are a
Linear(hidden, 6 x hidden) per stream and block, 6.80 B of Qwen-Image's 20.43 B parameters, 13.6 GB of bf16
on every GPU. Here they are `Gathered`, with `norm_out.linear`: every one reads silu(temb), temb being
`time_text_embed`'s output, so all 121 are evaluated right after the time embedding and rebuilt with one
all-gather per forward (4.4 MB of bf16 at batch 1). bf16 bytes per GPU at TP 4: 10.25 GB instead of
20.47 GB (BENCHMARKS.md, `bench tp --model qwen-image`).

The two streams' four row-parallel outputs per block are reduced in two collectives (attention, then the
MLPs): 120 all-reduces per Qwen-Image forward instead of diffusers' 240.

Edit-2511's `zero_cond_t` doubles temb's rows (timestep, then 0 for the reference tokens); diffusers' block
hands `txt_mod` and the root hands `norm_out` only the first half. Both forwards below read that half out
of the gathered vector instead, so such a call still issues one all-gather.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..parallel.tensor import BlockForward, Column, Gathered, Row, Split, TensorParallelSpec, reduce_streams

# Module path (`*` = one block index) -> split kind. Widths: hidden = heads x head_dim, MLP 4 x hidden
# (diffusers' FeedForward, GELU tanh): nothing is packed, every linear splits evenly.
QWEN_TP_PLAN: dict[str, Split] = {
    # per-block AdaLN modulation (SiLU + Linear(hidden, 6 x hidden)): diffusers leaves these replicated
    "transformer_blocks.*.img_mod.1": Gathered(),
    "transformer_blocks.*.txt_mod.1": Gathered(),
    # joint attention: separate Q/K/V per stream
    "transformer_blocks.*.attn.to_q": Column(),
    "transformer_blocks.*.attn.to_k": Column(),
    "transformer_blocks.*.attn.to_v": Column(),
    "transformer_blocks.*.attn.add_q_proj": Column(),
    "transformer_blocks.*.attn.add_k_proj": Column(),
    "transformer_blocks.*.attn.add_v_proj": Column(),
    "transformer_blocks.*.attn.to_out.0": Row(reduce=False),
    "transformer_blocks.*.attn.to_add_out": Row(reduce=False),
    # one MLP per stream
    "transformer_blocks.*.img_mlp.net.0.proj": Column(),
    "transformer_blocks.*.img_mlp.net.2": Row(reduce=False),
    "transformer_blocks.*.txt_mlp.net.0.proj": Column(),
    "transformer_blocks.*.txt_mlp.net.2": Row(reduce=False),
    # final AdaLN (AdaLayerNormContinuous: Linear(hidden, 2 x hidden) over silu(temb), (scale, shift))
    "norm_out.linear": Gathered(),
}


def _first_half(rows: torch.Tensor, zero_cond_t: bool) -> torch.Tensor:
    """zero_cond_t: the rows of the real timestep (diffusers takes `temb.chunk(2)[0]`)."""
    return rows.chunk(2, dim=0)[0] if zero_cond_t else rows


def fused_qwen_double_block_forward(
    block: nn.Module,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    encoder_hidden_states_mask: torch.Tensor | None,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
    modulate_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' QwenImageTransformerBlock.forward (0.42.1) with the two streams reduced together.

    Same arithmetic per stream; the image MLP runs after the text residual (the streams are independent
    there, so no value changes). `txt_mod` reads all of temb's rows (the gathered vector's) and keeps the
    first half under zero_cond_t, where diffusers' txt_mod reads that half: the same rows, no extra gather.
    Two all-reduces per block instead of four.
    """
    img_mod1, img_mod2 = block.img_mod(temb).chunk(2, dim=-1)
    txt_mod1, txt_mod2 = _first_half(block.txt_mod(temb), block.zero_cond_t).chunk(2, dim=-1)

    img_modulated, img_gate1 = block._modulate(block.img_norm1(hidden_states), img_mod1, modulate_index)
    txt_modulated, txt_gate1 = block._modulate(block.txt_norm1(encoder_hidden_states), txt_mod1)
    outputs = block.attn(
        hidden_states=img_modulated,
        encoder_hidden_states=txt_modulated,
        encoder_hidden_states_mask=encoder_hidden_states_mask,
        image_rotary_emb=image_rotary_emb,
        **(joint_attention_kwargs or {}),
    )
    img_attn, txt_attn = reduce_streams(
        list(outputs), [block.attn.to_out[0], block.attn.to_add_out], block.tp_group
    )
    hidden_states = hidden_states + img_gate1 * img_attn
    encoder_hidden_states = encoder_hidden_states + txt_gate1 * txt_attn

    img_modulated2, img_gate2 = block._modulate(block.img_norm2(hidden_states), img_mod2, modulate_index)
    txt_modulated2, txt_gate2 = block._modulate(block.txt_norm2(encoder_hidden_states), txt_mod2)
    img_mlp, txt_mlp = reduce_streams(
        [block.img_mlp(img_modulated2), block.txt_mlp(txt_modulated2)],
        [block.img_mlp.net[2], block.txt_mlp.net[2]],
        block.tp_group,
    )
    hidden_states = hidden_states + img_gate2 * img_mlp
    encoder_hidden_states = encoder_hidden_states + txt_gate2 * txt_mlp
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


def gathered_norm_out_forward(
    norm: nn.Module, x: torch.Tensor, conditioning_embedding: torch.Tensor
) -> torch.Tensor:
    """diffusers' AdaLayerNormContinuous.forward over the gathered modulation vector.

    Under zero_cond_t the root hands it temb's first half while the vector was gathered for all rows: those
    rows are taken from it (the real timestep's), which saves the gather a GatheredLinear would issue for an
    input it was not filled for.
    """
    gathered = norm.linear.gathered
    rows = conditioning_embedding.shape[0]
    if (
        gathered is not None and gathered.shape[0] == 2 * rows
    ):  # zero_cond_t: the first half of the bank's rows
        emb = gathered[:rows]
    else:
        emb = norm.linear(norm.silu(conditioning_embedding).to(x.dtype))
    scale, shift = torch.chunk(emb, 2, dim=1)
    return norm.norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]


QWEN_TP = TensorParallelSpec(
    plan=QWEN_TP_PLAN,
    block_forwards={
        # two all-reduces per block: the attention outputs, then the MLP outputs, both streams at once
        "transformer_blocks.*": BlockForward(fused_qwen_double_block_forward, reductions=2),
        "norm_out": BlockForward(gathered_norm_out_forward, reductions=0),
    },
    modulation_source="time_text_embed",
    attention_processors=("QwenDoubleStreamAttnProcessor2_0",),
)

__all__ = ["QWEN_TP", "QWEN_TP_PLAN", "fused_qwen_double_block_forward", "gathered_norm_out_forward"]
