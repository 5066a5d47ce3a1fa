"""The ldm (CompVis) key layout of an AutoencoderKL file, as ComfyUI's VAELoader reads it (`encoder.down.0.
block.0.conv1.weight`, `decoder.mid.attn_1.q.weight`, ...): the diffusers config from its shapes, and its
tensors in diffusers' names through diffusers' own single-file converter. FLUX.1's and FLUX.2's VAE files
use it; the kinds that do (backend/flux/vae.py, backend/flux2/vae.py) call these.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import Any

from ..config import ConfigError

Shapes = Mapping[str, tuple[int, ...]]

# The keys every ldm AutoencoderKL file has (encoder and decoder, ComfyUI's names).
REQUIRED = ("encoder.conv_in.weight", "encoder.down.0.block.0.conv1.weight", "decoder.conv_in.weight",
            "decoder.up.0.block.0.conv1.weight", "decoder.conv_out.weight")  # fmt: skip
# ComfyUI moves these to the top level (comfy/sd.py VAE: `decoder.post_quant_conv.` -> `post_quant_conv.`).
MOVED = {"decoder.post_quant_conv.": "post_quant_conv.", "encoder.quant_conv.": "quant_conv."}


def is_ldm_kl(keys: Collection[str]) -> bool:
    """An ldm AutoencoderKL file (2-D convolutions; a 3-D VAE names its convs `conv_in.conv`)."""
    return all(k in keys for k in REQUIRED)


def _levels(shapes: Shapes, prefix: str) -> int:
    found = {int(m.group(1)) for k in shapes if (m := re.match(rf"{prefix}\.(\d+)\.block\.0\.", k))}
    return max(found) + 1 if found else 0


def kl_config(shapes: Shapes) -> dict[str, Any]:
    """diffusers' AutoencoderKL config of an ldm file from its shapes (widths, levels, blocks, latent)."""
    levels = _levels(shapes, "encoder.down")
    if levels == 0 or _levels(shapes, "decoder.up") != levels:
        raise ConfigError("the VAE file's encoder and decoder have different numbers of levels")
    widths = tuple(shapes[f"encoder.down.{i}.block.0.conv1.weight"][0] for i in range(levels))
    decoder = tuple(shapes[f"decoder.up.{levels - 1 - i}.block.0.conv1.weight"][0] for i in range(levels))
    if decoder[::-1] != widths:
        raise ConfigError(
            f"the VAE's decoder widths {list(decoder[::-1])} differ from its encoder's {list(widths)}; "
            "the pack decodes VAEs whose decoder matches the encoder"
        )
    blocks = len({k.split(".")[4] for k in shapes if k.startswith("encoder.down.0.block.")})
    keys = {k for k in shapes}
    quant = any(k in keys for k in ("quant_conv.weight", "encoder.quant_conv.weight"))
    post = any(k in keys for k in ("post_quant_conv.weight", "decoder.post_quant_conv.weight"))
    return {
        "in_channels": shapes["encoder.conv_in.weight"][1],
        "out_channels": shapes["decoder.conv_out.weight"][0],
        "down_block_types": ["DownEncoderBlock2D"] * levels,
        "up_block_types": ["UpDecoderBlock2D"] * levels,
        "block_out_channels": list(widths),
        "layers_per_block": blocks,
        "latent_channels": shapes["decoder.conv_in.weight"][1],
        "norm_num_groups": 32,  # ldm's Normalize: GroupNorm(32, ...)
        "use_quant_conv": quant,
        "use_post_quant_conv": post,
    }


def convert_kl(
    state_dict: dict[str, Any], config: Mapping[str, Any], keep: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The file's tensors in diffusers' AutoencoderKL names (diffusers' `convert_ldm_vae_checkpoint`); keys
    starting with a `keep` prefix (FLUX.2's `bn.` statistics) pass unchanged."""
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    moved = {}
    for key, value in state_dict.items():
        for old, new in MOVED.items():
            if key.startswith(old):
                key = new + key[len(old) :]
        moved[key] = value
    out = convert_ldm_vae_checkpoint(moved, dict(config))
    out.update({k: v for k, v in moved.items() if k.startswith(keep) and keep})
    return out


__all__ = ["convert_kl", "is_ldm_kl", "kl_config"]
