"""T5-XXL (T5 v1.1 XXL's encoder, FLUX.1's text encoder with CLIP-L), as the pack registers it."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from ..kind import EncoderDims, EncoderKind, Shapes, register
from . import model
from .tp import t5_tp

GATED = "encoder.block.0.layer.1.DenseReluDense.wi_1.weight"

# ComfyUI's comfy/text_encoders/t5_config_xxl.json (the fields its T5 reads)
T5_XXL = {
    "d_model": 4096,
    "d_kv": 64,
    "num_heads": 64,
    "d_ff": 10240,
    "num_layers": 24,
    "vocab_size": 32128,
    "dense_act_fn": "gelu_pytorch_tanh",
    "is_gated_act": True,
    "model_type": "t5",
    "relative_attention_num_buckets": 32,
    "layer_norm_epsilon": 1e-6,
}


def matches(keys: Collection[str]) -> bool:
    """T5 v1.1 (gated feed-forward) encoder keys as ComfyUI's CLIPLoader reads them."""
    return GATED in keys and "shared.weight" in keys and "encoder.final_layer_norm.weight" in keys


def is_clip_l(keys: Collection[str]) -> bool:
    """CLIP-L's text model (FLUX.1's other text encoder, which ComfyUI keeps)."""
    return (
        "text_model.encoder.layers.0.mlp.fc1.weight" in keys or "transformer.resblocks.0.ln_1.weight" in keys
    )


def config_from_shapes(shapes: Shapes) -> dict[str, Any]:
    vocab, width = shapes["shared.weight"]
    heads = shapes["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"][1]
    inner = shapes["encoder.block.0.layer.0.SelfAttention.q.weight"][0]
    layers = 1 + max(int(k.split(".")[2]) for k in shapes if k.startswith("encoder.block."))
    return {
        **T5_XXL,
        "d_model": width,
        "d_kv": inner // heads,
        "num_heads": heads,
        "d_ff": shapes[GATED][0],
        "num_layers": layers,
        "vocab_size": vocab,
        "relative_attention_num_buckets": shapes[
            "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        ][0],
    }


def dims(config: Mapping[str, Any]) -> EncoderDims:
    return EncoderDims(
        heads=config["num_heads"],
        head_dim=config["d_kv"],
        mlp=config["d_ff"],
        kv_heads=config["num_heads"],
        width=config["d_model"],
        layers=config["num_layers"],
        vocab=config["vocab_size"],
    )


T5XXL = register(
    EncoderKind(
        name="t5xxl",
        title="T5-XXL",
        comfy_classes=("T5",),
        clip_types={"flux": "FLUX.1 (T5-XXL with CLIP-L, ComfyUI's DualCLIPLoader type 'flux')"},
        matches=matches,
        prefix="",
        config_from_shapes=config_from_shapes,
        dims=dims,
        build=model.build,
        tp=t5_tp,
        stack="encoder",
        embedding="shared",
        presets={"t5-xxl": T5_XXL},
        companions={"CLIP-L": is_clip_l},
        # the bias [1, heads, S, S], the padding mask [B, 1, S, S] and their sum [B, heads, S, S]
        square_maps=lambda batch, heads: heads + batch + batch * heads,
        # "encoder.embed_tokens.weight": transformers' tied copy of `shared`, which ComfyUI ignores too
        extra_keys=lambda key: key in ("encoder.embed_tokens.weight", "spiece_model"),
    )
)
