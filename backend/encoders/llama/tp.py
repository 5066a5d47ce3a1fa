"""The language models' tensor-parallel plan as data (names are ComfyUI's `Llama2_`'s, llama/model.py):
q/k/v and gate/up split by columns, o and down by rows, the token embeddings by vocabulary or replicated."""

from __future__ import annotations

from ...parallel.tensor import Column, Row, Split, TensorParallelSpec, Vocab

BLOCK_PLAN: dict[str, Split] = {
    "layers.*.self_attn.q_proj": Column(),
    "layers.*.self_attn.k_proj": Column(),
    "layers.*.self_attn.v_proj": Column(),
    "layers.*.self_attn.o_proj": Row(),
    "layers.*.mlp.gate_proj": Column(),
    "layers.*.mlp.up_proj": Column(),
    "layers.*.mlp.down_proj": Row(),
}


def llama_tp(embedding: str) -> TensorParallelSpec:
    plan = {**BLOCK_PLAN, **({"embed_tokens": Vocab()} if embedding == "vocab" else {})}
    return TensorParallelSpec(plan=plan, block_forwards={}, modulation_source="", attention_processors=())
