"""The decoder-only language models ComfyUI uses as text encoders (Mistral Small 3.x 24B for FLUX.2 [dev],
Qwen2.5-VL-7B's language model for Qwen-Image, Qwen3 4B/8B for FLUX.2 [klein]) as ComfyUI computes them.

All three are ComfyUI's `Llama2_` (comfy/text_encoders/llama.py) with another config, so this is one module:
grouped-query attention with rotary embeddings (Qwen2.5-VL's multimodal rotary sections when the caller passes
3-row position ids), optional q/k/v biases (Qwen2.5) and per-head q/k RMS norms (Qwen3), a SiLU-gated MLP,
RMS norms. ComfyUI's arithmetic, not transformers': everything computes in float32 whatever dtype the weights
are held in (ComfyUI's text encoders upcast to float32), the rotary embedding is ComfyUI's cos/sin tables
applied with addcmul, masks use `finfo.min / 4`, and `intermediate_output` selects layers exactly as
`Llama2_.forward` does (an index, a list of indices stacked on dim 1, or "all"). Parameter names are ComfyUI's
`Llama2_`'s (the files' keys without "model.").

Tensor parallelism (tp.py): q/k/v and gate/up by columns (biases with them), o and down by rows; each attention
module finds its local query and key/value heads from its projections' widths, so a rank holds whole heads
and whole key/value groups (the kind checks that the degree divides both).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...parallel.weights import UpcastLinear
from ..layers import PromptEmbedding


class RMSNorm(nn.Module):
    """ComfyUI's RMSNorm (`comfy.rmsnorm.rms_norm`: torch's rms_norm with the weight cast to the input's dtype)."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, weight=self.weight.to(x.dtype), eps=self.eps)


