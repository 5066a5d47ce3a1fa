"""Converting whole state dicts between a family's BFL / ComfyUI layout and diffusers', and the one writer.

Above the family registry (it detects a state dict's family from its keys, or takes the family it is given);
keys.py below it holds the layout machinery a family's data is made of and looks no family up.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..family import ModelFamily, detect_bfl, detect_diffusers, family_of, get_family
from .files import COMFY_PREFIX, CheckpointError
from .keys import assemble_bfl, require, shapes_of, strip_prefix, take_rows
from .quant import QUANT_SUFFIXES, dequantize


def _family(family: ModelFamily | str | None, detect: Any, keys: Iterable[str], what: str) -> ModelFamily:
    if isinstance(family, str):
        return get_family(family)
    found = family if family is not None else detect(set(keys))
    if found is None:
        raise CheckpointError(f"{what} is not a layout of any registered model family")
    return found


def bfl_to_diffusers(
    state_dict: Mapping[str, torch.Tensor],
    family: ModelFamily | str | None = None,
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """A BFL / ComfyUI state dict (prefix optional; ComfyUI's fp8 + weight_scale dequantized) in diffusers'
    keys. `family` (default: detected from the keys) says whose layout it is; `dtype` casts every tensor
    (default: as stored, a scaled weight in float32)."""
    bfl = strip_prefix(state_dict)
    fam = _family(family, detect_bfl, bfl, "this BFL state dict")
    bfl = fam.keys.bfl_names(bfl)
    config = fam.config_from_bfl(shapes_of(bfl))
    sources = fam.sources(config)
    known = {s.key for s in sources.values()}
    unknown = sorted(k for k in bfl if k not in known and not k.endswith(QUANT_SUFFIXES))
    if unknown:
        raise CheckpointError(f"{len(unknown)} tensors are not part of {fam.title}, e.g. {unknown[:3]}")
    out = {}
    for name, source in sources.items():
        require(bfl, source.key, fam.title)
        out[name] = take_rows(dequantize(bfl, source.key, dtype), source.rows)
    return out


def diffusers_to_bfl(
    state_dict: Mapping[str, torch.Tensor], family: ModelFamily | str | None = None
) -> dict[str, torch.Tensor]:
    """A diffusers state dict in its family's BFL layout (fused qkv, linear1, final AdaLN (shift, scale)).

    `family` defaults to the one whose diffusers keys these are. Every tensor is contiguous.
    """
    fam = _family(family, detect_diffusers, state_dict, "this diffusers state dict")
    config = fam.config_from_diffusers(shapes_of(state_dict))
    expected = fam.parameter_shapes(config)
    missing, unknown = sorted(set(expected) - set(state_dict)), sorted(set(state_dict) - set(expected))
    if missing or unknown:
        raise ValueError(
            f"not a {fam.diffusers_class} state dict: missing {missing[:3]}, unknown {unknown[:3]}"
        )
    sources = fam.keys.sources(fam.dims(config), state_dict)
    return {key: tensor.contiguous() for key, tensor in assemble_bfl(sources, state_dict).items()}


def save_checkpoint(
    model_or_state: torch.nn.Module | Mapping[str, torch.Tensor],
    path: str | Path,
    family: ModelFamily | str | None = None,
    prefix: bool = False,
) -> str:
    """Write a diffusers model (or its state dict) as its family's BFL / ComfyUI single file; returns the path.

    `family` defaults to the model's (or the one whose diffusers keys the state dict has); `prefix` puts
    every key under ComfyUI's `model.diffusion_model.` (a full checkpoint's layout).
    """
    from safetensors.torch import save_file

    if isinstance(model_or_state, torch.nn.Module):
        family = family if family is not None else family_of(model_or_state)
        model_or_state = model_or_state.state_dict()
    bfl = diffusers_to_bfl(model_or_state, family)
    save_file({(COMFY_PREFIX if prefix else "") + k: v for k, v in bfl.items()}, str(path))
    return str(path)


__all__ = ["bfl_to_diffusers", "diffusers_to_bfl", "save_checkpoint"]
