"""Text encoders as data: everything the pack knows about one kind of text encoder, in one record.

A text encoder is not a diffusion `ModelFamily` (backend/family.py): it has no latent, no sampling and no
model call of ComfyUI's samplers. It is its own small registry, in the same style: one folder per architecture
(backend/encoders/t5/, backend/encoders/llama/) whose `kind.py` builds `EncoderKind` records and registers
them; the generic machinery (the loader, the worker methods, the caller's API, the planner, the ComfyUI
CLIP in nodes/comfy_clip.py) reads only these fields:

* identity: `name` (ComfyUI's name for the encoder inside its CLIP, e.g. "t5xxl", which is also the key of
  ComfyUI's `<name>_model_config` option), `title`, `comfy_classes` (the class names of ComfyUI's own
  transformer for it: the CLIP ComfyUI builds must hold one of them);
* what it serves: `clip_types`, ComfyUI's CLIPLoader / DualCLIPLoader `type` names that use it, each with
  the graph it is for (messages), and `companions` (a DualCLIPLoader's other file, which stays in ComfyUI);
* the file: `matches(keys)` (header detection), `prefix` (the file's keys are `prefix` + parameter name),
  `config_from_shapes(shapes)` (ComfyUI's config fields, exact for the released files and for small test
  files alike), `dims(config)`;
* the workers' model: `build(config, device)` (ComfyUI's arithmetic: the folder's model.py), `tp(embedding)`
  (the tensor-parallel plan as data; `embedding` is "vocab" (split by vocabulary) or "replicated");
* ComfyUI's side: `stack` and `embedding` (the attributes of ComfyUI's transformer that the caller replaces
  with proxies: the module whose forward runs on the workers, and the token embedding);
* the planner: `presets` (the released configs by name).

Lookups: `get_encoder_kind(name)`, `encoder_kinds()`, `detect_encoder(keys)`, `kinds_for_clip_type(t)`.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..config import ConfigError, ModelDims, _divisors, _one_of

if TYPE_CHECKING:
    from torch import nn

    from ..parallel.tensor import TensorParallelSpec

# Modules (relative to this package) whose import registers the built-in encoder kinds.
BUILTIN: tuple[str, ...] = (".t5.kind", ".llama.kind")

EMBEDDINGS = ("vocab", "replicated")  # how tensor parallelism treats the token embeddings

Shapes = Mapping[str, tuple[int, ...]]


@dataclass(frozen=True)
class EncoderDims(ModelDims):
    """The shape facts tensor parallelism and the planner read: `heads` x `head_dim` (the attention width q
    and o split), `kv_heads` (key/value heads: whole groups per rank), `mlp`, `width` (the residual stream),
    `layers`, `vocab`, `max_tokens` (the longest prompt the encoder takes; 0: no limit of its own)."""

    kv_heads: int = 0
    width: int = 0
    layers: int = 0
    vocab: int = 0
    max_tokens: int = 0

    def blocks_text(self) -> str:
        return f"{self.layers} layers"


def validate_encoder_tp(degree: int, dims: EncoderDims, title: str) -> None:
    """Raise ConfigError unless `degree` ranks can each hold whole attention heads, whole key/value groups
    and an equal share of the MLP (the vocabulary need not divide: parallel/vocab.py)."""
    if degree == 1:
        return
    for what, count in (
        ("attention heads", dims.heads),
        ("key/value heads", dims.kv_heads),
        ("MLP width", dims.mlp),
    ):
        if count % degree:
            valid = [
                d for d in _divisors(dims.heads) if d > 1 and dims.kv_heads % d == 0 and dims.mlp % d == 0
            ]
            raise ConfigError(
                f"{title} cannot be split over {degree} devices: {degree} does not divide its {count} {what}; "
                f"its tensor-parallel degree must be {_one_of(valid)} (use that many devices in the loader, or "
                "leave this encoder to ComfyUI's own CLIPLoader)"
            )
    if dims.vocab < degree:
        raise ConfigError(f"{title}'s vocabulary of {dims.vocab} tokens is smaller than {degree} devices")


@dataclass(frozen=True, eq=False)
class EncoderKind:
    """One text encoder (module docstring). Every callable taking `config` takes ComfyUI's config fields."""

    name: str
    title: str
    comfy_classes: tuple[str, ...]
    clip_types: Mapping[str, str]
    matches: Callable[[Collection[str]], bool]
    prefix: str
    config_from_shapes: Callable[[Shapes], dict[str, Any]]
    dims: Callable[[Mapping[str, Any]], EncoderDims]
    build: Callable[..., nn.Module]
    tp: Callable[[str], TensorParallelSpec]
    stack: str
    embedding: str
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # files a graph of this encoder loads beside it that stay in ComfyUI's process (FLUX.1's CLIP-L: 123 M
    # parameters, a few milliseconds per prompt; sharding it would cost more in collectives than it saves):
    # name -> how to recognise its header
    companions: Mapping[str, Callable[[Collection[str]], bool]] = field(default_factory=dict)
    # keys of the file that are not the encoder's parameters and that ComfyUI reads for itself (a tokenizer
    # stored as a tensor, a vision tower the pack leaves to ComfyUI): neither loaded nor refused
    extra_keys: Callable[[str], bool] = lambda key: False
    # ComfyUI's names of the encoder inside its CLIP when they differ from `name` (Qwen3: "qwen3_4b",
    # "qwen3_8b"): ComfyUI reads a config override from `model_options["<name>_model_config"]`
    comfy_names: tuple[str, ...] = ()
    # [tokens x tokens] float32 maps the stack holds at once for one encode, besides the attention kernel's
    # own, given the batch and this rank's attention heads (model.py: T5's relative position bias per head and
    # the padding mask summed with it; a language model's causal mask [S, S], the padding mask [B, 1, S, S] and
    # their sum).
    # They grow with the square of the prompt: what bounds the longest prompt a device can encode.
    square_maps: Callable[[int, int], int] = lambda batch, heads: 1 + 2 * batch

    def names_in_comfy(self) -> tuple[str, ...]:
        return self.comfy_names or (self.name,)

    def validate_tp(self, degree: int, config: Mapping[str, Any]) -> None:
        validate_encoder_tp(degree, self.dims(config), self.title)


