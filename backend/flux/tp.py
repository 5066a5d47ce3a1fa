"""FLUX.1's tensor-parallel spec: the Megatron plan over diffusers' FluxTransformer2DModel, as data, and
the double-block forward that reduces the image and text streams together.

Column-parallel `attn.to_q/to_k/to_v`, `attn.add_q_proj/...`, `ff.net.0.proj`, `ff_context.net.0.proj`,
single `proj_mlp`; row-parallel `attn.to_out.0`, `attn.to_add_out`, `ff.net.2`, `ff_context.net.2` (left
unreduced: the fused block forward reduces both streams at once) and the single blocks' `proj_out`, whose
input is cat(attention, mlp) (`PackedRow`: each rank takes its attention *and* its MLP columns); every
AdaLN modulation linear `Gathered` (one all-gather per forward). backend/parallel/tensor.py applies it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..parallel.tensor import (
    BlockForward,
    Column,
    Gathered,
    PackedRow,
    Row,
    Split,
    TensorParallelSpec,
    reduce_streams,
)

FLUX_TP_PLAN: dict[str, Split] = {
    # double-stream (MMDiT) blocks: image and text streams
    "transformer_blocks.*.norm1.linear": Gathered(),
    "transformer_blocks.*.norm1_context.linear": Gathered(),
    "transformer_blocks.*.attn.to_q": Column(),
    "transformer_blocks.*.attn.to_k": Column(),
    "transformer_blocks.*.attn.to_v": Column(),
    "transformer_blocks.*.attn.add_q_proj": Column(),
    "transformer_blocks.*.attn.add_k_proj": Column(),
    "transformer_blocks.*.attn.add_v_proj": Column(),
    "transformer_blocks.*.attn.to_out.0": Row(reduce=False),
    "transformer_blocks.*.attn.to_add_out": Row(reduce=False),
    "transformer_blocks.*.ff.net.0.proj": Column(),
    "transformer_blocks.*.ff.net.2": Row(reduce=False),
    "transformer_blocks.*.ff_context.net.0.proj": Column(),
    "transformer_blocks.*.ff_context.net.2": Row(reduce=False),
    # single-stream blocks: parallel attention + MLP
    "single_transformer_blocks.*.norm.linear": Gathered(),
    "single_transformer_blocks.*.attn.to_q": Column(),
    "single_transformer_blocks.*.attn.to_k": Column(),
    "single_transformer_blocks.*.attn.to_v": Column(),
    "single_transformer_blocks.*.proj_mlp": Column(),
    "single_transformer_blocks.*.proj_out": PackedRow(("hidden", "mlp")),
    # final AdaLN
    "norm_out.linear": Gathered(),
}


def fused_double_block_forward(
    block: nn.Module,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FluxTransformerBlock.forward with the image and text streams reduced together.

    Same arithmetic, in the same order, as diffusers' FluxTransformerBlock.forward; only the four
    row-parallel outputs are reduced in two collectives instead of four.
    """
    norm_h, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.norm1(hidden_states, emb=temb)
    norm_c, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = block.norm1_context(
        encoder_hidden_states, emb=temb
    )
    outputs = block.attn(
        hidden_states=norm_h,
        encoder_hidden_states=norm_c,
        image_rotary_emb=image_rotary_emb,
        **(joint_attention_kwargs or {}),
    )
    if len(outputs) != 2:
        raise NotImplementedError("IP-Adapter attention is not supported under tensor parallelism")
    attn, c_attn = reduce_streams(
        list(outputs), [block.attn.to_out[0], block.attn.to_add_out], block.tp_group
    )

    hidden_states = hidden_states + gate_msa.unsqueeze(1) * attn
    encoder_hidden_states = encoder_hidden_states + c_gate_msa.unsqueeze(1) * c_attn

    norm_h = block.norm2(hidden_states) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
    norm_c = block.norm2_context(encoder_hidden_states) * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
    ff, c_ff = reduce_streams(
        [block.ff(norm_h), block.ff_context(norm_c)],
        [block.ff.net[2], block.ff_context.net[2]],
        block.tp_group,
    )
    hidden_states = hidden_states + gate_mlp.unsqueeze(1) * ff
    encoder_hidden_states = encoder_hidden_states + c_gate_mlp.unsqueeze(1) * c_ff
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


FLUX_TP = TensorParallelSpec(
    plan=FLUX_TP_PLAN,
    # two all-reduces per double block: the attention outputs, then the feed-forward outputs
    block_forwards={"transformer_blocks.*": BlockForward(fused_double_block_forward, reductions=2)},
    modulation_source="time_text_embed",
    attention_processors=("FluxAttnProcessor",),
)

__all__ = ["FLUX_TP", "FLUX_TP_PLAN", "fused_double_block_forward"]
