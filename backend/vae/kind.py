"""VAE kinds as data: what the pack knows about one VAE, in one record, kept by the model families that use it.

A VAE is not a transformer family: it has no layout, no TP plan, no model call. Each family whose latents a
VAE decodes names that VAE's `VaeKind` in its record (`ModelFamily.vae`; several families may share one: a
kind is keyed by its `name`), built in the family's folder (e.g. backend/flux/vae.py). The generic code
(backend/vae/) reads only these fields:

* detection and loading: `matches(keys)` on a file's header keys as ComfyUI's VAELoader reads it,
  `config_from_shapes(shapes)` the diffusers config, `convert(state_dict, config)` the file's tensors in
  diffusers' names (diffusers' own single-file converters), `build(config, device, dtype)` the model;
* ComfyUI's LATENT: `latent_channels(config)`, `downscale` (image pixels per latent pixel), `frames` (a latent
  [B, C, T, H, W]: Wan's causal 3-D VAE), and `to_model` / `from_model` between ComfyUI's latent and the
  diffusers model's (FLUX.2: the batch-norm statistics and the 2 x 2 patches ComfyUI's VAE applies);
* the planner: `released` (the released file's config), `planner`, the measured activation bytes of one band, and `widths(config)` (backend/plan/vae.py).

Lookups: `vae_kinds()`, `detect_vae(keys)`, `get_vae_kind(name)`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..config import ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn

Shapes = Mapping[str, tuple[int, ...]]


def _same(model: Any, z: Any) -> Any:
    return z


def diffusers_decode(model: nn.Module, z: torch.Tensor) -> torch.Tensor:
    """The diffusers VAE's decode (pixels in -1..1; diffusers' 3-D VAEs clamp, ComfyUI clamps after)."""
    return model.decode(z).sample


def diffusers_encode(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The diffusers VAE's encode: the posterior's mean, as ComfyUI's VAE Encode takes it."""
    return model.encode(x).latent_dist.mode()


@dataclass(frozen=True)
class VaePlannerFacts:
    """Peak live activation bytes of one rank's band in units of one feature map at the image's
    resolution (the kind's `widths(config)[0]` channels x the band's pixel rows x columns x batch x dtype
    bytes), measured with torch's MemTracker on the meta device (`bench vae`). In bfloat16 / float16 more:
    GroupNorm's normalised band and diffusers' nearest upsampling are computed in float32 there."""

    decode_units: float
    encode_units: float
    decode_units_half: float
    encode_units_half: float

    def units(self, encode: bool, dtype_bytes: int) -> float:
        """The units of a decode (`encode`: an encode) in a dtype of `dtype_bytes` bytes."""
        if dtype_bytes >= 4:
            return self.encode_units if encode else self.decode_units
        return self.encode_units_half if encode else self.decode_units_half


@dataclass(frozen=True, eq=False)
class VaeKind:
    """One VAE the pack decodes and encodes patch-parallel (module docstring: what reads each field)."""

    name: str
    title: str  # for messages, e.g. "FLUX.1's VAE (ae.safetensors, 16 channels)"
    diffusers_class: str
    build: Callable[..., nn.Module]  # (config, device=, dtype=) -> the diffusers model; meta: no weights
    matches: Callable[[Collection[str]], bool]
    config_from_shapes: Callable[[Shapes], dict[str, Any]]
    convert: Callable[[dict[str, Any], Mapping[str, Any]], dict[str, Any]]
    latent_channels: Callable[[Mapping[str, Any]], int]  # (config) -> channels of ComfyUI's LATENT
    downscale: int
    planner: VaePlannerFacts
    # (config) -> (channels at the image's resolution, channels of the mid block's attention)
    widths: Callable[[Mapping[str, Any]], tuple[int, int]]
    released: Mapping[str, Any] = field(default_factory=dict)  # the released file's config (planner, bench)
    frames: bool = False
    to_model: Callable[[Any, Any], Any] = _same  # (model, ComfyUI latent) -> the model's latent
    from_model: Callable[[Any, Any], Any] = _same  # (model, the model's latent) -> ComfyUI's latent
    decode: Callable[[Any, Any], Any] = diffusers_decode
    encode: Callable[[Any, Any], Any] = diffusers_encode
    image_channels: int = 3


def vae_kinds() -> tuple[VaeKind, ...]:
    """Every VAE kind a registered family names, once each, in the families' order."""
    from ..family import families

    found: dict[str, VaeKind] = {}
    for family in families():
        kind = getattr(family, "vae", None)
        if kind is not None:
            found.setdefault(kind.name, kind)
    return tuple(found.values())


def get_vae_kind(name: str) -> VaeKind:
    for kind in vae_kinds():
        if kind.name == name:
            return kind
    raise ConfigError(f"VAE kind {name!r} is not known; known: {', '.join(k.name for k in vae_kinds())}")


def detect_vae(keys: Collection[str]) -> VaeKind | None:
    """The kind whose file these header keys are (ComfyUI's VAELoader spellings or diffusers'), or None."""
    found = [k for k in vae_kinds() if k.matches(keys)]
    if len(found) > 1:
        raise RuntimeError(f"this VAE file is claimed by several kinds: {', '.join(k.name for k in found)}")
    return found[0] if found else None


__all__ = ["VaeKind", "VaePlannerFacts", "detect_vae", "diffusers_decode", "diffusers_encode", "get_vae_kind",
           "vae_kinds"]  # fmt: skip
