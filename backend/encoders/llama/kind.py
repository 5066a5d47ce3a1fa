"""The decoder-only language models ComfyUI encodes prompts with, as the pack registers them: Mistral Small
3.x 24B (FLUX.2 [dev]), Qwen2.5-VL-7B's language model (Qwen-Image, Qwen-Image-Edit) and Qwen3 4B / 8B
(FLUX.2 [klein]). One model (llama/model.py), three kinds: each is ComfyUI's `Llama2_` with its own config."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from ..kind import EncoderDims, EncoderKind, Shapes, register
from . import model
from .tp import llama_tp

Q = "model.layers.0.self_attn.q_proj.weight"
K_BIAS = "model.layers.0.self_attn.k_proj.bias"
Q_NORM = "model.layers.0.self_attn.q_norm.weight"
HEAD_DIM = 128  # ComfyUI's Llama2Config family fixes it (a class attribute, not a config field)

# The fields of ComfyUI's configs (comfy/text_encoders/llama.py) that the shapes do not give.
MISTRAL3 = {
    "vocab_size": 131072,
    "hidden_size": 5120,
    "intermediate_size": 32768,
    "num_hidden_layers": 40,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000000.0,
    "head_dim": HEAD_DIM,
    "qkv_bias": False,
    "rope_dims": None,
    "q_norm": None,
    "final_norm": True,
}
QWEN25_VL_7B = {
    "vocab_size": 152064,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "max_position_embeddings": 128000,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "head_dim": HEAD_DIM,
    "qkv_bias": True,
    "rope_dims": [16, 24, 24],
    "q_norm": None,
    "final_norm": True,
}
QWEN3_4B = {
    "vocab_size": 151936,
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "head_dim": HEAD_DIM,
    "qkv_bias": False,
    "rope_dims": None,
    "q_norm": "gemma3",
    "final_norm": True,
}
QWEN3_8B = {**QWEN3_4B, "hidden_size": 4096, "intermediate_size": 12288}


def _is_lm(keys: Collection[str]) -> bool:
    return Q in keys and "model.embed_tokens.weight" in keys


def matches_mistral3(keys: Collection[str]) -> bool:
    return _is_lm(keys) and K_BIAS not in keys and Q_NORM not in keys


def matches_qwen25_vl(keys: Collection[str]) -> bool:
    return _is_lm(keys) and K_BIAS in keys


def matches_qwen3(keys: Collection[str]) -> bool:
    return _is_lm(keys) and Q_NORM in keys


# ComfyUI's full Mistral Small 3 has layer 39; a file without it is FLUX.2's pruned variant (30 layers)
MISTRAL3_FULL_LAYERS = 40


def _from_shapes(base: Mapping[str, Any], shapes: Shapes) -> dict[str, Any]:
    vocab, width = shapes["model.embed_tokens.weight"]
    layers = 1 + max(int(k.split(".")[2]) for k in shapes if k.startswith("model.layers."))
    return {
        **base,
        "vocab_size": vocab,
        "hidden_size": width,
        "num_hidden_layers": layers,
        "intermediate_size": shapes["model.layers.0.mlp.gate_proj.weight"][0],
        "num_attention_heads": shapes[Q][0] // HEAD_DIM,
        "num_key_value_heads": shapes["model.layers.0.self_attn.k_proj.weight"][0] // HEAD_DIM,
        "final_norm": "model.norm.weight" in shapes,
    }


def _mistral3_from_shapes(shapes: Shapes) -> dict[str, Any]:
    """ComfyUI reads a Mistral Small 3 file without layer 39 as FLUX.2's pruned variant (comfy/sd.py
    MISTRAL3_24B_PRUNED_FLUX2; comfy/text_encoders/flux.py `flux2_te(pruned=True)`), built without the final
    norm (fewer than 40 layers): its last stacked layer (30) is the bare last hidden state even where the file
    keeps the 40-layer model's `model.norm.weight`, which ComfyUI then leaves unread."""
    config = _from_shapes(MISTRAL3, shapes)
    return {**config, "final_norm": config["num_hidden_layers"] >= MISTRAL3_FULL_LAYERS}


def dims(config: Mapping[str, Any]) -> EncoderDims:
    return EncoderDims(
        heads=config["num_attention_heads"],
        head_dim=config["head_dim"],
        mlp=config["intermediate_size"],
        kv_heads=config["num_key_value_heads"],
        width=config["hidden_size"],
        layers=config["num_hidden_layers"],
        vocab=config["vocab_size"],
        max_tokens=config["max_position_embeddings"],
    )


def _kind(
    name: str,
    title: str,
    classes: tuple[str, ...],
    clip_types: dict[str, str],
    matches: Any,
    base: Mapping[str, Any],
    presets: dict[str, Any],
    extra: Any = lambda key: False,
    comfy_names: tuple[str, ...] = (),
    from_shapes: Any = None,
) -> EncoderKind:
    return register(
        EncoderKind(
            name=name,
            title=title,
            comfy_classes=classes,
            clip_types=clip_types,
            matches=matches,
            prefix="model.",
            config_from_shapes=from_shapes or (lambda shapes: _from_shapes(base, shapes)),
            dims=dims,
            build=model.build,
            tp=llama_tp,
            stack="model",
            embedding="model.embed_tokens",
            presets=presets,
            extra_keys=extra,
            comfy_names=comfy_names,
        )
    )


MISTRAL3_24B = _kind(
    "mistral3_24b",
    "Mistral Small 3 24B",
    ("Mistral3Small24B",),
    {"flux2": "FLUX.2 [dev] (Mistral Small 3 24B, ComfyUI's CLIPLoader type 'flux2')"},
    matches_mistral3,
    MISTRAL3,
    {"mistral3-24b": MISTRAL3},
    # the tokenizer (Mistral's tekken JSON) travels in the file; ComfyUI reads it, the workers do not. A pruned
    # file's final norm is one ComfyUI does not build (_mistral3_from_shapes): left unread, as ComfyUI does
    extra=lambda key: (
        key in ("tekken_model", "model.norm.weight")
        or key.startswith("lm_head.")
        or key.startswith("model.lm_head.")
    ),
    from_shapes=_mistral3_from_shapes,
)
QWEN25_VL_7B_KIND = _kind(
    "qwen25_7b",
    "Qwen2.5-VL 7B",
    ("Qwen25_7BVLI",),
    {"qwen_image": "Qwen-Image and Qwen-Image-Edit (Qwen2.5-VL 7B, ComfyUI's CLIPLoader type 'qwen_image')"},
    matches_qwen25_vl,
    QWEN25_VL_7B,
    {"qwen2.5-vl-7b": QWEN25_VL_7B},
    # the vision tower (Qwen-Image-Edit's reference images) stays in ComfyUI's process for now
    extra=lambda key: (
        key.startswith("visual.") or key.startswith("lm_head.") or key.startswith("model.lm_head.")
    ),
)
QWEN3 = _kind(
    "qwen3",
    "Qwen3 4B / 8B",
    ("Qwen3_4B", "Qwen3_8B"),
    {"flux2": "FLUX.2 [klein] (Qwen3 4B or 8B, ComfyUI's CLIPLoader type 'flux2')"},
    matches_qwen3,
    QWEN3_4B,
    {"qwen3-4b": QWEN3_4B, "qwen3-8b": QWEN3_8B},
    extra=lambda key: key.startswith("lm_head.") or key.startswith("model.lm_head."),
    comfy_names=("qwen3_4b", "qwen3_8b"),
)
