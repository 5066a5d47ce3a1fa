"""Model families as data: what the loader, the workers and the ComfyUI proxy need to know about a
transformer family, in one record per family.

A family names its diffusers class (and how to build it), its tensor-parallel plan (data, like
`FLUX_TP_PLAN`) with the function that applies it, its checkpoint conversion (BFL / ComfyUI single file
-> diffusers parameters, as `Source` data read from headers), its latent format, its input preparation
(ComfyUI's `diffusion_model.forward` semantics around the diffusers forward), and the ComfyUI model
config the proxy MODEL is built from. The loader (`flux/load.py`), the worker's `forward` handler
(`service.py`) and the proxy MODEL (`nodes/comfy_model.py`) only ever read these fields, so adding a
family touches neither the worker, the client nor the nodes. Style: torchtitan's plans-as-data and
diffusers' `_cp_plan`; context parallelism comes from the diffusers class's own `_cp_plan`.

How to add a family
-------------------
1. Write a module that builds a `ModelFamily(...)` and calls `register(...)` at import time, e.g.
   `backend/flux2/family.py` (see `backend/flux/family.py`, the FLUX.1 entry, for every field).
2. Add that module's name to `BUILTIN` below: the registry imports the modules lazily, the first time
   a family is looked up, so importing this module stays cheap and free of cycles.
3. Make `matches_bfl` / `matches_diffusers` specific enough that no two families claim the same header:
   `detect_*` raises when two do, so an overlap is found by the first test that loads either.

Lookups: `get_family(name)`, `families()`, `detect_bfl(keys)`, `detect_diffusers(keys)`,
`family_for_class(class_name)`, `family_of(model)` (the loader marks each model it builds).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .config import ConfigError

# Modules (relative to this package) whose import registers the built-in families, in detection order.
BUILTIN: tuple[str, ...] = (".flux.family", ".flux2.family")

Shapes = Mapping[str, tuple[int, ...]]


@dataclass(frozen=True)
class LatentFormat:
    """ComfyUI's `comfy.latent_formats` entry of the family: `process_in(x) = (x - shift) * scale`."""

    comfy_name: str  # class name in comfy.latent_formats, e.g. "Flux"
    channels: int  # channels of the VAE latent the sampler works on (the model's output channels)
    scale: float
    shift: float
    downscale: int  # image pixels per latent pixel on each side (the VAE's): 8 for FLUX.1, 16 for FLUX.2
    vae: str  # the VAE file ComfyUI users encode with (messages name it)
    empty_node: str  # ComfyUI's node for an empty latent of this format


@dataclass(frozen=True)
class TextInputs:
    """The text conditioning a model call takes, for messages and the planner."""

    encoder: str  # how a ComfyUI user makes it (errors name it), e.g. "a FLUX DualCLIPLoader (...)"
    tokens: int  # text tokens of a short prompt as ComfyUI passes it (the planner prices these)
    pooled: bool  # whether a call takes a pooled vector `y` (FLUX.1's CLIP-L); FLUX.2 takes none


@dataclass(frozen=True)
class ComfyModel:
    """What ComfyUI's own loader would build for a checkpoint: a `comfy.supported_models` class and the
    unet_config detected from its header (comfy/model_detection.py). The proxy MODEL is built from it
    with `disable_unet_model_creation`, so ComfyUI's samplers, latent format, `extra_conds` and
    `concat_cond` (Fill's masked image) behave as with ComfyUI's loader."""

    config_class: str  # attribute of comfy.supported_models, e.g. "Flux", "FluxSchnell", "FluxInpaint"
    unet_config: Mapping[str, Any]


