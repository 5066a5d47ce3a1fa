"""T5's tensor-parallel plan as data (names are ComfyUI's, t5/model.py): attention heads and the gated
feed-forward split, the token embeddings split by vocabulary or replicated (the planner's choice)."""

from __future__ import annotations

from ...parallel.tensor import Column, Row, Split, TensorParallelSpec, Vocab

BLOCK_PLAN: dict[str, Split] = {
    "encoder.block.*.layer.0.SelfAttention.q": Column(),
    "encoder.block.*.layer.0.SelfAttention.k": Column(),
    "encoder.block.*.layer.0.SelfAttention.v": Column(),
    "encoder.block.*.layer.0.SelfAttention.o": Row(),
    "encoder.block.*.layer.1.DenseReluDense.wi_0": Column(),
    "encoder.block.*.layer.1.DenseReluDense.wi_1": Column(),
    "encoder.block.*.layer.1.DenseReluDense.wo": Row(),
}


def t5_tp(embedding: str) -> TensorParallelSpec:
    plan = {**BLOCK_PLAN, **({"shared": Vocab()} if embedding == "vocab" else {})}
    return TensorParallelSpec(plan=plan, block_forwards={}, modulation_source="", attention_processors=())
