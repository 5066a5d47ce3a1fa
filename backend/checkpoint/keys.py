"""Checkpoint key layouts as data: the BFL / ComfyUI single-file layout <-> diffusers parameters.

A family describes its layout once (`KeyLayout`: diffusers module -> BFL module, and which rows of a fused
BFL tensor it is). Everything else reads that one description: the sharded loader (a rank's slice of a
fused `qkv` or `linear1` straight from disk), the LoRA key table, the converters below and the one writer,
`save_checkpoint`, that the demo, the tests and the benchmarks use.

Why not diffusers' converters: they hard-code the released widths (3072 for FLUX.1), so they cannot convert
the small random models the tests use, and they have no inverse. Every width here is inferred from shapes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ..config import ModelDims
from .files import COMFY_PREFIX, CheckpointError

if TYPE_CHECKING:  # torch only where tensors are cut or joined: `plan` reads key layouts without it
    import torch

T = TypeVar("T")

# The prefixes ComfyUI's loader strips (comfy/model_detection.py unet_prefix_from_state_dict): ldm/sgm full
# checkpoints and ModelSave, audio models, Cosmos; `model.` when none has more than MIN_PREFIXED_KEYS keys.
PREFIXES = (COMFY_PREFIX, "model.model.", "net.")
FALLBACK_PREFIX = "model."
MIN_PREFIXED_KEYS = 5
# BFL's RMS norm parameter and ComfyUI >= 0.14's name for it (torch.nn.RMSNorm's).
NORM_SCALE, NORM_WEIGHT = "_norm.scale", "_norm.weight"


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

    parts: tuple[str, ...]  # widths of the BFL output blocks, by ModelDims attribute name
    take: tuple[int, ...]

    def rows(self, dims: ModelDims) -> tuple[tuple[int, int], ...]:
        bounds, offset = [], 0
        for part in self.parts:
            width = getattr(dims, part)
            bounds.append((offset, offset + width))
            offset += width
        return tuple(bounds[i] for i in self.take)


# diffusers module -> (BFL module, fused part or None)
KeyTable = Mapping[str, tuple[str, "Fused | None"]]


@dataclass(frozen=True)
class Blocks:
    """Numbered blocks: diffusers `<diffusers>N.<module>` is BFL `<bfl>N.<table[module]>`."""

    diffusers: str  # e.g. "transformer_blocks."
    bfl: str  # e.g. "double_blocks."
    table: KeyTable


@dataclass(frozen=True)
class KeyLayout:
    """A family's BFL <-> diffusers key mapping as data: the top-level modules (embedders, guidance, final
    layer) and each kind of numbered block.

    Parameter names follow the modules (`weight`, and `bias` where the model has one), except that BFL's
    RMS norms (modules ending in `_norm`) store diffusers' `weight` as `scale` when `norm_scale` is set.
    Which parameters exist is the model's business: `sources` maps the names it is given.
    """

    top: KeyTable
    blocks: tuple[Blocks, ...]
    norm_scale: bool = True

    def source(self, name: str, dims: ModelDims) -> Source | None:
        """Where diffusers parameter `name` lives in a BFL file (no key prefix); None when nowhere."""
        module, _, param = name.rpartition(".")
        table, inner, prefix = self.top, module, ""
        for blocks in self.blocks:
            index, _, rest = module.removeprefix(blocks.diffusers).partition(".")
            if module.startswith(blocks.diffusers) and index.isdigit():
                table, inner, prefix = blocks.table, rest, f"{blocks.bfl}{index}."
                break
        if inner not in table:
            return None
        bfl_module, fused = table[inner]
        if self.norm_scale and bfl_module.endswith("_norm") and param == "weight":
            param = "scale"
        return Source(f"{prefix}{bfl_module}.{param}", None if fused is None else fused.rows(dims))

    def sources(
        self, dims: ModelDims, params: Iterable[str], *, known_only: bool = False
    ) -> dict[str, Source]:
        """diffusers parameter name -> where it lives in a BFL checkpoint, for every name in `params`.

        A name the layout has no place for is a CheckpointError, or skipped with `known_only` (a file's
        keys, whose strays the shape check reports with the file's path).
        """
        out: dict[str, Source] = {}
        for name in params:
            source = self.source(name, dims)
            if source is not None:
                out[name] = source
            elif not known_only:
                raise CheckpointError(f"diffusers parameter '{name}' has no place in this BFL key layout")
        return out

    def bfl_shapes(
        self, dims: ModelDims, shapes: Mapping[str, tuple[int, ...]]
    ) -> dict[str, tuple[int, ...]]:
        """BFL key -> shape of the file that stores diffusers parameters of these `shapes`."""
        return bfl_view(self.sources(dims, shapes), shapes)

    def bfl_names(self, stored: Mapping[str, T], where: str = "this state dict") -> dict[str, T]:
        """A file's keys (prefix already stripped) under this layout's names, values unchanged.

        ComfyUI >= 0.14 holds the q/k RMS norms as torch's RMSNorm, whose parameter is `weight`, and its
        ModelSave writes them so (`*_norm.weight`, as every model merged or LoRA-baked in ComfyUI is saved);
        its loader reads BFL's `*_norm.scale` too (comfy/supported_models.py Flux.process_unet_state_dict
        renames one to the other). Both spellings name the same tensor here; a file holding both for one
        norm is refused (`where` names it in the message): which one ComfyUI would use depends on its
        version.
        """
        if not self.norm_scale:
            return dict(stored)
        out: dict[str, T] = {}
        for key, value in stored.items():
            name = key
            if key.endswith(NORM_WEIGHT):
                name = key[: -len(NORM_WEIGHT)] + NORM_SCALE
                if name in stored:
                    raise CheckpointError(
                        f"{where} holds both '{name}' and '{key}', two spellings of one RMS norm's scale "
                        "(BFL's and ComfyUI >= 0.14's); which one ComfyUI uses depends on its version. "
                        "Keep one of them: re-save the model with ComfyUI's ModelSave, or use the original file"
                    )
            out[name] = value
        return out


# --------------------------------------------------------------------------------------------------
# Shapes and keys


def shapes_of(keys_and_shapes: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """{key: shape} from {key: shape} or {key: tensor}."""
    return {k: tuple(v.shape) if hasattr(v, "shape") else tuple(v) for k, v in keys_and_shapes.items()}


def transformer_prefix(keys: Iterable[str]) -> str:
    """The prefix ComfyUI's UNETLoader strips from these keys before it looks at them ("" for none).

    comfy/model_detection.py `unet_prefix_from_state_dict` (0.3.75 and 0.33): of `model.diffusion_model.`
    (full checkpoints, ModelSave), `model.model.` and `net.`, the one most keys start with if more than
    5 do, else `model.`; comfy/sd.py `load_diffusion_model_state_dict` then keeps only the keys under it,
    and the whole file unchanged when no key is. Written out here because the backend never imports
    ComfyUI; the comfy tier loads every prefix through both.
    """
    keys = list(keys)
    counts = dict.fromkeys(PREFIXES, 0)
    for key in keys:
        found = next((p for p in PREFIXES if key.startswith(p)), None)
        if found is not None:
            counts[found] += 1
    top = max(counts, key=counts.__getitem__)  # the first of equals, as ComfyUI's max over its list
    prefix = top if counts[top] > MIN_PREFIXED_KEYS else FALLBACK_PREFIX
    return prefix if any(k.startswith(prefix) for k in keys) else ""


def strip_prefix(keys_and_values: Mapping[str, T]) -> dict[str, T]:
    """The keys under ComfyUI's transformer prefix (`transformer_prefix`), without it; the rest of a full
    checkpoint (text encoders, VAE) is dropped, as ComfyUI's loader drops it."""
    prefix = transformer_prefix(keys_and_values)
    return {k[len(prefix) :]: v for k, v in keys_and_values.items() if k.startswith(prefix)}


