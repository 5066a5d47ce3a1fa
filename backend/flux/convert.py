"""Key mapping between the BFL / ComfyUI single-file FLUX layout and diffusers' FluxTransformer2DModel.

The mapping is data (`bfl_sources`): for every diffusers parameter, the BFL tensor it lives in and
which rows of it. The converters below and the sharded checkpoint loader (load.py) both read it, so
the loader can fetch a rank's slice of a fused BFL tensor (`qkv`, `linear1 = [q|k|v|mlp]`) straight
from disk without materialising the whole tensor.

Why not diffusers' `convert_flux_transformer_checkpoint_to_diffusers`: it hard-codes the width 3072,
so it cannot convert the small random models the tests use, and it has no inverse. Every width here
is inferred from tensor shapes; the key names are the ones that converter uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError, FluxDims

# ComfyUI's full checkpoints (and some diffusion_models files) put the transformer under this prefix.
COMFY_PREFIX = "model.diffusion_model."

# ComfyUI's quantized ("mixed precision") layers, e.g. Comfy-Org's flux2_dev_fp8mixed.safetensors: some
# linears are stored quantized, each with companions `<layer>.weight_scale` (the per-tensor scale:
# comfy/quant_ops.py TensorCoreFP8Layout.dequantize is `weight.to(dtype) * scale`) and optionally
# `<layer>.input_scale` (quantizes activations for fp8 matmuls only). Which layers, in which format, is
# declared in either of two forms, both read by the loader (flux/load.py) and written by the test writer
# (flux2/convert.py save_flux2_checkpoint):
# * `<layer>.comfy_quant`: a uint8 tensor holding UTF-8 JSON such as {"format": "float8_e4m3fn"} (newer
#   ComfyUI: comfy/ops.py mixed_precision_ops._load_from_state_dict; comfy/utils.py convert_old_quants);
# * the safetensors header metadata `_quantization_metadata` = JSON {"format_version": "1.0", "layers":
#   {"<layer>": {"format": "float8_e4m3fn"}}} (ComfyUI 0.3.75: comfy/model_detection.py
#   detect_layer_quantization, comfy/ops.py mixed_precision_ops).
COMFY_QUANT, WEIGHT_SCALE, INPUT_SCALE = ".comfy_quant", ".weight_scale", ".input_scale"
QUANT_METADATA = "_quantization_metadata"
# The formats whose weights are one fp8 tensor times one scale (comfy/quant_ops.py QUANT_ALGOS: "parameters"
# weight_scale / input_scale, no group_size): format -> the dtype its weights are stored in. Others (nvfp4's
# block scales and second scale, anything newer) are refused by name.
QUANT_FORMATS: dict[str, torch.dtype] = {
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}

# FLUX's single-stream blocks and feed-forwards are 4x wide (FluxDims.mlp_ratio's default); diffusers'
# FluxTransformer2DModel has no option for another ratio, so a checkpoint with a different one cannot be
# built. The key mapping reads the widths from the same FluxDims the rest of the pack uses.


class CheckpointError(ConfigError):
    """A checkpoint that cannot be loaded as FLUX; the message names the path, what was found and the fix."""


@dataclass(frozen=True)
class Source:
    """Where one diffusers tensor lives in a BFL checkpoint.

    The diffusers tensor is the concatenation along dim 0 of `rows` of the BFL tensor `key`;
    `rows=None` means the whole BFL tensor, unchanged.
    """

    key: str
    rows: tuple[tuple[int, int], ...] | None = None


@dataclass(frozen=True)
class Fused:
    """A diffusers module reading some of the stacked outputs of one BFL linear, in the order `take`."""

    parts: tuple[str, ...]  # widths of the BFL output blocks, by FluxDims attribute name
    take: tuple[int, ...]

    def rows(self, dims: FluxDims) -> tuple[tuple[int, int], ...]:
        bounds, offset = [], 0
        for part in self.parts:
            width = getattr(dims, part)
            bounds.append((offset, offset + width))
            offset += width
        return tuple(bounds[i] for i in self.take)


# diffusers module -> (BFL module, fused part or None). Parameter names: weight (and bias where the family
# has biases), except RMS norms, whose diffusers `weight` is BFL's `scale` (BFL modules ending in "_norm").
KeyTable = Mapping[str, tuple[str, "Fused | None"]]


@dataclass(frozen=True)
class KeyLayout:
    """A family's BFL <-> diffusers key mapping as data: top-level modules, the guidance embedder ([dev]
    only), one double block and one single block (numbered N in both layouts)."""

    top: KeyTable
    guidance: KeyTable
    double: KeyTable
    single: KeyTable
    biases: bool  # FLUX.1's linears have biases; FLUX.2 has none

    def sources(self, dims: FluxDims) -> dict[str, Source]:
        """diffusers parameter name -> where it lives in a BFL checkpoint (no key prefix)."""
        out: dict[str, Source] = {}
        tables: list[tuple[KeyTable, str, str]] = [(self.top, "", "")]
        if dims.guidance:
            tables.append((self.guidance, "", ""))
        tables += [
            (self.double, f"transformer_blocks.{i}.", f"double_blocks.{i}.")
            for i in range(dims.double_blocks)
        ]
        tables += [
            (self.single, f"single_transformer_blocks.{i}.", f"single_blocks.{i}.")
            for i in range(dims.single_blocks)
        ]
        linear = {"weight": "weight", "bias": "bias"} if self.biases else {"weight": "weight"}
        for table, diffusers_prefix, bfl_prefix in tables:
            for module, (bfl_module, fused) in table.items():
                params = {"weight": "scale"} if bfl_module.endswith("_norm") else linear
                rows = None if fused is None else fused.rows(dims)
                for d_param, b_param in params.items():
                    out[f"{diffusers_prefix}{module}.{d_param}"] = Source(
                        f"{bfl_prefix}{bfl_module}.{b_param}", rows
                    )
        return out


_QKV = ("hidden", "hidden", "hidden")
_LINEAR1 = ("hidden", "hidden", "hidden", "mlp")

_TOP: dict[str, tuple[str, Fused | None]] = {
    "time_text_embed.timestep_embedder.linear_1": ("time_in.in_layer", None),
    "time_text_embed.timestep_embedder.linear_2": ("time_in.out_layer", None),
    "time_text_embed.text_embedder.linear_1": ("vector_in.in_layer", None),
    "time_text_embed.text_embedder.linear_2": ("vector_in.out_layer", None),
    "context_embedder": ("txt_in", None),
    "x_embedder": ("img_in", None),
    "proj_out": ("final_layer.linear", None),
    # BFL stores the final AdaLN output as (shift, scale); diffusers' AdaLayerNormContinuous (scale, shift).
    "norm_out.linear": ("final_layer.adaLN_modulation.1", Fused(("hidden", "hidden"), (1, 0))),
}
_GUIDANCE: dict[str, tuple[str, Fused | None]] = {
    "time_text_embed.guidance_embedder.linear_1": ("guidance_in.in_layer", None),
    "time_text_embed.guidance_embedder.linear_2": ("guidance_in.out_layer", None),
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


FLUX1_KEYS = KeyLayout(top=_TOP, guidance=_GUIDANCE, double=_DOUBLE, single=_SINGLE, biases=True)


def bfl_sources(dims: FluxDims) -> dict[str, Source]:
    """diffusers parameter name -> where it lives in a FLUX.1 BFL checkpoint (no key prefix)."""
    return FLUX1_KEYS.sources(dims)


# --------------------------------------------------------------------------------------------------
# Shapes -> configuration


def _shapes(keys_and_shapes: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) if hasattr(v, "shape") else tuple(v) for k, v in keys_and_shapes.items()}


def strip_prefix(keys_and_shapes: Mapping[str, Any]) -> dict[str, Any]:
    """Drop ComfyUI's `model.diffusion_model.` prefix; in a full checkpoint keep only the transformer."""
    if any(k.startswith(COMFY_PREFIX) for k in keys_and_shapes):
        return {k[len(COMFY_PREFIX) :]: v for k, v in keys_and_shapes.items() if k.startswith(COMFY_PREFIX)}
    return dict(keys_and_shapes)


