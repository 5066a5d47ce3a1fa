"""FLUX.2 checkpoint layouts: BFL / ComfyUI single files <-> diffusers' Flux2Transformer2DModel.

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
No biases anywhere. Every width is inferred from shapes (diffusers' converter is fixed to released
configs by its callers; the tests need small random models).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..config import FluxDims
from ..flux.convert import (
    COMFY_PREFIX,
    COMFY_QUANT,
    DOUBLE_ATTENTION,
    INPUT_SCALE,
    QUANT_METADATA,
    WEIGHT_SCALE,
    CheckpointError,
    Fused,
    KeyLayout,
    Source,
    _block_count,
    _gather_rows,
    _require,
    _shapes,
    assemble_bfl,
    strip_prefix,
)

# A key only FLUX.2 has (diffusers' CHECKPOINT_KEY_NAMES["flux2"] tests the single-stream one).
FLUX2_MARKERS = ("double_stream_modulation_img.lin.weight", "single_stream_modulation.lin.weight")
# ComfyUI's quantized-layer companions of `<layer>.weight` (flux/convert.py describes the layout).
QUANT_SUFFIXES = (WEIGHT_SCALE, INPUT_SCALE, COMFY_QUANT)
# How save_flux2_checkpoint declares its quantized layers: per-layer `comfy_quant` tensors (newer ComfyUI)
# or the header's `_quantization_metadata` (ComfyUI 0.3.75).
MIXED_FORMS = ("comfy_quant", "metadata")

# diffusers module -> (BFL module, fused part or None): flux.convert's key tables, FLUX.2's names.
_TOP: dict[str, tuple[str, Fused | None]] = {
    "x_embedder": ("img_in", None),
    "context_embedder": ("txt_in", None),
    "time_guidance_embed.timestep_embedder.linear_1": ("time_in.in_layer", None),
    "time_guidance_embed.timestep_embedder.linear_2": ("time_in.out_layer", None),
    "double_stream_modulation_img.linear": ("double_stream_modulation_img.lin", None),
    "double_stream_modulation_txt.linear": ("double_stream_modulation_txt.lin", None),
    "single_stream_modulation.linear": ("single_stream_modulation.lin", None),
    "proj_out": ("final_layer.linear", None),
    "norm_out.linear": ("final_layer.adaLN_modulation.1", Fused(("hidden", "hidden"), (1, 0))),
}
_GUIDANCE: dict[str, tuple[str, Fused | None]] = {
    "time_guidance_embed.guidance_embedder.linear_1": ("guidance_in.in_layer", None),
    "time_guidance_embed.guidance_embedder.linear_2": ("guidance_in.out_layer", None),
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


FLUX2_KEYS = KeyLayout(top=_TOP, guidance=_GUIDANCE, double=_DOUBLE, single=_SINGLE, biases=False)


def flux2_sources(dims: FluxDims) -> dict[str, Source]:
    """diffusers parameter name -> where it lives in a BFL FLUX.2 checkpoint (no key prefix)."""
    return FLUX2_KEYS.sources(dims)


# --------------------------------------------------------------------------------------------------
# Shapes -> configuration


def looks_flux2(keys: Any) -> bool:
    """True for BFL / ComfyUI FLUX.2 keys (prefix optional)."""
    return any(k.endswith(marker) for k in keys for marker in FLUX2_MARKERS)


def flux2_config_from_bfl(keys_and_shapes: Mapping[str, Any]) -> dict[str, Any]:
    """The diffusers Flux2Transformer2DModel config of a BFL / ComfyUI FLUX.2 file, from shapes alone.

    RoPE has no weights: axes are head_dim / 4 each, which is [dev]'s and [klein]'s (32, 32, 32, 32).
    """
    shapes = _shapes(strip_prefix(keys_and_shapes))
    hidden, in_channels = _require(shapes, "img_in.weight", "FLUX.2")
    double_blocks, single_blocks = (
        _block_count(shapes, "double_blocks."),
        _block_count(shapes, "single_blocks."),
    )
    norm = (
        "double_blocks.0.img_attn.norm.query_norm.scale"
        if double_blocks
        else "single_blocks.0.norm.query_norm.scale"
    )
    head_dim = _require(shapes, norm, "FLUX.2")[0]
    if hidden % head_dim or head_dim % 4:
        raise CheckpointError(
            f"hidden width {hidden} (img_in.weight) and head width {head_dim} ({norm}) do not make "
            "whole heads of four RoPE axes; the checkpoint is not a FLUX.2 transformer"
        )
    mod = _require(shapes, "single_stream_modulation.lin.weight", "FLUX.2")
    if mod != (3 * hidden, hidden):
        raise CheckpointError(
            f"single_stream_modulation.lin.weight is {list(mod)}, FLUX.2 needs [{3 * hidden}, {hidden}]"
        )
    linear1 = _require(shapes, "single_blocks.0.linear1.weight", "FLUX.2")[0] if single_blocks else None
    mlp = (
        (linear1 - 3 * hidden) // 2
        if linear1
        else _require(shapes, "double_blocks.0.img_mlp.2.weight", "FLUX.2")[1]
    )
    config: dict[str, Any] = {
        "patch_size": 1,
        "in_channels": in_channels,
        "num_layers": double_blocks,
        "num_single_layers": single_blocks,
        "attention_head_dim": head_dim,
        "num_attention_heads": hidden // head_dim,
        "joint_attention_dim": _require(shapes, "txt_in.weight", "FLUX.2")[1],
        "timestep_guidance_channels": _require(shapes, "time_in.in_layer.weight", "FLUX.2")[1],
        "mlp_ratio": mlp / hidden,
        "axes_dims_rope": (head_dim // 4,) * 4,
        "rope_theta": 2000,
        "eps": 1e-6,
        "guidance_embeds": any(k.startswith("guidance_in.") for k in shapes),
    }
    out_channels = _require(shapes, "final_layer.linear.weight", "FLUX.2")[0]
    if out_channels != in_channels:
        config["out_channels"] = out_channels
    return config


# --------------------------------------------------------------------------------------------------
# Converters (whole tensors; the sharded loader reads slices through flux2_sources instead)


def dequantize(bfl: Mapping[str, torch.Tensor], key: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`key` in `dtype`, with ComfyUI's per-tensor `weight_scale` applied when the file has one."""
    tensor = bfl[key].to(dtype)
    scale_key = key.removesuffix(".weight") + WEIGHT_SCALE
    if key.endswith(".weight") and scale_key in bfl:
        tensor = tensor * bfl[scale_key].to(dtype)
    return tensor