def bfl_names(
    keys_and_values: Mapping[str, T], layout: KeyLayout, where: str = "this state dict"
) -> dict[str, T]:
    """A BFL / ComfyUI state dict or header under `layout`'s names: prefix stripped, norms canonical."""
    return layout.bfl_names(strip_prefix(keys_and_values), where)


def block_count(shapes: Mapping[str, tuple[int, ...]], prefix: str) -> int:
    """How many numbered blocks `prefix`N.* there are; CheckpointError naming the gaps."""
    indices = {int(k.split(".")[1]) for k in shapes if k.startswith(prefix) and k.split(".")[1].isdigit()}
    if indices != set(range(len(indices))):
        missing = sorted(set(range(max(indices) + 1)) - indices)
        raise CheckpointError(f"'{prefix}*' blocks {missing} are missing; the checkpoint is incomplete")
    return len(indices)


def require(shapes: Mapping[str, tuple[int, ...]], key: str, title: str) -> tuple[int, ...]:
    """The shape of `key`; CheckpointError saying the `title` checkpoint is incomplete otherwise."""
    if key not in shapes:
        raise CheckpointError(f"tensor '{key}' is missing; the checkpoint is incomplete or not {title}")
    return shapes[key]


def bfl_view(
    sources: Mapping[str, Source], shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, tuple[int, ...]]:
    """BFL key -> shape of the tensors the diffusers `shapes` are stored in (a fused tensor has as many
    rows as its parts' last row)."""
    out: dict[str, tuple[int, ...]] = {}
    for name, source in sources.items():
        shape = tuple(shapes[name])
        if source.rows is not None:
            rows = max(max(b for _, b in source.rows), out.get(source.key, (0,))[0])
            shape = (rows, *shape[1:])
        out[source.key] = shape
    return out


def diffusers_config_via_bfl(
    layout: KeyLayout, dims: ModelDims, shapes: Mapping[str, tuple[int, ...]], config_from_bfl: Any
) -> dict[str, Any]:
    """The config of a diffusers-keyed file: its shapes seen through `layout` as the BFL file they would
    be, read by the family's one shape reader `config_from_bfl`. `dims` (from the diffusers shapes) give
    the widths of the fused parts; keys the layout does not know are left to the loader's shape check."""
    return config_from_bfl(bfl_view(layout.sources(dims, shapes, known_only=True), shapes))


# --------------------------------------------------------------------------------------------------
# Converters


def take_rows(tensor: torch.Tensor, rows: tuple[tuple[int, int], ...] | None) -> torch.Tensor:
    """The `rows` of a stored tensor, concatenated (the whole tensor for None)."""
    if rows is None:
        return tensor
    import torch

    parts = [tensor[a:b] for a, b in rows]
    return parts[0].clone() if len(parts) == 1 else torch.cat(parts, dim=0)


def assemble_bfl(
    sources: Mapping[str, Source], state_dict: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The BFL tensors of a diffusers state dict, given where each diffusers tensor lives (`sources`):
    fused tensors are the row blocks of their parts in file order; unfused ones are passed through."""
    import torch

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


__all__ = [
    "Blocks",
    "Fused",
    "KeyLayout",
    "KeyTable",
    "Source",
    "assemble_bfl",
    "bfl_names",
    "bfl_view",
    "block_count",
    "diffusers_config_via_bfl",
    "require",
    "shapes_of",
    "strip_prefix",
    "take_rows",
    "transformer_prefix",
]