def rope_tables(config: dict[str, Any], position_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """comfy/text_encoders/llama.py precompute_freqs_cis: (cos, sin, -sin) halves for `position_ids` [1, S]
    or, for Qwen2.5-VL's multimodal rotary embedding, [3, S] (temporal, height, width rows cut into the
    config's `rope_dims` sections)."""
    head_dim, theta, sections = config["head_dim"], config["rope_theta"], config.get("rope_dims")
    numerator = torch.arange(0, head_dim, 2, device=position_ids.device).float()
    inv_freq = 1.0 / (theta ** (numerator / head_dim))
    expanded = inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
    freqs = (expanded.float() @ position_ids[:, None, :].float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if sections is not None and position_ids.shape[0] > 1:
        mrope = list(sections) * 2
        cos = torch.cat([m[i % 3] for i, m in enumerate(cos.split(mrope, dim=-1))], dim=-1).unsqueeze(0)
        sin = torch.cat([m[i % 3] for i, m in enumerate(sin.split(mrope, dim=-1))], dim=-1).unsqueeze(0)
    else:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = sin.shape[-1] // 2
    return cos, sin[..., :half], -sin[..., half:]


def apply_rope(x: torch.Tensor, tables: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """comfy/text_encoders/llama.py apply_rope for one of q / k ([B, H, S, head_dim])."""
    cos, sin, nsin = tables
    out = x * cos
    half = out.shape[-1] // 2
    out[..., :half].addcmul_(x[..., half:], nsin)
    out[..., half:].addcmul_(x[..., :half], sin)
    return out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        width, head_dim = config["hidden_size"], config["head_dim"]
        bias = bool(config.get("qkv_bias"))
        self.head_dim = head_dim
        self.q_proj = UpcastLinear(width, config["num_attention_heads"] * head_dim, bias=bias)
        self.k_proj = UpcastLinear(width, config["num_key_value_heads"] * head_dim, bias=bias)
        self.v_proj = UpcastLinear(width, config["num_key_value_heads"] * head_dim, bias=bias)
        self.o_proj = UpcastLinear(config["num_attention_heads"] * head_dim, width, bias=False)
        per_head = config.get("q_norm") is not None  # Qwen3's RMS norm over each head's q and k
        self.q_norm = RMSNorm(head_dim, config["rms_norm_eps"]) if per_head else None
        self.k_norm = RMSNorm(head_dim, config["rms_norm_eps"]) if per_head else None

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None, rope: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        heads, groups = q.shape[-1] // self.head_dim, k.shape[-1] // self.head_dim  # this rank's
        q = q.view(b, s, heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, groups, self.head_dim).transpose(1, 2)
        v = v.view(b, s, groups, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        if heads != groups:  # ComfyUI repeats the key/value heads when a mask is given (always, here)
            k = k.repeat_interleave(heads // groups, dim=1)
            v = v.repeat_interleave(heads // groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        width, inner = config["hidden_size"], config["intermediate_size"]
        self.gate_proj = UpcastLinear(width, inner, bias=False)
        self.up_proj = UpcastLinear(width, inner, bias=False)
        self.down_proj = UpcastLinear(inner, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config["hidden_size"], config["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(config["hidden_size"], config["rms_norm_eps"])

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None, rope: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), mask, rope)
        return x + self.mlp(self.post_attention_layernorm(x))


Intermediate = int | list[int] | str | None


class LanguageModel(nn.Module):
    """ComfyUI's `Llama2_` as a text encoder: `embed(ids)`, then `forward(x, ...)` on the embeddings."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.config = dict(config)
        self.embed_tokens = PromptEmbedding(config["vocab_size"], config["hidden_size"])
        self.layers = nn.ModuleList([TransformerBlock(config) for _ in range(config["num_hidden_layers"])])
        self.norm = (
            RMSNorm(config["hidden_size"], config["rms_norm_eps"]) if config.get("final_norm", True) else None
        )

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        intermediate_output: Intermediate = None,
        final_layer_norm_intermediate: bool = True,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """comfy/text_encoders/llama.py Llama2_.forward on float32 embeddings [B, S, D] (no KV cache): (the
        last hidden state, after the final norm when the model has one; the selected intermediate output)."""
        s = x.shape[1]
        if position_ids is None:
            position_ids = torch.arange(0, s, device=x.device).unsqueeze(0)
        rope = rope_tables(self.config, position_ids.to(x.device))
        mask = None
        low = torch.finfo(x.dtype).min / 4
        if attention_mask is not None:
            b = attention_mask.shape[0]
            mask = 1.0 - attention_mask.to(x.dtype).reshape(b, 1, -1, attention_mask.shape[-1]).expand(
                b, 1, s, attention_mask.shape[-1]
            )
            mask = mask.masked_fill(mask.to(torch.bool), low)
        if s > 1:
            causal = torch.empty(s, s, dtype=x.dtype, device=x.device).fill_(low).triu_(1)
            mask = causal if mask is None else mask + causal
        every: list[torch.Tensor] | None = None
        only: set[int] | None = None
        if isinstance(intermediate_output, list):
            every, only = [], set(intermediate_output)
        elif intermediate_output == "all":
            every, intermediate_output = [], None
        elif isinstance(intermediate_output, int) and intermediate_output < 0:
            intermediate_output = len(self.layers) + intermediate_output
        intermediate = None
        for i, layer in enumerate(self.layers):
            if every is not None and (only is None or i in only):
                every.append(x.unsqueeze(1).clone())
            x = layer(x, mask, rope)
            if i == intermediate_output:
                intermediate = x.clone()
        if self.norm is not None:
            x = self.norm(x)
        if every is not None:
            if only is None or len(self.layers) in only:
                every.append(x.unsqueeze(1).clone())
            intermediate = torch.cat(every, dim=1)
        if intermediate is not None and final_layer_norm_intermediate and self.norm is not None:
            intermediate = self.norm(intermediate)
        return x, intermediate


def build(config: dict[str, Any], device: str | torch.device = "meta") -> LanguageModel:
    """A language model of `config` (ComfyUI's Llama2Config fields, `head_dim` included) with uninitialised
    float32 parameters on `device`."""
    with torch.device(device):
        return LanguageModel(config).eval()