def flux2_bfl_to_diffusers(
    state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """A BFL / ComfyUI FLUX.2 state dict (prefix, fp8 + weight_scale optional) in diffusers' keys."""
    bfl = strip_prefix(state_dict)
    dims = FluxDims.from_diffusers_config(flux2_config_from_bfl(bfl))
    sources = flux2_sources(dims)
    known = {s.key for s in sources.values()}
    unknown = sorted(k for k in bfl if k not in known and not k.endswith(QUANT_SUFFIXES))
    if unknown:
        raise CheckpointError(f"{len(unknown)} tensors are not part of FLUX.2, e.g. {unknown[:3]}")
    out = {}
    for name, source in sources.items():
        if source.key not in bfl:
            raise CheckpointError(
                f"tensor '{source.key}' is missing; the checkpoint is incomplete or not FLUX.2"
            )
        out[name] = _gather_rows(dequantize(bfl, source.key, dtype), source.rows)
    return out


def flux2_diffusers_to_bfl(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A Flux2Transformer2DModel's weights in BFL layout (fused qkv, final AdaLN as (shift, scale))."""
    dims = FluxDims.from_diffusers_config(model.config)
    state = model.state_dict()
    sources = flux2_sources(dims)
    if set(sources) != set(state):
        raise ValueError(
            f"not a Flux2Transformer2DModel state dict: missing {sorted(set(sources) - set(state))[:3]}, "
            f"unknown {sorted(set(state) - set(sources))[:3]}"
        )
    return {key: tensor.contiguous() for key, tensor in assemble_bfl(sources, state).items()}


# fp8 e4m3fn's largest finite value: ComfyUI's per-tensor scale maps max |W| onto it.
FP8_MAX = 448.0


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 e4m3fn values, float32 scalar scale) with weight ~= values x scale."""
    scale = (weight.abs().max().float() / FP8_MAX).clamp(min=1e-12)
    return (weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale.reshape(())


def save_flux2_checkpoint(
    model: torch.nn.Module,
    path: str | Path,
    *,
    fp8_mixed: str | bool | None = None,
    comfy_prefix: bool = False,
) -> str:
    """Write a Flux2Transformer2DModel as a BFL / ComfyUI single file; returns the path.

    fp8_mixed: the layout of Comfy-Org's `flux2_dev_fp8mixed.safetensors`: every linear inside the
    blocks is float8_e4m3fn + a float32 `weight_scale`; embedders, shared modulation, final layer and
    norms stay bf16. The quantized layers are declared as ComfyUI reads them (MIXED_FORMS):
    "comfy_quant" (or True), a `<layer>.comfy_quant` JSON tensor each (newer ComfyUI), or "metadata", the header's
    `_quantization_metadata` with an `input_scale` per layer as well (ComfyUI 0.3.75, which names the
    layers without `model.diffusion_model.`). comfy_prefix: keys under `model.diffusion_model.` (full
    checkpoints).
    """
    from safetensors.torch import save_file

    if fp8_mixed is True:  # the writer's first form, kept for its callers
        fp8_mixed = "comfy_quant"
    if fp8_mixed not in (None, False, *MIXED_FORMS):
        raise ValueError(f"fp8_mixed={fp8_mixed!r}; use None or one of {MIXED_FORMS}")
    bfl = flux2_diffusers_to_bfl(model)
    out: dict[str, torch.Tensor] = {}
    fmt = {"format": "float8_e4m3fn"}
    layers: dict[str, dict[str, str]] = {}
    for key, tensor in bfl.items():
        in_block = key.startswith(("double_blocks.", "single_blocks.")) and key.endswith(".weight")
        if fp8_mixed and in_block:
            layer = key.removesuffix(".weight")
            out[key], out[layer + WEIGHT_SCALE] = quantize_fp8(tensor)
            layers[layer] = fmt
            if fp8_mixed == "comfy_quant":
                out[layer + COMFY_QUANT] = torch.tensor(list(json.dumps(fmt).encode()), dtype=torch.uint8)
            else:
                out[layer + INPUT_SCALE] = torch.ones((), dtype=torch.float32)
        elif fp8_mixed:
            out[key] = tensor.to(torch.bfloat16)
        else:
            out[key] = tensor
    if comfy_prefix:
        out = {COMFY_PREFIX + k: v for k, v in out.items()}
    metadata = None
    if fp8_mixed == "metadata":
        metadata = {QUANT_METADATA: json.dumps({"format_version": "1.0", "layers": layers})}
    save_file(out, str(path), metadata=metadata)
    return str(path)


__all__ = [
    "FLUX2_KEYS",
    "FLUX2_MARKERS",
    "MIXED_FORMS",
    "QUANT_SUFFIXES",
    "dequantize",
    "flux2_bfl_to_diffusers",
    "flux2_config_from_bfl",
    "flux2_diffusers_to_bfl",
    "flux2_sources",
    "looks_flux2",
    "quantize_fp8",
    "save_flux2_checkpoint",
]
