"""Layers every text encoder of the pack shares."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PromptEmbedding(nn.Embedding):
    """Token embeddings as ComfyUI's text encoders read them (`embed_tokens(ids, out_dtype=torch.float32)`):
    the table stays in the dtype it is held in (bf16, fp8: 1 or 2 bytes per entry), the rows come out float32.
    Tensor parallelism may split it by vocabulary (parallel/vocab.py reads `out_dtype`)."""

    out_dtype = torch.float32

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight).to(self.out_dtype)
