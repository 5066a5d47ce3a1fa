"""FLUX.2's checkpoint facts: the BFL / ComfyUI key layout, header detection, configs from shapes.

The files ComfyUI users have (models/diffusion_models/):
* BFL `flux2-dev.safetensors` (black-forest-labs/FLUX.2-dev, bf16) and the [klein] files: BFL keys.
* Comfy-Org/flux2-dev `split_files/diffusion_models/flux2_dev_fp8mixed.safetensors`: the same keys,
  most linears stored as float8_e4m3fn with a per-tensor `<layer>.weight_scale` (float32; the weight is
  weight x weight_scale), a `<layer>.comfy_quant` marker (UTF-8 JSON such as {"format":
  "float8_e4m3fn"} as uint8) and sometimes an `<layer>.input_scale`; the other tensors bf16 ("mixed").
* ComfyUI full checkpoints put the transformer under `model.diffusion_model.`.
* diffusers folders (black-forest-labs/FLUX.2-dev `transformer/`) hold Flux2Transformer2DModel keys.

BFL keys (from diffusers 0.42.1 `loaders/single_file_utils.py: convert_flux2_transformer_checkpoint_to_
diffusers`, whose key names this table uses; ComfyUI detects FLUX.2 by the same
`double_stream_modulation_img.lin.weight` family of keys, comfy/model_detection.py):
  img_in, txt_in, time_in.{in,out}_layer, guidance_in.{in,out}_layer ([dev] only),
  double_stream_modulation_{img,txt}.lin, single_stream_modulation.lin   (shared by all blocks),
  double_blocks.N.{img,txt}_attn.qkv = [q | k | v], .proj, .norm.{query,key}_norm.scale,
  double_blocks.N.{img,txt}_mlp.0 = [gate | up] (SwiGLU), .2,
  single_blocks.N.linear1 = [q | k | v | gate | up] (diffusers keeps it fused: to_qkv_mlp_proj),
  single_blocks.N.linear2 over cat(attention, mlp) (diffusers: attn.to_out), .norm.{query,key}_norm.scale,
  final_layer.adaLN_modulation.1 = (shift, scale) where diffusers' norm_out.linear is (scale, shift),
  final_layer.linear.
ComfyUI >= 0.14's ModelSave names the norms `*_norm.weight` (torch's RMSNorm) and
puts every key under `model.diffusion_model.`: checkpoint/keys.py `bfl_names` reads both. No biases anywhere. Every width is inferred from shapes (diffusers' converter is fixed to released
configs by its callers; the tests need small random models). ComfyUI's fp8 "mixed" files are read by the
shared loader (backend/checkpoint/quant.py).
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
from ..flux.dims import FluxDims
from ..flux.keys import DOUBLE_ATTENTION
from .facts import config_from_dims, dims  # torch-free: the registry reads them

# Keys only FLUX.2 has (diffusers' CHECKPOINT_KEY_NAMES["flux2"] tests the single-stream one).
FLUX2_MARKERS = ("double_stream_modulation_img.lin.weight", "single_stream_modulation.lin.weight")

# diffusers module -> (BFL module, fused part or None): FLUX.1's key tables, FLUX.2's names.
_TOP: dict[str, tuple[str, Fused | None]] = {
    "x_embedder": ("img_in", None),
    "context_embedder": ("txt_in", None),
    "time_guidance_embed.timestep_embedder.linear_1": ("time_in.in_layer", None),
    "time_guidance_embed.timestep_embedder.linear_2": ("time_in.out_layer", None),
    "time_guidance_embed.guidance_embedder.linear_1": ("guidance_in.in_layer", None),  # [dev] only
    "time_guidance_embed.guidance_embedder.linear_2": ("guidance_in.out_layer", None),
    "double_stream_modulation_img.linear": ("double_stream_modulation_img.lin", None),
    "double_stream_modulation_txt.linear": ("double_stream_modulation_txt.lin", None),
    "single_stream_modulation.linear": ("single_stream_modulation.lin", None),
    "proj_out": ("final_layer.linear", None),
    "norm_out.linear": ("final_layer.adaLN_modulation.1", Fused(("hidden", "hidden"), (1, 0))),
}
_DOUBLE: dict[str, tuple[str, Fused | None]] = {
    **DOUBLE_ATTENTION,
    "ff.linear_in": ("img_mlp.0", None),
    "ff.linear_out": ("img_mlp.2", None),
    "ff_context.linear_in": ("txt_mlp.0", None),
    "ff_context.linear_out": ("txt_mlp.2", None),
}
_SINGLE: dict[str, tuple[str, Fused | None]] = {
    "attn.to_qkv_mlp_proj": ("linear1", None),
    "attn.to_out": ("linear2", None),
    "attn.norm_q": ("norm.query_norm", None),
    "attn.norm_k": ("norm.key_norm", None),
}

FLUX2_KEYS = KeyLayout(
    top=_TOP,
    blocks=(
        Blocks("transformer_blocks.", "double_blocks.", _DOUBLE),
        Blocks("single_transformer_blocks.", "single_blocks.", _SINGLE),
    ),
)


# --------------------------------------------------------------------------------------------------
# Header detection


def matches_bfl(keys: Collection[str]) -> bool:
    return "img_in.weight" in keys and any(k in keys for k in FLUX2_MARKERS)


def matches_diffusers(keys: Collection[str]) -> bool:
    return "x_embedder.weight" in keys and "double_stream_modulation_img.linear.weight" in keys


# --------------------------------------------------------------------------------------------------
# Shapes -> configuration


def config_from_bfl(keys_and_shapes: Mapping[str, Any]) -> dict[str, Any]:
    """The diffusers Flux2Transformer2DModel config of a BFL / ComfyUI FLUX.2 file, from shapes alone.

    RoPE has no weights: axes are head_dim / 4 each, which is [dev]'s and [klein]'s (32, 32, 32, 32).
    """
    shapes = shapes_of(bfl_names(keys_and_shapes, FLUX2_KEYS))
    hidden, in_channels = require(shapes, "img_in.weight", "FLUX.2")
    double_blocks, single_blocks = (
        block_count(shapes, "double_blocks."),
        block_count(shapes, "single_blocks."),
    )
    norm = (
        "double_blocks.0.img_attn.norm.query_norm.scale"
        if double_blocks
        else "single_blocks.0.norm.query_norm.scale"
    )
    head_dim = require(shapes, norm, "FLUX.2")[0]
    if hidden % head_dim or head_dim % 4:
        raise CheckpointError(
            f"hidden width {hidden} (img_in.weight) and head width {head_dim} ({norm}) do not make "
            "whole heads of four RoPE axes; the checkpoint is not a FLUX.2 transformer"
        )
    mod = require(shapes, "single_stream_modulation.lin.weight", "FLUX.2")
    if mod != (3 * hidden, hidden):
        raise CheckpointError(
            f"single_stream_modulation.lin.weight is {list(mod)}, FLUX.2 needs [{3 * hidden}, {hidden}]"
        )
    linear1 = require(shapes, "single_blocks.0.linear1.weight", "FLUX.2")[0] if single_blocks else None
    mlp = (
        (linear1 - 3 * hidden) // 2
        if linear1
        else require(shapes, "double_blocks.0.img_mlp.2.weight", "FLUX.2")[1]
    )
    config: dict[str, Any] = {
        "patch_size": 1,
        "in_channels": in_channels,
        "num_layers": double_blocks,
        "num_single_layers": single_blocks,
        "attention_head_dim": head_dim,
        "num_attention_heads": hidden // head_dim,
        "joint_attention_dim": require(shapes, "txt_in.weight", "FLUX.2")[1],
        "timestep_guidance_channels": require(shapes, "time_in.in_layer.weight", "FLUX.2")[1],
        "mlp_ratio": mlp / hidden,
        "axes_dims_rope": (head_dim // 4,) * 4,
        "rope_theta": 2000,
        "eps": 1e-6,
        "guidance_embeds": any(k.startswith("guidance_in.") for k in shapes),
    }
    out_channels = require(shapes, "final_layer.linear.weight", "FLUX.2")[0]
    if out_channels != in_channels:
        config["out_channels"] = out_channels
    return config


def config_from_diffusers(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """The config of a diffusers-keyed FLUX.2 file: its shapes mapped to the BFL view, then read as BFL."""
    hidden, in_channels = shapes["x_embedder.weight"]
    head_dim = next(s[0] for k, s in shapes.items() if k.endswith("attn.norm_q.weight"))
    single = len({k.split(".")[1] for k in shapes if k.startswith("single_transformer_blocks.")})
    if single:
        mlp = (shapes["single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight"][0] - 3 * hidden) // 2
    else:
        mlp = shapes["transformer_blocks.0.ff.linear_out.weight"][1]
    found = FluxDims(
        heads=hidden // head_dim,
        head_dim=head_dim,
        double_blocks=len({k.split(".")[1] for k in shapes if k.startswith("transformer_blocks.")}),
        single_blocks=single,
        guidance=any(k.startswith("time_guidance_embed.guidance_embedder.") for k in shapes),
        mlp=mlp,
        mlp_ratio=mlp / hidden,
        text_dim=shapes["context_embedder.weight"][1],
        in_channels=in_channels,
    )
    return diffusers_config_via_bfl(FLUX2_KEYS, found, shapes, config_from_bfl)


__all__ = [
    "FLUX2_KEYS",
    "FLUX2_MARKERS",
    "config_from_bfl",
    "config_from_diffusers",
    "config_from_dims",
    "dims",
    "matches_bfl",
    "matches_diffusers",
]
