"""Wan's tensor-parallel spec: the plan over diffusers' WanTransformer3DModel, as data (backend/parallel/tensor.py
applies it).

Megatron's split on every block: the self- and cross-attention's Q/K/V column-parallel and their output
row-parallel, the feed-forward's first linear column-parallel and its second row-parallel: three all-reduces
per block (self-attention, cross-attention, feed-forward, each after the residual's input is complete).
Wan normalises Q and K over all heads at once (diffusers' qk_norm "rms_norm_across_heads", ComfyUI's
RMSNorm(dim)): `NormAcrossHeads` keeps each rank's slice of the scale and all-reduces the sum of squares
([B, S, 1] per norm), which a per-rank norm would get wrong silently. I2V's image branch (`add_k_proj`,
`add_v_proj`, `norm_added_k`: CLIP tokens attended by the same query heads) splits by heads the same way;
text-to-video checkpoints do not have it (`optional`).

Modulation: Wan has no per-block modulation linear: each block adds its own `scale_shift_table` (6 x hidden,
replicated: 0.2 M values) to one shared projection of the time embedding, `condition_embedder.time_proj`
(hidden -> 6 x hidden: 157 M parameters in the 14B). That one is `Gathered`: each rank computes its rows and
one all-gather per forward rebuilds the vector, as FLUX's and Qwen-Image's modulation (the ModulationBank,
filled right after `time_embedder`, whose output is its only input through SiLU). The text and image
embedders, the patch embedding and the output projection are small and stay whole.
"""

from __future__ import annotations

from ..parallel.tensor import Column, Gathered, NormAcrossHeads, Row, Split, TensorParallelSpec

WAN_TP_PLAN: dict[str, Split] = {
    "condition_embedder.time_proj": Gathered(),
    # self-attention over the video tokens
    "blocks.*.attn1.to_q": Column(),
    "blocks.*.attn1.to_k": Column(),
    "blocks.*.attn1.to_v": Column(),
    "blocks.*.attn1.norm_q": NormAcrossHeads(),
    "blocks.*.attn1.norm_k": NormAcrossHeads(),
    "blocks.*.attn1.to_out.0": Row(),
    # cross-attention to the text (and, I2V, to the CLIP image tokens)
    "blocks.*.attn2.to_q": Column(),
    "blocks.*.attn2.to_k": Column(),
    "blocks.*.attn2.to_v": Column(),
    "blocks.*.attn2.norm_q": NormAcrossHeads(),
    "blocks.*.attn2.norm_k": NormAcrossHeads(),
    "blocks.*.attn2.add_k_proj": Column(),
    "blocks.*.attn2.add_v_proj": Column(),
    "blocks.*.attn2.norm_added_k": NormAcrossHeads(),
    "blocks.*.attn2.to_out.0": Row(),
    # feed-forward (GELU tanh)
    "blocks.*.ffn.net.0.proj": Column(),
    "blocks.*.ffn.net.2": Row(),
}
# I2V's image branch: absent from text-to-video checkpoints (Wan 2.1 T2V, both Wan 2.2 A14B, TI2V-5B)
IMAGE_BRANCH = ("blocks.*.attn2.add_k_proj", "blocks.*.attn2.add_v_proj", "blocks.*.attn2.norm_added_k")

WAN_TP = TensorParallelSpec(
    plan=WAN_TP_PLAN,
    block_forwards={},
    modulation_source="condition_embedder.time_embedder",
    attention_processors=("WanComfyAttnProcessor",),
    optional=IMAGE_BRANCH,
)

__all__ = ["IMAGE_BRANCH", "WAN_TP", "WAN_TP_PLAN"]