_REGISTRY: dict[str, EncoderKind] = {}


def register(kind: EncoderKind) -> EncoderKind:
    held = _REGISTRY.get(kind.name)
    if held is not None and held is not kind and held.title != kind.title:
        raise ValueError(f"two text encoder kinds are named {kind.name!r}: {held.title} and {kind.title}")
    _REGISTRY[kind.name] = kind
    return kind


@functools.cache
def _load_builtin() -> None:
    for module in BUILTIN:
        importlib.import_module(module, __package__)


def encoder_kinds() -> list[EncoderKind]:
    _load_builtin()
    return list(_REGISTRY.values())


def get_encoder_kind(name: str) -> EncoderKind:
    _load_builtin()
    kind = _REGISTRY.get(name)
    if kind is None:
        raise ConfigError(f"unknown text encoder kind {name!r}; the pack runs {', '.join(sorted(_REGISTRY))}")
    return kind


def detect_encoder(keys: Collection[str]) -> EncoderKind | None:
    """The kind whose header this is, or None (another kind of file). Raises when two kinds claim it."""
    found = [k for k in encoder_kinds() if k.matches(keys)]
    if len(found) > 1:
        raise RuntimeError(f"text encoder kinds {', '.join(k.name for k in found)} all claim one header")
    return found[0] if found else None


def kinds_for_clip_type(clip_type: str) -> list[EncoderKind]:
    return [k for k in encoder_kinds() if clip_type in k.clip_types]


def clip_types() -> list[str]:
    """Every ComfyUI CLIP type some registered kind serves, in registration order (the node's choices)."""
    seen: dict[str, None] = {}
    for kind in encoder_kinds():
        seen.update(dict.fromkeys(kind.clip_types))
    return list(seen)


__all__ = [
    "EMBEDDINGS",
    "EncoderDims",
    "EncoderKind",
    "clip_types",
    "detect_encoder",
    "encoder_kinds",
    "get_encoder_kind",
    "kinds_for_clip_type",
    "register",
    "validate_encoder_tp",
]
