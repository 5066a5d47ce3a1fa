"""Wan's checkpoint facts: ComfyUI's key layout <-> diffusers' names, header detection, configs from shapes.

The files ComfyUI users have (models/diffusion_models/), all read by the shared loader:
* Comfy-Org/Wan_2.1_ComfyUI_repackaged and Wan_2.2_ComfyUI_Repackaged `split_files/diffusion_models/`:
  `wan2.1_t2v_1.3B_fp16`, `wan2.1_t2v_14B_bf16` / `_fp8_e4m3fn`, `wan2.1_i2v_480p_14B_fp16` / `_fp8_scaled`,
  `wan2.2_t2v_high_noise_14B_fp16` / `_fp8_scaled` and the low-noise expert, the I2V experts alike,
  `wan2.2_ti2v_5B_fp16`: ComfyUI's own names (comfy/ldm/wan/model.py `WanModel`), bf16 / fp16, plain fp8 or
  "fp8 scaled" (a `weight_scale` or legacy `scale_weight` per linear, checkpoint/quant.py).
* ComfyUI full checkpoints and ModelSave output put the same keys under `model.diffusion_model.`.
* diffusers folders (Wan-AI/Wan2.1-T2V-14B-Diffusers `transformer/`) and diffusers-keyed single files.

ComfyUI's names map one to one onto diffusers' (diffusers' own converter, single_file_utils
`convert_wan_transformer_to_diffusers`, renames them; nothing is fused): `self_attn.q` is `attn1.to_q`,
`cross_attn.k_img` `attn2.add_k_proj`, ComfyUI's cross-attention norm `norm3` is diffusers' `norm2`, the
`modulation` parameters are `scale_shift_table`. ComfyUI detects Wan by `head.modulation` (0.33.0
comfy/model_detection.py) and reads heads as dim // 128 unless the file's metadata says otherwise
(`config_with_metadata`); `matches` needs that and Wan's self- and
cross-attention, which no FLUX or Qwen-Image file has (and those families' markers, `img_in` and
`txt_norm`, no Wan file has). Variants ComfyUI runs with other model classes (VACE, camera, S2V, HuMo,
Animate, SCAIL, FLF2V's position embedding, ...) are refused by name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..checkpoint.files import CheckpointError
from ..checkpoint.keys import Blocks, KeyLayout, Source, block_count, require, shapes_of, strip_prefix
from ..config import ModelDims
from .facts import (  # torch-free: the registry
    HEAD_DIM,
    PATCH,
    WAN21_T2V_1_3B,
    WanDims,
    config_from_dims,
    dims,
)

TITLE = "Wan"

# diffusers module -> ComfyUI module (nothing fused)
TOP = {
    "patch_embedding": "patch_embedding",
    "condition_embedder.time_embedder.linear_1": "time_embedding.0",
    "condition_embedder.time_embedder.linear_2": "time_embedding.2",
    "condition_embedder.time_proj": "time_projection.1",
    "condition_embedder.text_embedder.linear_1": "text_embedding.0",
    "condition_embedder.text_embedder.linear_2": "text_embedding.2",
    "condition_embedder.image_embedder.norm1": "img_emb.proj.0",
    "condition_embedder.image_embedder.ff.net.0.proj": "img_emb.proj.1",
    "condition_embedder.image_embedder.ff.net.2": "img_emb.proj.3",
    "condition_embedder.image_embedder.norm2": "img_emb.proj.4",
    "proj_out": "head.head",
}
BLOCK = {
    **{
        f"attn1.{d}": f"self_attn.{c}"
        for d, c in (("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "o"))
    },
    **{
        f"attn2.{d}": f"cross_attn.{c}"
        for d, c in (("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "o"))
    },
    "attn1.norm_q": "self_attn.norm_q",
    "attn1.norm_k": "self_attn.norm_k",
    "attn2.norm_q": "cross_attn.norm_q",
    "attn2.norm_k": "cross_attn.norm_k",
    "attn2.add_k_proj": "cross_attn.k_img",
    "attn2.add_v_proj": "cross_attn.v_img",
    "attn2.norm_added_k": "cross_attn.norm_k_img",
    "norm2": "norm3",  # the cross-attention's LayerNorm (diffusers' norm2, ComfyUI's norm3)
    "ffn.net.0.proj": "ffn.0",
    "ffn.net.2": "ffn.2",
}
MODULATION = "scale_shift_table"  # diffusers' name of ComfyUI's `modulation` parameters
_BLOCK_MODULATION = re.compile(r"blocks\.(\d+)\.scale_shift_table")

# What a Wan file of ComfyUI's layout has, and what a diffusers one has.
MARKERS = (
    "head.modulation",
    "patch_embedding.weight",
    "blocks.0.self_attn.q.weight",
    "blocks.0.cross_attn.k.weight",
)
DIFFUSERS_MARKERS = (
    "scale_shift_table",
    "patch_embedding.weight",
    "blocks.0.attn1.to_q.weight",
    "blocks.0.attn2.to_k.weight",
    "condition_embedder.time_proj.weight",
)
# Variants ComfyUI runs with other model classes: a key each has (either layout) -> its name.
VARIANTS = {
    "vace_patch_embedding.": "Wan VACE",
    "vace_blocks.": "Wan VACE",
    "control_adapter.": "Wan Fun Camera",
    "casual_audio_encoder.": "Wan 2.2 S2V",
    "audio_proj.": "Wan HuMo",
    "face_adapter.": "Wan 2.2 Animate",
    "motion_encoder.": "Wan 2.2 Animate",
    "patch_embedding_pose.": "Wan SCAIL",
    "patch_embedding_mask.": "Wan SCAIL-2",
    "patch_embedding_global.": "Wan Dancer",
    "ref_conv.": "Wan Fun with a reference image",
    "img_emb.emb_pos": "Wan 2.1 FLF2V (first-last-frame)",
    "condition_embedder.image_embedder.pos_embed": "Wan 2.1 FLF2V (first-last-frame)",
}


@dataclass(frozen=True)
class WanKeys(KeyLayout):
    """ComfyUI's Wan layout: modules renamed (`top`, `blocks`), and the `modulation` parameters, which
    diffusers calls `scale_shift_table` (a parameter of the block and of the root, not a module's)."""

    def source(self, name: str, dims: ModelDims) -> Source | None:
        if name == MODULATION:
            return Source("head.modulation")
        found = _BLOCK_MODULATION.fullmatch(name)
        if found:
            return Source(f"blocks.{found[1]}.modulation")
        return super().source(name, dims)


WAN_KEYS = WanKeys(
    top={d: (c, None) for d, c in TOP.items()},
    blocks=(Blocks("blocks.", "blocks.", {d: (c, None) for d, c in BLOCK.items()}),),
    norm_scale=False,
)


# --------------------------------------------------------------------------------------------------
# Header detection


def matches(keys: Collection[str]) -> bool:
    """ComfyUI's Wan layout (Wan 2.1, Wan 2.2, their variants: refused later by name)."""
    return all(k in keys for k in MARKERS)


def matches_diffusers(keys: Collection[str]) -> bool:
    """diffusers' WanTransformer3DModel keys."""
    return all(k in keys for k in DIFFUSERS_MARKERS)


def checked(keys: Iterable[str]) -> None:
    """Refuse the Wan variants this family does not run, naming them."""
    for key in keys:
        for marker, what in VARIANTS.items():
            if key.startswith(marker):
                raise CheckpointError(
                    f"this is {what} (it has '{key}'), whose extra inputs ROCm Parallel does not run; load it "
                    "with ComfyUI's own Load Diffusion Model, or use a Wan 2.1 / 2.2 T2V, I2V or TI2V model"
                )


# --------------------------------------------------------------------------------------------------
# Shapes -> configuration


def _config(
    shapes: Mapping[str, tuple[int, ...]], names: Mapping[str, str], blocks_prefix: str
) -> dict[str, Any]:
    """The config from one layout's shapes; `names` gives that layout's key for each fact."""
    checked(shapes)
    conv = require(shapes, names["patch"], TITLE)
    if len(conv) != 5 or tuple(conv[2:]) != PATCH:
        raise CheckpointError(
            f"'{names['patch']}' has shape {list(conv)}; a Wan transformer's patch embedding is "
            f"[dim, channels, {', '.join(map(str, PATCH))}]"
        )
    dim, in_channels = conv[0], conv[1]
    if dim % HEAD_DIM:
        raise CheckpointError(
            f"hidden width {dim} is not a multiple of {HEAD_DIM}; ComfyUI reads a Wan transformer's heads as "
            f"width / {HEAD_DIM}, so this is not a Wan transformer it loads"
        )
    out_rows = require(shapes, names["head"], TITLE)[0]
    patch_volume = PATCH[0] * PATCH[1] * PATCH[2]
    if out_rows % patch_volume:
        raise CheckpointError(f"'{names['head']}' has {out_rows} rows, not a multiple of {patch_volume}")
    image = shapes.get(names["image"])
    return {
        **WAN21_T2V_1_3B,
        "num_attention_heads": dim // HEAD_DIM,
        "in_channels": in_channels,
        "out_channels": out_rows // patch_volume,
        "text_dim": require(shapes, names["text"], TITLE)[1],
        "freq_dim": require(shapes, names["time"], TITLE)[1],
        "ffn_dim": require(shapes, names["ffn"], TITLE)[0],
        "num_layers": block_count(shapes, blocks_prefix),
        "cross_attn_norm": names["cross_norm"] in shapes,
        "image_dim": None if image is None else image[1],
        "added_kv_proj_dim": dim if names["k_img"] in shapes else None,
    }


COMFY_NAMES = {
    "patch": "patch_embedding.weight",
    "head": "head.head.weight",
    "text": "text_embedding.0.weight",
    "time": "time_embedding.0.weight",
    "ffn": "blocks.0.ffn.0.weight",
    "cross_norm": "blocks.0.norm3.weight",
    "image": "img_emb.proj.1.weight",
    "k_img": "blocks.0.cross_attn.k_img.weight",
}
DIFFUSERS_NAMES = {
    "patch": "patch_embedding.weight",
    "head": "proj_out.weight",
    "text": "condition_embedder.text_embedder.linear_1.weight",
    "time": "condition_embedder.time_embedder.linear_1.weight",
    "ffn": "blocks.0.ffn.net.0.proj.weight",
    "cross_norm": "blocks.0.norm2.weight",
    "image": "condition_embedder.image_embedder.ff.net.0.proj.weight",
    "k_img": "blocks.0.attn2.add_k_proj.weight",
}


def config_from_shapes(keys_and_shapes: Mapping[str, Any]) -> dict[str, Any]:
    """The diffusers WanTransformer3DModel config of a file in ComfyUI's layout, from its keys and shapes
    alone (as ComfyUI's detection reads them); `model.diffusion_model.` optional."""
    return _config(shapes_of(strip_prefix(keys_and_shapes)), COMFY_NAMES, "blocks.")


def config_with_metadata(config: dict[str, Any], metadata: Mapping[str, str]) -> dict[str, Any]:
    """`config` with the head count a file's safetensors metadata declares: ComfyUI 0.33's detection updates
    a Wan config with `json.loads(metadata["config"])["transformer"]` (comfy/model_detection.py), so a file
    whose metadata sets `num_heads` 12 on a 768-wide model runs 12 heads of 64 there, not dim // 128 = 6
    (read as 6, the output was 6.3 off ComfyUI's with no error). Other keys there change no shape the pack
    reads; a head count the width does not divide is refused, naming both."""
    raw = metadata.get("config")
    if not raw:
        return config
    try:
        transformer = json.loads(raw).get("transformer", {})
    except (ValueError, AttributeError):
        return config  # not JSON ComfyUI could read either: it fails on it itself; the shapes decide here
    heads = transformer.get("num_heads") if isinstance(transformer, dict) else None
    if heads is None:
        return config
    width = config["num_attention_heads"] * config["attention_head_dim"]
    if not isinstance(heads, int) or heads <= 0 or width % heads or (width // heads) % 2:
        raise CheckpointError(
            f"its metadata's config sets transformer num_heads={heads!r}, which does not divide the hidden width "
            f"{width} into even head widths; a Wan file's num_heads divides its width (e.g. {width // HEAD_DIM})"
        )
    return {**config, "num_attention_heads": heads, "attention_head_dim": width // heads}


def config_from_diffusers(keys_and_shapes: Mapping[str, Any]) -> dict[str, Any]:
    """The config of a diffusers-keyed Wan state dict, from its shapes."""
    return _config(shapes_of(keys_and_shapes), DIFFUSERS_NAMES, "blocks.")


__all__ = [
    "MARKERS",
    "WAN_KEYS",
    "WanDims",
    "WanKeys",
    "checked",
    "config_from_diffusers",
    "config_from_dims",
    "config_from_shapes",
    "dims",
    "matches",
    "matches_diffusers",
]
