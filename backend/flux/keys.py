"""FLUX.1's checkpoint facts: the BFL / ComfyUI key layout, header detection, configs and dims from shapes.

The layout is data (`FLUX1_KEYS`, read by everything in backend/checkpoint/): for every diffusers module
of FluxTransformer2DModel, the BFL module it lives in and, for a fused one (`qkv`, `linear1 = [q|k|v|mlp]`,
the final AdaLN's (shift, scale)), which rows. The key names are the ones diffusers'
`convert_flux_transformer_checkpoint_to_diffusers` uses; every width is inferred from shapes.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from ..checkpoint.files import CheckpointError
from ..checkpoint.keys import (
    Blocks,
    Fused,
    KeyLayout,
    bfl_names,
    block_count,
    diffusers_config_via_bfl,
    require,
    shapes_of,
)
from .dims import FluxDims
from .facts import config_from_dims, dims, rope_axes  # torch-free: the registry reads them

TITLE = "FLUX.1"

_QKV = ("hidden", "hidden", "hidden")
_LINEAR1 = ("hidden", "hidden", "hidden", "mlp")

_TOP: dict[str, tuple[str, Fused | None]] = {
    "time_text_embed.timestep_embedder.linear_1": ("time_in.in_layer", None),
    "time_text_embed.timestep_embedder.linear_2": ("time_in.out_layer", None),
    "time_text_embed.guidance_embedder.linear_1": ("guidance_in.in_layer", None),  # [dev] only
    "time_text_embed.guidance_embedder.linear_2": ("guidance_in.out_layer", None),
    "time_text_embed.text_embedder.linear_1": ("vector_in.in_layer", None),
    "time_text_embed.text_embedder.linear_2": ("vector_in.out_layer", None),
    "context_embedder": ("txt_in", None),
    "x_embedder": ("img_in", None),
    "proj_out": ("final_layer.linear", None),
    # BFL stores the final AdaLN output as (shift, scale); diffusers' AdaLayerNormContinuous (scale, shift).
    "norm_out.linear": ("final_layer.adaLN_modulation.1", Fused(("hidden", "hidden"), (1, 0))),
}
# A double block's joint attention: fused qkv per stream, RMS q/k norms, output projections (the same
# names in FLUX.1 and FLUX.2).
DOUBLE_ATTENTION: dict[str, tuple[str, Fused | None]] = {
    "attn.to_q": ("img_attn.qkv", Fused(_QKV, (0,))),
    "attn.to_k": ("img_attn.qkv", Fused(_QKV, (1,))),
    "attn.to_v": ("img_attn.qkv", Fused(_QKV, (2,))),
    "attn.add_q_proj": ("txt_attn.qkv", Fused(_QKV, (0,))),
    "attn.add_k_proj": ("txt_attn.qkv", Fused(_QKV, (1,))),
    "attn.add_v_proj": ("txt_attn.qkv", Fused(_QKV, (2,))),
    "attn.norm_q": ("img_attn.norm.query_norm", None),
    "attn.norm_k": ("img_attn.norm.key_norm", None),
    "attn.norm_added_q": ("txt_attn.norm.query_norm", None),
    "attn.norm_added_k": ("txt_attn.norm.key_norm", None),
    "attn.to_out.0": ("img_attn.proj", None),
    "attn.to_add_out": ("txt_attn.proj", None),
}
_DOUBLE: dict[str, tuple[str, Fused | None]] = {
    "norm1.linear": ("img_mod.lin", None),
    "norm1_context.linear": ("txt_mod.lin", None),
    **DOUBLE_ATTENTION,
    "ff.net.0.proj": ("img_mlp.0", None),
    "ff.net.2": ("img_mlp.2", None),
    "ff_context.net.0.proj": ("txt_mlp.0", None),
    "ff_context.net.2": ("txt_mlp.2", None),
}
_SINGLE: dict[str, tuple[str, Fused | None]] = {
    "norm.linear": ("modulation.lin", None),
    "attn.to_q": ("linear1", Fused(_LINEAR1, (0,))),
    "attn.to_k": ("linear1", Fused(_LINEAR1, (1,))),
    "attn.to_v": ("linear1", Fused(_LINEAR1, (2,))),
    "proj_mlp": ("linear1", Fused(_LINEAR1, (3,))),
    "attn.norm_q": ("norm.query_norm", None),
    "attn.norm_k": ("norm.key_norm", None),
    "proj_out": ("linear2", None),
}

FLUX1_KEYS = KeyLayout(
    top=_TOP,
    blocks=(
        Blocks("transformer_blocks.", "double_blocks.", _DOUBLE),
        Blocks("single_transformer_blocks.", "single_blocks.", _SINGLE),
    ),
)


# --------------------------------------------------------------------------------------------------
# Header detection


def matches_bfl(keys: Collection[str]) -> bool:
    """BFL double/single blocks with an `img_in` (Chroma has none) and FLUX.1's per-block modulation."""
    blocks = any(k.startswith(("double_blocks.", "single_blocks.")) for k in keys)
    shared_modulation = any(k.startswith("double_stream_modulation") for k in keys)  # FLUX.2's layout
    return blocks and "img_in.weight" in keys and not shared_modulation


