"""Qwen-Image's checkpoint facts: the key layout (diffusers' own names), header detection, configs from shapes.

The files ComfyUI users have (models/diffusion_models/), all read by the shared loader:
* Comfy-Org/Qwen-Image_ComfyUI `split_files/diffusion_models/qwen_image_bf16.safetensors` and
  `qwen_image_fp8_e4m3fn.safetensors` (plain float8_e4m3fn weights, no scales: fp8 stays resident), the
  Edit / Edit-2509 files alike; Edit-2511's `qwen_image_edit_2511_fp8mixed.safetensors` (ComfyUI's quantized
  "mixed" layout, per-layer `weight_scale`, checkpoint/quant.py), with the empty `__index_timestep_zero__`
  marker.
* ComfyUI full checkpoints and ModelSave output put the same keys under `model.diffusion_model.`.
* diffusers folders (Qwen/Qwen-Image `transformer/`: config.json + sharded safetensors).

ComfyUI's QwenImage (comfy/ldm/qwen_image/model.py, 0.3.75 and 0.33) has exactly diffusers' parameter names
and shapes, so a ComfyUI file is a diffusers state dict: the layout is the identity (`QwenKeys`). ComfyUI
detects the family by `txt_norm.weight` (comfy/model_detection.py), which Lens and Mage-Flow (0.33) have
too; `matches` also requires the dual-stream block's modulation and GELU MLP. Every width is read from
shapes; RoPE has no weights, so its axes follow the head width in the released proportions (`rope_axes`),
as ComfyUI hard-codes the released (16, 56, 56).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..checkpoint.files import CheckpointError
from ..checkpoint.keys import Blocks, KeyLayout, Source, block_count, require, shapes_of, strip_prefix
from ..config import ModelDims
from .facts import (  # torch-free: the registry reads them
    QWEN_IMAGE,
    TIMESTEP_ZERO_MARKER,
    QwenDims,
    config_from_dims,
    dims,
    rope_axes,
)

TITLE = "Qwen-Image"
# What a Qwen-Image dual-stream file has that no other family with a `txt_norm` has (ComfyUI 0.33's Lens
# has `img_mlp.w1`, Mage-Flow a text width unlike txt_in's).
MARKERS = (
    "txt_norm.weight",
    "transformer_blocks.0.img_mod.1.weight",
    "transformer_blocks.0.img_mlp.net.0.proj.weight",
)
LAYERED_KEY = "time_text_embed.addition_t_embedding.weight"  # Qwen-Image-Layered (ComfyUI 0.33)


@dataclass(frozen=True)
class QwenKeys(KeyLayout):
    """The identity layout: every diffusers parameter (and ComfyUI's marker buffer) is the file key of the
    same name. `blocks` names the numbered blocks for the writers that treat block linears apart (fp8 mixed)."""

    def source(self, name: str, dims: ModelDims) -> Source | None:
        return Source(name)


QWEN_KEYS = QwenKeys(
    top={}, blocks=(Blocks("transformer_blocks.", "transformer_blocks.", {}),), norm_scale=False
)


# --------------------------------------------------------------------------------------------------
# Header detection


def matches(keys: Collection[str]) -> bool:
    """Qwen-Image's keys (a ComfyUI file and a diffusers state dict are the same layout)."""
    return all(k in keys for k in MARKERS)


def checked(keys: Iterable[str]) -> None:
    """Refuse Qwen-Image variants this family does not run, naming them."""
    if LAYERED_KEY in set(keys):
        raise CheckpointError(
            "this is Qwen-Image-Layered (it has 'time_text_embed.addition_t_embedding'), whose layered RoPE and "
            "extra timestep condition ROCm Parallel does not run; load it with ComfyUI's own Load Diffusion "
            "Model, or use Qwen-Image / Qwen-Image-Edit"
        )


# --------------------------------------------------------------------------------------------------
# Shapes -> configuration


def config_from_shapes(keys_and_shapes: Mapping[str, Any]) -> dict[str, Any]:
    """The diffusers QwenImageTransformer2DModel config of a Qwen-Image file (ComfyUI's or diffusers' keys,
    the same), from its keys and shapes alone; `model.diffusion_model.` optional."""
    shapes = shapes_of(strip_prefix(keys_and_shapes))
    checked(shapes)
    hidden, in_channels = require(shapes, "img_in.weight", TITLE)
    head_dim = require(shapes, "transformer_blocks.0.attn.norm_q.weight", TITLE)[0]
    patch = QWEN_IMAGE["patch_size"]
    out_rows = require(shapes, "proj_out.weight", TITLE)[0]
    if hidden % head_dim or out_rows % (patch * patch):
        raise CheckpointError(
            f"hidden width {hidden}, head width {head_dim} and {out_rows} output rows do not make a Qwen-Image "
            f"transformer (hidden = heads x head width, output = {patch}x{patch} patches x channels)"
        )
    config: dict[str, Any] = {
        **QWEN_IMAGE,
        "in_channels": in_channels,
        "out_channels": out_rows // (patch * patch),
        "num_layers": block_count(shapes, "transformer_blocks."),
        "attention_head_dim": head_dim,
        "num_attention_heads": hidden // head_dim,
        "joint_attention_dim": require(shapes, "txt_in.weight", TITLE)[1],
        "axes_dims_rope": rope_axes(head_dim),
    }
    if TIMESTEP_ZERO_MARKER in shapes:  # Edit-2511 (ComfyUI: default_ref_method "index_timestep_zero")
        config["zero_cond_t"] = True
    return config


__all__ = [
    "MARKERS",
    "QWEN_KEYS",
    "QwenDims",
    "QwenKeys",
    "checked",
    "config_from_dims",
    "config_from_shapes",
    "dims",
    "matches",
    "rope_axes",
]
