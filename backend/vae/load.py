"""A VAE file: its header read by the caller (kind, diffusers config, bytes per rank), its weights read by
every rank itself (the whole file: the VAE is replicated, each rank keeps a full copy, a few hundred MB).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
from torch import nn

from ..checkpoint.headers import read_header
from ..config import ConfigError
from ..dtypes import compute_dtype_named
from .kind import VaeKind, detect_vae, get_vae_kind, vae_kinds
from .messages import VAE_SLOT, VaeLoadRequest


def inspect_vae(path: str | os.PathLike[str], dtype: str, slot: str = VAE_SLOT) -> VaeLoadRequest:
    """The load request for the VAE file at `path` in compute dtype `dtype`, from its header alone (no
    worker starts); ConfigError naming the file and the VAEs the pack knows when it is none of them."""
    path = Path(path)
    if path.suffix != ".safetensors":
        raise ConfigError(
            f"'{path}' is not a .safetensors file; the pack's VAE nodes read safetensors VAEs (save this one "
            "with ComfyUI's VAESave node)"
        )
    header, _ = read_header(path)
    shapes = {k: v.shape for k, v in header.items()}
    kind = detect_vae(shapes.keys())
    if kind is None:
        known = "; ".join(k.title for k in vae_kinds())
        raise ConfigError(
            f"'{path}' is no VAE the pack decodes in parallel (known: {known}); use ComfyUI's VAE Decode for it"
        )
    try:
        config = kind.config_from_shapes(shapes)
    except ConfigError as err:  # a layout the pack's decoder cannot build (a narrower decoder, say)
        raise ConfigError(f"'{path}': {err}; use ComfyUI's VAE Decode for this file") from None
    bytes_ = compute_dtype_named(dtype).bytes
    elements = sum(math.prod(v.shape) for k, v in header.items() if not k.endswith("num_batches_tracked"))
    return VaeLoadRequest(str(path), kind.name, config, dtype, weight_bytes=elements * bytes_, slot=slot)


def build_vae(kind: VaeKind, config: dict, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    """The kind's diffusers model of `config` (no weights on the meta device)."""
    return kind.build(dict(config), device=device, dtype=dtype)


def load_vae(request: VaeLoadRequest, device: torch.device, progress=None) -> nn.Module:
    """The request's VAE on `device`, every tensor read from the file by this rank, in diffusers' names."""
    from safetensors.torch import load_file

    kind = get_vae_kind(request.kind)
    dtype = getattr(torch, request.dtype)
    state = kind.convert(load_file(request.checkpoint), request.config)
    model = build_vae(kind, request.config, "meta", dtype)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ConfigError(
            f"'{request.checkpoint}' does not fit {kind.title}: missing {missing[:4]}, unexpected {unexpected[:4]}"
        )
    # every floating tensor in the compute dtype, buffers too, as ComfyUI's VAE does (`.to(vae_dtype)`)
    state = {k: v.to(device, dtype if v.is_floating_point() else v.dtype) for k, v in state.items()}
    model.load_state_dict(state, assign=True)
    if progress is not None:
        progress(1, 1)
    return model.eval()


__all__ = ["build_vae", "inspect_vae", "load_vae"]