def _block_count(shapes: Mapping[str, tuple[int, ...]], prefix: str) -> int:
    """How many numbered blocks `prefix`N.* there are; CheckpointError naming the gaps."""
    indices = {int(k.split(".")[1]) for k in shapes if k.startswith(prefix) and k.split(".")[1].isdigit()}
    if indices != set(range(len(indices))):
        missing = sorted(set(range(max(indices) + 1)) - indices)
        raise CheckpointError(f"'{prefix}*' blocks {missing} are missing; the checkpoint is incomplete")
    return len(indices)


def _require(shapes: Mapping[str, tuple[int, ...]], key: str, title: str = "FLUX.1") -> tuple[int, ...]:
    if key not in shapes:
        raise CheckpointError(f"tensor '{key}' is missing; the checkpoint is incomplete or not {title}")
    return shapes[key]


def rope_axes(head_dim: int) -> tuple[int, int, int]:
    """RoPE axes for a head width: FLUX's (16, 56, 56) of 128, the same proportions for small test models.

    RoPE has no weights, so the checkpoint cannot tell; this is the split `tiny_flux_config` uses.
    """
    b = (head_dim - head_dim // 8) // 4 * 2
    return (head_dim - 2 * b, b, b)


def dims_from_bfl(keys_and_shapes: Mapping[str, Any]) -> FluxDims:
    """The FluxDims of a BFL checkpoint (prefix optional), from its keys and shapes alone."""
    shapes = _shapes(strip_prefix(keys_and_shapes))
    hidden, in_channels = _require(shapes, "img_in.weight")
    double_blocks = _block_count(shapes, "double_blocks.")
    single_blocks = _block_count(shapes, "single_blocks.")
    norm = (
        "double_blocks.0.img_attn.norm.query_norm.scale"
        if double_blocks
        else "single_blocks.0.norm.query_norm.scale"
    )
    head_dim = _require(shapes, norm)[0]
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


def flux_config_from_bfl(keys_and_shapes: Mapping[str, Any]) -> dict[str, Any]:
    """The diffusers FluxTransformer2DModel config of a BFL checkpoint, from its keys and shapes alone.

    Accepts {key: shape} or {key: tensor}, with or without the `model.diffusion_model.` prefix.
    Raises CheckpointError when a shape contradicts FLUX's structure.
    """
    shapes = _shapes(strip_prefix(keys_and_shapes))
    dims = dims_from_bfl(shapes)
    config: dict[str, Any] = {
        "patch_size": 1,
        "in_channels": dims.in_channels,
        "num_layers": dims.double_blocks,
        "num_single_layers": dims.single_blocks,
        "attention_head_dim": dims.head_dim,
        "num_attention_heads": dims.heads,
        "joint_attention_dim": _require(shapes, "txt_in.weight")[1],
        "pooled_projection_dim": _require(shapes, "vector_in.in_layer.weight")[1],
        "guidance_embeds": dims.guidance,
        "axes_dims_rope": rope_axes(dims.head_dim),
    }
    out_channels = _require(shapes, "final_layer.linear.weight")[0]
    if out_channels != dims.in_channels:
        config["out_channels"] = out_channels
    return config


def dims_from_diffusers(keys_and_shapes: Mapping[str, Any]) -> FluxDims:
    """The FluxDims of a FluxTransformer2DModel state dict, from its keys and shapes alone."""
    shapes = _shapes(keys_and_shapes)

    def count(prefix: str) -> int:
        return len({k.split(".")[1] for k in shapes if k.startswith(prefix)})

    hidden, in_channels = _require(shapes, "x_embedder.weight")
    double_blocks = count("transformer_blocks.")
    norm = f"{'' if double_blocks else 'single_'}transformer_blocks.0.attn.norm_q.weight"
    head_dim = _require(shapes, norm)[0]
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


# --------------------------------------------------------------------------------------------------
# Converters


def _gather_rows(tensor: torch.Tensor, rows: tuple[tuple[int, int], ...] | None) -> torch.Tensor:
    if rows is None:
        return tensor
    parts = [tensor[a:b] for a, b in rows]
    return parts[0].clone() if len(parts) == 1 else torch.cat(parts, dim=0)


def bfl_to_diffusers(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A BFL / ComfyUI FLUX state dict (prefix optional) as FluxTransformer2DModel's state dict."""
    bfl = strip_prefix(state_dict)
    sources = bfl_sources(dims_from_bfl(bfl))
    used = {s.key for s in sources.values()}
    unknown = sorted(set(bfl) - used)
    if unknown:
        raise CheckpointError(f"{len(unknown)} tensors are not part of FLUX.1, e.g. {unknown[:3]}")
    return {name: _gather_rows(_bfl_tensor(bfl, s.key), s.rows) for name, s in sources.items()}


def _bfl_tensor(bfl: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in bfl:
        raise CheckpointError(f"tensor '{key}' is missing; the checkpoint is incomplete or not FLUX.1")
    return bfl[key]


def diffusers_to_bfl(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A FluxTransformer2DModel state dict in BFL layout: fused qkv, linear1, final AdaLN (shift, scale)."""
    sources = bfl_sources(dims_from_diffusers(state_dict))
    missing = sorted(set(sources) - set(state_dict))
    unknown = sorted(set(state_dict) - set(sources))
    if missing or unknown:
        raise ValueError(
            f"not a FluxTransformer2DModel state dict: missing {missing[:3]}, unknown {unknown[:3]}"
        )
    return assemble_bfl(sources, state_dict)


def assemble_bfl(
    sources: Mapping[str, Source], state_dict: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The BFL tensors of a diffusers state dict, given where each diffusers tensor lives (`sources`):
    fused tensors are the row blocks of their parts in file order; unfused ones are passed through."""
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for name, source in sources.items():
        tensor = state_dict[name]
        if source.rows is None:
            pieces.setdefault(source.key, []).append((0, tensor))
            continue
        offset = 0
        for a, b in source.rows:  # the diffusers rows [offset, offset + b - a) came from BFL rows [a, b)
            pieces.setdefault(source.key, []).append((a, tensor[offset : offset + b - a]))
            offset += b - a
    out = {}
    for key, parts in pieces.items():
        parts.sort(key=lambda p: p[0])
        out[key] = parts[0][1] if len(parts) == 1 else torch.cat([t for _, t in parts], dim=0)
    return out


def save_bfl_checkpoint(model: torch.nn.Module | Mapping[str, torch.Tensor], path: str | Path) -> str:
    """Write a FluxTransformer2DModel (or its state dict) as a BFL/ComfyUI single file; returns the path."""
    from safetensors.torch import save_file

    state = model.state_dict() if isinstance(model, torch.nn.Module) else model
    save_file(diffusers_to_bfl(state), str(path))
    return str(path)


def bfl_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The BFL key -> shape a checkpoint of this diffusers config has (computed on the meta device)."""
    from .model import build_flux

    model = build_flux(dict(config), device="meta")
    return {k: tuple(v.shape) for k, v in diffusers_to_bfl(model.state_dict()).items()}


__all__ = [
    "COMFY_PREFIX",
    "COMFY_QUANT",
    "DOUBLE_ATTENTION",
    "FLUX1_KEYS",
    "INPUT_SCALE",
    "QUANT_FORMATS",
    "QUANT_METADATA",
    "WEIGHT_SCALE",
    "CheckpointError",
    "Fused",
    "KeyLayout",
    "Source",
    "assemble_bfl",
    "bfl_shapes",
    "bfl_sources",
    "bfl_to_diffusers",
    "diffusers_to_bfl",
    "dims_from_bfl",
    "dims_from_diffusers",
    "flux_config_from_bfl",
    "rope_axes",
    "save_bfl_checkpoint",
    "strip_prefix",
]