def matches_diffusers(keys: Collection[str]) -> bool:
    shared_modulation = any(k.startswith("double_stream_modulation") for k in keys)
    return (
        "x_embedder.weight" in keys
        and any(k.startswith("single_transformer_blocks.") for k in keys)
        and not shared_modulation
    )


# --------------------------------------------------------------------------------------------------
# Shapes -> dims and configuration


def dims_from_bfl(keys_and_shapes: Mapping[str, Any]) -> FluxDims:
    """The FluxDims of a BFL checkpoint (prefix optional), from its keys and shapes alone."""
    shapes = shapes_of(bfl_names(keys_and_shapes, FLUX1_KEYS))
    hidden, in_channels = require(shapes, "img_in.weight", TITLE)
    double_blocks = block_count(shapes, "double_blocks.")
    single_blocks = block_count(shapes, "single_blocks.")
    norm = (
        "double_blocks.0.img_attn.norm.query_norm.scale"
        if double_blocks
        else "single_blocks.0.norm.query_norm.scale"
    )
    head_dim = require(shapes, norm, TITLE)[0]
    if hidden % head_dim:
        raise CheckpointError(
            f"hidden width {hidden} (img_in.weight) is not a multiple of the head width {head_dim} "
            f"({norm}); the checkpoint is not a FLUX.1 transformer"
        )
    return FluxDims(
        heads=hidden // head_dim,
        head_dim=head_dim,
        double_blocks=double_blocks,
        single_blocks=single_blocks,
        guidance=any(k.startswith("guidance_in.") for k in shapes),
        text_dim=shapes.get("txt_in.weight", (0, 4096))[1],
        pooled_dim=shapes.get("vector_in.in_layer.weight", (0, 768))[1],
        in_channels=in_channels,
    )


def config_from_bfl(keys_and_shapes: Mapping[str, Any]) -> dict[str, Any]:
    """The diffusers FluxTransformer2DModel config of a BFL checkpoint, from its keys and shapes alone.

    Accepts {key: shape} or {key: tensor}, under any prefix ComfyUI's loader strips (checkpoint/keys.py
    `transformer_prefix`), the q/k norms spelled `*_norm.scale` (BFL) or `*_norm.weight` (ComfyUI >= 0.14).
    Raises CheckpointError when a shape contradicts FLUX's structure.
    """
    shapes = shapes_of(bfl_names(keys_and_shapes, FLUX1_KEYS))
    found = dims_from_bfl(shapes)
    config: dict[str, Any] = {
        "patch_size": 1,
        "in_channels": found.in_channels,
        "num_layers": found.double_blocks,
        "num_single_layers": found.single_blocks,
        "attention_head_dim": found.head_dim,
        "num_attention_heads": found.heads,
        "joint_attention_dim": require(shapes, "txt_in.weight", TITLE)[1],
        "pooled_projection_dim": require(shapes, "vector_in.in_layer.weight", TITLE)[1],
        "guidance_embeds": found.guidance,
        "axes_dims_rope": rope_axes(found.head_dim),
    }
    out_channels = require(shapes, "final_layer.linear.weight", TITLE)[0]
    if out_channels != found.in_channels:
        config["out_channels"] = out_channels
    return config


def dims_from_diffusers(keys_and_shapes: Mapping[str, Any]) -> FluxDims:
    """The FluxDims of a FluxTransformer2DModel state dict, from its keys and shapes alone."""
    shapes = shapes_of(keys_and_shapes)

    def count(prefix: str) -> int:
        return len({k.split(".")[1] for k in shapes if k.startswith(prefix)})

    hidden, in_channels = require(shapes, "x_embedder.weight", TITLE)
    double_blocks = count("transformer_blocks.")
    norm = f"{'' if double_blocks else 'single_'}transformer_blocks.0.attn.norm_q.weight"
    head_dim = require(shapes, norm, TITLE)[0]
    return FluxDims(
        heads=hidden // head_dim,
        head_dim=head_dim,
        double_blocks=double_blocks,
        single_blocks=count("single_transformer_blocks."),
        guidance=any(k.startswith("time_text_embed.guidance_embedder.") for k in shapes),
        text_dim=shapes.get("context_embedder.weight", (0, 4096))[1],
        pooled_dim=shapes.get("time_text_embed.text_embedder.linear_1.weight", (0, 768))[1],
        in_channels=in_channels,
    )


def config_from_diffusers(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """The config of a diffusers-keyed single file: its BFL view read by `config_from_bfl`."""
    return diffusers_config_via_bfl(FLUX1_KEYS, dims_from_diffusers(shapes), shapes, config_from_bfl)


__all__ = [
    "DOUBLE_ATTENTION",
    "FLUX1_KEYS",
    "config_from_bfl",
    "config_from_diffusers",
    "config_from_dims",
    "dims",
    "dims_from_bfl",
    "dims_from_diffusers",
    "matches_bfl",
    "matches_diffusers",
    "rope_axes",
]
