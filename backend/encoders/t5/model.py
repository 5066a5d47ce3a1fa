"""T5 v1.1's encoder (T5-XXL: FLUX.1's text encoder) as ComfyUI computes it, for the workers.

ComfyUI reimplements T5 (comfy/text_encoders/t5.py) rather than using transformers' `T5EncoderModel`, and
its numbers are what a user's CONDITIONING holds, so this module follows ComfyUI's arithmetic and not
transformers': every layer computes in float32 whatever dtype the weights are held in (ComfyUI's "match
torch.float32 hardcode upcast in TE implementation": the embeddings come out float32 and each weight is cast
to the input's dtype), the layer norm keeps the input's dtype (transformers casts to half and clamps fp16
activations), keys are multiplied by sqrt(d_kv) before the attention's own 1/sqrt(d_kv), the relative
position bias comes from block 0 and is added to every block's mask. Parameter names are ComfyUI's (and the
files'): `shared`, `encoder.block.N.layer.0.SelfAttention.q`, ..., so a file's keys are the parameter names.

Tensor parallelism (tp.py) splits q/k/v and the gated feed-forward's `wi_0` / `wi_1` by columns and `o` /
`wo` by rows; each attention module finds its local heads from its projection's width. The relative position
bias table is tiny ([32, heads]) and replicated: the stack computes it whole and keeps its rank's heads.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...parallel.weights import UpcastLinear
from ..layers import PromptEmbedding


def _linear(width_in: int, width_out: int) -> nn.Linear:
    return UpcastLinear(width_in, width_out, bias=False)


class T5LayerNorm(nn.Module):
    """ComfyUI's T5LayerNorm: x * rsqrt(mean(x^2) + eps) * weight, in the input's dtype (float32)."""

    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight.to(x.dtype) * x


class T5DenseGatedActDense(nn.Module):
    def __init__(self, width: int, ff: int) -> None:
        super().__init__()
        self.wi_0, self.wi_1, self.wo = _linear(width, ff), _linear(width, ff), _linear(ff, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(F.gelu(self.wi_0(x), approximate="tanh") * self.wi_1(x))


class T5LayerFF(nn.Module):
    def __init__(self, width: int, ff: int, eps: float) -> None:
        super().__init__()
        self.DenseReluDense = T5DenseGatedActDense(width, ff)
        self.layer_norm = T5LayerNorm(width, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.DenseReluDense(self.layer_norm(x))


class T5Attention(nn.Module):
    def __init__(self, width: int, heads: int, d_kv: int, relative_bias: bool, buckets: int) -> None:
        super().__init__()
        inner = heads * d_kv
        self.q, self.k, self.v = _linear(width, inner), _linear(width, inner), _linear(width, inner)
        self.o = _linear(inner, width)
        self.d_kv = d_kv
        self.relative_attention_bias = nn.Embedding(buckets, heads) if relative_bias else None

    def compute_bias(self, length: int, device: torch.device, max_distance: int = 128) -> torch.Tensor:
        """ComfyUI's (Mesh TensorFlow's) bidirectional bucketed relative position bias, [1, heads, S, S]."""
        table = self.relative_attention_bias
        assert table is not None
        context = torch.arange(length, dtype=torch.long, device=device)[:, None]
        memory = torch.arange(length, dtype=torch.long, device=device)[None, :]
        buckets = relative_position_bucket(memory - context, table.num_embeddings, max_distance)
        values = F.embedding(buckets, table.weight).to(torch.float32)  # [S, S, heads]
        return values.permute([2, 0, 1]).unsqueeze(0).contiguous()

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        heads = q.shape[-1] // self.d_kv  # this rank's heads (all of them without tensor parallelism)
        # ComfyUI scales k by sqrt(d_kv) and lets the attention divide by it: T5 attends unscaled
        k = k * ((k.shape[-1] / heads) ** 0.5)
        q, k, v = (t.view(b, s, heads, self.d_kv).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
        return self.o(out.transpose(1, 2).reshape(b, s, heads * self.d_kv))


def relative_position_bucket(relative: torch.Tensor, buckets: int, max_distance: int) -> torch.Tensor:
    """comfy/text_encoders/t5.py T5Attention._relative_position_bucket, bidirectional."""
    buckets //= 2
    out = (relative > 0).to(torch.long) * buckets
    relative = torch.abs(relative)
    exact = buckets // 2
    small = relative < exact
    large = exact + (
        torch.log(relative.float() / exact) / math.log(max_distance / exact) * (buckets - exact)
    ).to(torch.long)
    large = torch.min(large, torch.full_like(large, buckets - 1))
    return out + torch.where(small, relative, large)


class T5LayerSelfAttention(nn.Module):
    def __init__(
        self, width: int, heads: int, d_kv: int, relative_bias: bool, buckets: int, eps: float
    ) -> None:
        super().__init__()
        self.SelfAttention = T5Attention(width, heads, d_kv, relative_bias, buckets)
        self.layer_norm = T5LayerNorm(width, eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return x + self.SelfAttention(self.layer_norm(x), mask)


class T5Block(nn.Module):
    def __init__(self, config: dict[str, Any], relative_bias: bool) -> None:
        super().__init__()
        width, eps = config["d_model"], config.get("layer_norm_epsilon", 1e-6)
        self.layer = nn.ModuleList(
            [
                T5LayerSelfAttention(
                    width,
                    config["num_heads"],
                    config["d_kv"],
                    relative_bias,
                    config.get("relative_attention_num_buckets", 32),
                    eps,
                ),
                T5LayerFF(width, config["d_ff"], eps),
            ]
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self.layer[1](self.layer[0](x, mask))


class T5Stack(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        # T5 (not umT5): only block 0 holds the relative position table; every block adds its bias
        self.block = nn.ModuleList([T5Block(config, i == 0) for i in range(config["num_layers"])])
        self.final_layer_norm = T5LayerNorm(config["d_model"], config.get("layer_norm_epsilon", 1e-6))


class T5Encoder(nn.Module):
    """The worker's T5: `embed(ids)` then `forward(x, ...)`, ComfyUI's T5.forward split where ComfyUI's
    process hands the prompt's embeddings over (the caller replaces ComfyUI's `T5.encoder` and `T5.shared`)."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.shared = PromptEmbedding(config["vocab_size"], config["d_model"])
        self.encoder = T5Stack(config)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.shared(ids)

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        intermediate_output: int | None = None,
        final_layer_norm_intermediate: bool = True,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """comfy/text_encoders/t5.py T5Stack.forward on float32 embeddings [B, S, D]: (last hidden state
        after the final norm, the `intermediate_output` block's output or None). `position_ids` is
        ignored (T5's positions are relative)."""
        mask = None
        if attention_mask is not None:
            b, s = attention_mask.shape
            mask = 1.0 - attention_mask.to(x.dtype).reshape(b, 1, -1, s).expand(b, 1, s, s)
            mask = mask.masked_fill(mask.to(torch.bool), -torch.finfo(x.dtype).max)
        bias = self._position_bias(x.shape[1], x.device)
        mask = bias if mask is None else mask + bias
        if intermediate_output is not None and intermediate_output < 0:
            intermediate_output = len(self.encoder.block) + intermediate_output
        intermediate = None
        for i, block in enumerate(self.encoder.block):
            x = block(x, mask)
            if i == intermediate_output:
                intermediate = x.clone()
        x = self.encoder.final_layer_norm(x)
        if intermediate is not None and final_layer_norm_intermediate:
            intermediate = self.encoder.final_layer_norm(intermediate)
        return x, intermediate

    def _position_bias(self, length: int, device: torch.device) -> torch.Tensor:
        """Block 0's relative position bias for this rank's heads (the whole table is on every rank)."""
        bias = self.encoder.block[0].layer[0].SelfAttention.compute_bias(length, device)
        tp = getattr(self, "_rp_tensor_parallel", None)
        if tp is None or tp.degree == 1:
            return bias
        local = bias.shape[1] // tp.degree
        return bias[:, tp.rank * local : (tp.rank + 1) * local]


def build(config: dict[str, Any], device: str | torch.device = "meta") -> T5Encoder:
    """A T5 encoder of `config` (ComfyUI's t5_config_xxl.json fields) with uninitialised float32 parameters
    on `device` (the loader builds it on the meta device, shards it, then fills it from the file)."""
    with torch.device(device):
        return T5Encoder(dict(config)).eval()
