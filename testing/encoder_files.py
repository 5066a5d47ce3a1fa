"""Small random text encoders written by transformers' own classes, in the key layouts ComfyUI's CLIPLoader
reads (T5EncoderModel's keys are ComfyUI's; the decoder-only models' are `model.` + the bare model's), so
the pack's text encoders are checked against files and numbers that no code of the pack made.

Each model has its kind's structure at a small width: T5 v1.1 (gated GELU, relative position bias in block
0), Mistral (grouped-query attention, no biases), Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms); the
decoder-only models keep ComfyUI's fixed head width of 128. `reference(kind, ids, ...)` runs transformers'
model on the same weights in float32, the arithmetic ComfyUI's text encoders use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..backend.encoders.llama.kind import MISTRAL3_FULL_LAYERS

VOCAB = 1000  # ids the tests draw from; the tables are this tall


def _t5(seed: int, vocab: int) -> Any:
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=vocab,
        d_model=32,
        d_kv=8,
        num_heads=4,
        d_ff=48,
        num_layers=3,
        feed_forward_proj="gated-gelu",
        relative_attention_num_buckets=32,
        dropout_rate=0.0,
    )
    torch.manual_seed(seed)
    return T5EncoderModel(config).eval()


def _llama_config(kind: str, vocab: int) -> Any:
    import transformers

    common = dict(
        vocab_size=vocab,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=512,
        attention_dropout=0.0,
    )
    if kind == "mistral3":
        return transformers.MistralConfig(**common, rms_norm_eps=1e-5, rope_theta=1e9, sliding_window=None)
    if kind == "qwen25":
        return transformers.Qwen2Config(**common, rms_norm_eps=1e-6, rope_theta=1e6)
    if kind == "qwen3":
        return transformers.Qwen3Config(**common, rms_norm_eps=1e-6, rope_theta=1e6)
    raise ValueError(kind)


MODEL_CLASSES = {"mistral3": "MistralModel", "qwen25": "Qwen2Model", "qwen3": "Qwen3Model"}
KINDS = ("t5", "mistral3", "qwen25", "qwen3")
PACK_KINDS = {"t5": "t5xxl", "mistral3": "mistral3_24b", "qwen25": "qwen25_7b", "qwen3": "qwen3"}


def make_model(kind: str, seed: int = 0, vocab: int = VOCAB) -> Any:
    """transformers' model of `kind` with random weights (biases and norms made non-trivial); `vocab`: the
    table's rows (a real tokenizer's ids need the real vocabulary)."""
    if kind == "t5":
        model = _t5(seed, vocab)
    else:
        import transformers

        config = _llama_config(kind, vocab)
        torch.manual_seed(seed)
        model = getattr(transformers, MODEL_CLASSES[kind])(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
            elif "relative_attention_bias" in name:
                p.copy_(torch.randn(p.shape, generator=g))
    return model


def state_dict_for_file(kind: str, model: Any) -> dict[str, torch.Tensor]:
    """The model's tensors under the keys ComfyUI's CLIPLoader reads."""
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if kind == "t5":
        return sd
    return {f"model.{k}": v for k, v in sd.items()}


def write_encoder(
    kind: str, folder: Path, dtype: torch.dtype = torch.float32, seed: int = 0, vocab: int = VOCAB
) -> Path:
    """`kind`'s small model saved as a safetensors file in `dtype` (fp8: the linear weights only, as
    ComfyUI's fp8 text encoder files hold them)."""
    model = make_model(kind, seed, vocab)
    sd = state_dict_for_file(kind, model)
    out = {}
    for key, value in sd.items():
        fp8 = dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        linear = value.ndim == 2 and not key.endswith("embed_tokens.weight") and "shared" not in key
        out[key] = value.to(dtype if (not fp8 or linear) else torch.bfloat16)
    name = str(dtype).removeprefix("torch.")
    path = folder / f"tiny-{kind}-{name}{'' if vocab == VOCAB else f'-v{vocab}'}.safetensors"
    save_file(out, str(path))
    return path


SCALED_FORMS = ("scaled_fp8", "comfy_quant")  # ComfyUI's legacy scaled fp8 layout, and its newer one


def write_scaled_encoder(kind: str, folder: Path, form: str = "scaled_fp8", seed: int = 0) -> Path:
    """`kind`'s small model as ComfyUI's scaled fp8 text encoder files hold it: every linear weight
    float8_e4m3fn with one float32 scale (testing/writers.py quantize_fp8), everything else bf16. `form`:
    "scaled_fp8", the legacy layout (a `scaled_fp8` marker, `scale_weight` and a `scale_input` of 1.0 per
    layer: t5xxl_fp8_e4m3fn_scaled, qwen_2.5_vl_7b_fp8_scaled), or "comfy_quant", what ComfyUI 0.33's
    `convert_old_quants` makes of it (`weight_scale` and a `comfy_quant` JSON tag per layer)."""
    import json

    from .writers import quantize_fp8

    if form not in SCALED_FORMS:
        raise ValueError(f"form={form!r}; use one of {SCALED_FORMS}")
    sd = state_dict_for_file(kind, make_model(kind, seed))
    out: dict[str, torch.Tensor] = {}
    if form == "scaled_fp8":
        out["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    tag = torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()), dtype=torch.uint8)
    for key, value in sd.items():
        linear = value.ndim == 2 and "relative_attention_bias" not in key and "shared" not in key
        if linear and not key.endswith("embed_tokens.weight"):
            layer = key.removesuffix(".weight")
            out[key], scale = quantize_fp8(value)
            if form == "scaled_fp8":
                out[f"{layer}.scale_weight"], out[f"{layer}.scale_input"] = scale, torch.ones(())
            else:
                out[f"{layer}.weight_scale"], out[f"{layer}.comfy_quant"] = scale, tag.clone()
        else:
            out[key] = value.to(torch.bfloat16)
    path = folder / f"tiny-{kind}-fp8-{form}-{seed}.safetensors"
    save_file(out, str(path))
    return path


def reference(
    kind: str, path: Path, ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """transformers' model of `kind` on the file's weights (upcast to float32) for `ids`: its last hidden
    state (after the final norm; for Mistral, whose files of fewer than 40 layers ComfyUI reads as FLUX.2's
    pruned variant without a final norm, the bare last hidden state)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), "pt") as f:
        key = "shared.weight" if kind == "t5" else "model.embed_tokens.weight"
        vocab = f.get_slice(key).get_shape()[0]
    model = make_model(kind, vocab=vocab)
    sd = {k.removeprefix("model.") if kind != "t5" else k: v.float() for k, v in load_file(str(path)).items()}
    model.load_state_dict(sd, strict=False)
    if kind == "mistral3" and model.config.num_hidden_layers < MISTRAL3_FULL_LAYERS:
        model.norm = torch.nn.Identity()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=attention_mask).last_hidden_state


__all__ = [
    "KINDS",
    "PACK_KINDS",
    "SCALED_FORMS",
    "VOCAB",
    "make_model",
    "reference",
    "state_dict_for_file",
    "write_encoder",
    "write_scaled_encoder",
]