@dataclass(frozen=True)
class ModelFamily:
    """One transformer family. Every callable takes the diffusers config (a dict) the loader derived.

    - `build(config, device=, dtype=, seed=)`: the diffusers model; random weights when `seed` is set,
      none on the meta device (the loader builds on meta, shards, then fills from the file).
    - `tp_plan` / `apply_tp(model, group)`: the tensor-parallel plan (module pattern -> split kind) and
      the function that applies it in place (the loader reads the same plan to slice the file).
    - `matches_bfl(keys)`, `config_from_bfl(shapes)`, `bfl_sources(config)`: header detection and
      conversion of the BFL / ComfyUI single-file layout (keys without `model.diffusion_model.`);
      `bfl_sources` maps every diffusers parameter to a `flux.convert.Source` (the BFL key and rows).
    - `matches_diffusers(keys)`, `config_from_diffusers(shapes)`: the same for diffusers-keyed files.
    - `variant(config)`: the schedule / guidance kind the sampler and the API key on ("dev" needs a
      guidance value, "schnell" has none); `describe(config)`: the model's name for messages.
    - `input_channels(config)`: channels of `x` in a model call (latent plus concatenated extras);
      `latent_channels(config)`: channels of the latent itself (the output, and a reference latent).
    - `patch`: latent pixels per token on each side (`image_tokens` counts a latent's tokens);
      `text`: the text conditioning; `ref_method`: ComfyUI's default placement of reference latents.
    - `comfy_model(config)`: the ComfyUI model config the proxy MODEL is built from.
    - `call(model_fn, x, timestep, context, pooled, guidance, ref_latents=(), ref_method="offset")`:
      one model call with ComfyUI's semantics (pad, patchify, ids, crop); `model_fn(model)` adapts the
      diffusers model to the `model_fn` contract `call` takes.
    - `sampling(info, latent, positive, *, seed, steps, denoise, sigmas, noise_mask, batch_index,
      shift_mu)`: the `flux.sampling.SamplingPlan` `ParallelFlux.sample` runs (its Euler loop) for a
      checkpoint of this family: ComfyUI's default graph for it (FLUX.1: KSampler euler/simple on the
      dev/schnell table; FLUX.2: Flux2Scheduler).
    """

    name: str
    title: str
    diffusers_class: str
    build: Callable[..., Any]
    tp_plan: Mapping[str, Any]
    apply_tp: Callable[[Any, Any], Any]
    latent: LatentFormat
    matches_bfl: Callable[[Collection[str]], bool]
    config_from_bfl: Callable[[Shapes], dict[str, Any]]
    bfl_sources: Callable[[Mapping[str, Any]], Mapping[str, Any]]
    matches_diffusers: Callable[[Collection[str]], bool]
    config_from_diffusers: Callable[[Shapes], dict[str, Any]]
    variant: Callable[[Mapping[str, Any]], str]
    describe: Callable[[Mapping[str, Any]], str]
    input_channels: Callable[[Mapping[str, Any]], int]
    latent_channels: Callable[[Mapping[str, Any]], int]
    patch: int
    text: TextInputs
    ref_method: str
    comfy_model: Callable[[Mapping[str, Any]], ComfyModel]
    call: Callable[..., Any]
    model_fn: Callable[[Any], Callable[..., Any]]
    sampling: Callable[..., Any]

    def image_tokens(self, height: int, width: int) -> int:
        """Tokens of a latent of height x width latent pixels (ComfyUI pads a partial patch)."""
        return -(-height // self.patch) * -(-width // self.patch)

    def planned_pixels(self, height: int, width: int) -> tuple[int, int]:
        """(width, height) in pixels the planner prices for a latent of height x width latent pixels: padded
        to whole patches, as the model pads it, so an odd latent is priced by the tokens it becomes."""
        pad = self.patch * self.latent.downscale
        return -(-width // self.patch) * pad, -(-height // self.patch) * pad

    def bfl_shapes(self, config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
        """BFL key -> shape a checkpoint of `config` has: the meta model's shapes mapped through the
        family's sources (a fused tensor has as many rows as its parts' last row)."""
        sources = self.bfl_sources(config)
        out: dict[str, tuple[int, ...]] = {}
        for name, param in self.build(dict(config), device="meta").state_dict().items():
            source = sources[name]
            shape = tuple(param.shape)
            if source.rows is not None:
                rows = max(max(b for _, b in source.rows), out.get(source.key, (0,))[0])
                shape = (rows, *shape[1:])
            out[source.key] = shape
        return out


_REGISTRY: dict[str, ModelFamily] = {}
_loaded = False


def register(family: ModelFamily) -> ModelFamily:
    """Add `family` (its module calls this at import time); a second family of the same name is a bug."""
    held = _REGISTRY.get(family.name)
    if held is not None and held is not family:
        raise ValueError(f"model family '{family.name}' is registered twice ({held.title}, {family.title})")
    _REGISTRY[family.name] = family
    return family


def _load_builtin() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in BUILTIN:
            importlib.import_module(module, __package__)


def families() -> tuple[ModelFamily, ...]:
    """Every registered family, in detection order."""
    _load_builtin()
    return tuple(_REGISTRY.values())


def get_family(name: str) -> ModelFamily:
    """The family called `name`; ConfigError naming the known ones otherwise."""
    _load_builtin()
    if name not in _REGISTRY:
        raise ConfigError(f"model family '{name}' is not known; known families: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


# Attribute `load_flux` sets on the model it builds: the name of its family.
FAMILY_ATTRIBUTE = "_rp_family"
DEFAULT_FAMILY = "flux1"  # a model built without the loader (tests, demos) is FLUX.1


def family_of(model: Any) -> ModelFamily:
    """The family a resident model was loaded as (`load_flux` marks it)."""
    return get_family(getattr(model, FAMILY_ATTRIBUTE, DEFAULT_FAMILY))


def _only(found: Sequence[ModelFamily], what: str) -> ModelFamily | None:
    if len(found) > 1:
        raise RuntimeError(f"{what} is claimed by several families: {', '.join(f.name for f in found)}")
    return found[0] if found else None


def detect_bfl(keys: Collection[str]) -> ModelFamily | None:
    """The family whose BFL / ComfyUI layout these header keys (prefix stripped) are, or None."""
    return _only([f for f in families() if f.matches_bfl(keys)], "this BFL checkpoint")


def detect_diffusers(keys: Collection[str]) -> ModelFamily | None:
    """The family whose diffusers layout these header keys are, or None."""
    return _only([f for f in families() if f.matches_diffusers(keys)], "this diffusers checkpoint")


def family_for_class(class_name: str | None) -> ModelFamily | None:
    """The family built by the diffusers class named in a folder's config.json `_class_name`."""
    return next((f for f in families() if f.diffusers_class == class_name), None)


__all__ = [
    "BUILTIN",
    "FAMILY_ATTRIBUTE",
    "ComfyModel",
    "LatentFormat",
    "ModelFamily",
    "TextInputs",
    "detect_bfl",
    "detect_diffusers",
    "families",
    "family_for_class",
    "family_of",
    "get_family",
    "register",
]
