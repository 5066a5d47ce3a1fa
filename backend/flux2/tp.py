"""FLUX.2's tensor-parallel spec: the plan over diffusers' Flux2Transformer2DModel, as data, and the
double-block forward that reduces the image and text streams together (backend/parallel/tensor.py applies it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..parallel.tensor import (
    BlockForward,
    Column,
    Gathered,
    PackedColumn,
    PackedRow,
    Row,
    Split,
    TensorParallelSpec,
    reduce_streams,
)
from .forward import gated_add, modulate, split_rows

# FLUX.2 (diffusers' Flux2Transformer2DModel, 0.42.1). Same Megatron layout as diffusers' own `_tp_plan`
# for the blocks, plus what diffusers leaves replicated: the three *shared* modulation linears
# (double_stream_modulation_img/_txt: hidden -> 6 x hidden each; single_stream_modulation: hidden -> 3 x
# hidden) and norm_out. They read silu(temb) like FLUX.1's AdaLN, so they are Gathered: one all-gather
# for all four per forward. FLUX.2 [dev]: 0.64 B parameters, 1.28 GB of bf16 that diffusers keeps whole
# on every GPU. Widths: "hidden" = heads x head_dim, "mlp" = int(hidden x mlp_ratio) (FluxDims).
FLUX2_TP_PLAN: dict[str, Split] = {
    # shared modulation (computed once per forward, used by every block)
    "double_stream_modulation_img.linear": Gathered(),
    "double_stream_modulation_txt.linear": Gathered(),
    "single_stream_modulation.linear": Gathered(),
    # double-stream blocks
    "transformer_blocks.*.attn.to_q": Column(),
    "transformer_blocks.*.attn.to_k": Column(),
    "transformer_blocks.*.attn.to_v": Column(),
    "transformer_blocks.*.attn.add_q_proj": Column(),
    "transformer_blocks.*.attn.add_k_proj": Column(),
    "transformer_blocks.*.attn.add_v_proj": Column(),
    "transformer_blocks.*.attn.to_out.0": Row(reduce=False),
    "transformer_blocks.*.attn.to_add_out": Row(reduce=False),
    "transformer_blocks.*.ff.linear_in": PackedColumn(("mlp", "mlp")),  # SwiGLU [gate | up]
    "transformer_blocks.*.ff.linear_out": Row(reduce=False),
    "transformer_blocks.*.ff_context.linear_in": PackedColumn(("mlp", "mlp")),
    "transformer_blocks.*.ff_context.linear_out": Row(reduce=False),
    # single-stream blocks: one packed projection in, one packed projection out
    "single_transformer_blocks.*.attn.to_qkv_mlp_proj": PackedColumn(
        ("hidden", "hidden", "hidden", "mlp", "mlp")
    ),
    "single_transformer_blocks.*.attn.to_out": PackedRow(("hidden", "mlp")),
    # final AdaLN
    "norm_out.linear": Gathered(),
}


def fused_flux2_double_block_forward(
    block: nn.Module,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb_mod_img: torch.Tensor,
    temb_mod_txt: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' Flux2TransformerBlock.forward (0.42.1) with the two streams reduced together.

    Same arithmetic per stream as diffusers (which runs the image FF before the text residual: the
    streams are independent there, so the order does not change a value). Two all-reduces per block
    instead of four. Under index_timestep_zero (`block.rp_rows`, flux2/forward.py) the image stream is
    modulated by token ranges, the text stream by the step's timestep.
    """
    rows = getattr(block, "rp_rows", None)
    ranges = None if rows is None else rows.image
    batch = hidden_states.shape[0]
    (shift_msa, scale_msa, gate_msa), (shift_mlp, scale_mlp, gate_mlp) = split_rows(temb_mod_img, batch, 2)
    (c_shift_msa, c_scale_msa, c_gate_msa), (c_shift_mlp, c_scale_mlp, c_gate_mlp) = split_rows(
        temb_mod_txt, batch, 2
    )
    norm_h = modulate(block.norm1(hidden_states), shift_msa, scale_msa, ranges)
    norm_c = modulate(block.norm1_context(encoder_hidden_states), c_shift_msa, c_scale_msa, None)
    outputs = block.attn(
        hidden_states=norm_h,
        encoder_hidden_states=norm_c,
        image_rotary_emb=image_rotary_emb,
        **(joint_attention_kwargs or {}),
    )
    attn, c_attn = reduce_streams(
        list(outputs), [block.attn.to_out[0], block.attn.to_add_out], block.tp_group
    )
    hidden_states = gated_add(hidden_states, gate_msa, attn, ranges)
    encoder_hidden_states = gated_add(encoder_hidden_states, c_gate_msa, c_attn, None)

    norm_h = modulate(block.norm2(hidden_states), shift_mlp, scale_mlp, ranges)
    norm_c = modulate(block.norm2_context(encoder_hidden_states), c_shift_mlp, c_scale_mlp, None)
    ff, c_ff = reduce_streams(
        [block.ff(norm_h), block.ff_context(norm_c)],
        [block.ff.linear_out, block.ff_context.linear_out],
        block.tp_group,
    )
    hidden_states = gated_add(hidden_states, gate_mlp, ff, ranges)
    encoder_hidden_states = gated_add(encoder_hidden_states, c_gate_mlp, c_ff, None)
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


FLUX2_TP = TensorParallelSpec(
    plan=FLUX2_TP_PLAN,
    # two all-reduces per double block: the attention outputs, then the feed-forward outputs
    block_forwards={"transformer_blocks.*": BlockForward(fused_flux2_double_block_forward, reductions=2)},
    modulation_source="time_guidance_embed",
    attention_processors=("Flux2AttnProcessor", "Flux2ParallelSelfAttnProcessor"),
)

__all__ = ["FLUX2_TP", "FLUX2_TP_PLAN", "fused_flux2_double_block_forward"]
