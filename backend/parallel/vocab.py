"""Vocabulary-parallel embeddings: each rank of the tensor-parallel group holds a contiguous block of the
table's rows (a text encoder's token embeddings: Mistral Small 3's 131072 x 5120 is 1.3 GB in bf16), looks up
the tokens that fall in its block, and one all-reduce sums the rows (every token's row comes from exactly one
rank, the others add zeros, so the sum is exact). Megatron's VocabParallelEmbedding, written here because
torch's `RowwiseParallel` on an embedding needs DTensor and refuses CPU process groups the pack tests on.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .splits import vocab_range  # torch-free, for the planner; re-exported here


class VocabParallelEmbedding(nn.Module):
    """Rows [start, stop) of an embedding table; `forward(ids)` returns every id's full row on every rank."""

    def __init__(
        self, weight: nn.Parameter, start: int, size: int, group: Any, out_dtype: torch.dtype | None
    ) -> None:
        super().__init__()
        self.weight, self.start, self.size, self.group = weight, start, size, group
        self.out_dtype = out_dtype

    @property
    def num_embeddings(self) -> int:
        return self.size

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        rows = rows.to(self.out_dtype or self.weight.dtype)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0)
        dist.all_reduce(rows, group=self.group)
        return rows

    def extra_repr(self) -> str:
        return f"rows {self.start}..{self.start + self.weight.shape[0]} of {self.size}, width {self.weight.shape[1]}"


__all__ = ["VocabParallelEmbedding", "vocab_range"]
