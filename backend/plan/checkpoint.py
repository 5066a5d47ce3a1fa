"""`plan --checkpoint`: what a user's file is, for the planner, from its header alone and without torch.

The planner needs three things of a file: its family, its dims (a released model's, whose facts are stored
in facts.json) and how its linear weights are held (the file's dtype: bf16, fp8, ComfyUI's scaled fp8, a
GGUF quantization type). The loader's `inspect_checkpoint` (checkpoint/info.py) says all of that and more,
but imports torch; this reads the same header with the same detection (the families' torch-free
`FamilyHeader`: key layout, `matches_*`, configs from shapes) and the dtype rule of
`planned_weight_dtype` (the dtype storing most linear-weight elements), and leaves the loader's deeper
checks (every tensor's shape, scales' values) to the load.

A safetensors header is read by hand: the format is an 8-byte little-endian length and that many bytes of
JSON (github.com/huggingface/safetensors, "Format"), and safetensors' Python API reads headers only
through `safe_open`, which imports numpy (framework "numpy") or torch ("pt"). A GGUF header is read with
the `gguf` package (checkpoint/gguf_header.py), which imports numpy: only for a .gguf file.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint.files import (
    CHECKPOINT_FIX,
    CheckpointError,
    StoredTensor,
    check_file_kind,
    is_gguf,
    listing,
    missing_checkpoint,
    numel,
    refuse_special,
    truncation_detail,
)
from ..checkpoint.foreign import refuse_foreign_quantization
from ..checkpoint.keys import transformer_prefix
from ..checkpoint.quant import QUANT_SUFFIXES, SCALE_INPUT, SCALE_WEIGHT, SCALED_FP8_MARKER
from ..config import ModelDims
from ..dtypes import GGUF_BLOCKS, stored_dtype
from ..family import ModelFamily, detect_bfl, detect_diffusers, families, family_for_class
from ..runtime.redact import quoted

# diffusers' folder files (checkpoint/info.py's names; that module imports torch)
_CONFIG, _WEIGHTS, _INDEX = (
    "config.json",
    "diffusion_pytorch_model.safetensors",
    "diffusion_pytorch_model.safetensors.index.json",
)
_SCALE_SUFFIXES = (*QUANT_SUFFIXES, SCALE_WEIGHT, SCALE_INPUT)  # a scaled weight's companions: no parameters


@dataclass(frozen=True)
class PlannedCheckpoint:
    """A checkpoint as `plan` prices it."""

    path: str
    family: ModelFamily
    config: dict[str, Any]
    preset: str | None  # the released model (`plan --model` name) whose dims the file has; None: none
    weight_dtype: str  # the planner's name: "compute" (bf16 / fp16 / fp32), "fp8_e4m3fn", "Q4_K", ...
    stored: str  # the stored dtype of most linear-weight elements, as the header spells it ("BF16", "Q4_K")

    @property
    def dims(self) -> ModelDims:
        return self.family.dims(self.config)

    @property
    def name(self) -> str:
        """What the header says the model is, e.g. 'FLUX.2 [dev]'."""
        return self.family.describe(self.config)


def safetensors_header(path: Path) -> tuple[dict[str, StoredTensor], dict[str, str]]:
    """(key -> stored tensor, `__metadata__`) of a safetensors file, read by hand (see the module's text)."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > size - 8:
                raise ValueError("header longer than the file")
            header = json.loads(f.read(length))
        entries = {k: v for k, v in header.items() if k != "__metadata__"}
        end = max((int(v["data_offsets"][1]) for v in entries.values()), default=0)
        tensors = {
            k: StoredTensor(str(path), k, tuple(int(n) for n in v["shape"]), str(v["dtype"]))
            for k, v in entries.items()
        }
        if 8 + length + end != size:  # a truncated download: the loader would refuse it, so say so now
            raise ValueError("sizes differ")
    except (ValueError, KeyError, TypeError, AttributeError, struct.error) as err:
        raise CheckpointError(
            f"{quoted(path)} is truncated or corrupt: {truncation_detail(path, err)}. Download or copy it again"
        ) from None
    return tensors, dict(header.get("__metadata__") or {})


def _file_header(path: Path) -> dict[str, StoredTensor]:
    check_file_kind(path)
    if is_gguf(path):
        from ..checkpoint.gguf_header import read_gguf_header  # the gguf package imports numpy: .gguf only

        return read_gguf_header(path)[0]
    return safetensors_header(path)[0]


def _model_tensors(path: Path, header: Mapping[str, StoredTensor]) -> dict[str, StoredTensor]:
    """The transformer's tensors under keys without the prefix ComfyUI strips, scale companions dropped."""
    prefix = transformer_prefix(header)
    stripped = {k[len(prefix) :]: t for k, t in header.items() if k.startswith(prefix)}
    refuse_foreign_quantization(path, stripped)  # NF4 / bitsandbytes, GPTQ, ... named before anything else
    return {k: t for k, t in stripped.items() if k != SCALED_FP8_MARKER and not k.endswith(_SCALE_SUFFIXES)}


def _families_text() -> str:
    titles = [f.title for f in families()]
    return ", ".join(titles[:-1]) + " or " + titles[-1] if len(titles) > 1 else titles[0]


def _detect_file(path: Path, tensors: dict[str, StoredTensor]) -> tuple[ModelFamily, dict[str, Any]]:
    family = detect_bfl(set(tensors))
    if family is not None:
        named = family.keys.bfl_names(tensors, quoted(path))
        shapes, read = {k: t.shape for k, t in named.items()}, family.config_from_bfl
    else:
        family = detect_diffusers(set(tensors))
        shapes, read = {k: t.shape for k, t in tensors.items()}, family and family.config_from_diffusers
    if family is None or read is None:
        sample = ", ".join(sorted(tensors)[:4])
        raise CheckpointError(
            f"--checkpoint {quoted(path)} is not a {_families_text()} transformer (first keys: {sample}); "
            f"{CHECKPOINT_FIX}, or plan a released model with --model"
        )
    try:
        return family, read(shapes)
    except (CheckpointError, ValueError) as err:
        raise CheckpointError(f"--checkpoint {quoted(path)}: {err}") from None


def _read_folder(path: Path) -> tuple[ModelFamily, dict[str, Any], dict[str, StoredTensor]]:
    folder = path / "transformer" if (path / "transformer").is_dir() else path
    if not (folder / _CONFIG).is_file():
        raise CheckpointError(
            f"--checkpoint {quoted(folder)} is a folder without {_CONFIG}, so not a diffusers model; it has: "
            f"{listing(folder)}. Pass a .safetensors or .gguf file, or a diffusers folder with {_CONFIG}"
        )
    raw = json.loads((folder / _CONFIG).read_text())
    family = family_for_class(raw.get("_class_name"))
    if family is None:
        known = " or ".join(f.diffusers_class for f in families())
        raise CheckpointError(
            f"--checkpoint {quoted(folder / _CONFIG)} describes a {raw.get('_class_name')}, not a {known}; "
            "pass a pipeline folder or its transformer/ folder"
        )
    config = {k: v for k, v in raw.items() if not k.startswith("_")}
    if (folder / _INDEX).is_file():
        shards = sorted(set(json.loads((folder / _INDEX).read_text())["weight_map"].values()))
    else:
        shards = [_WEIGHTS]
    tensors: dict[str, StoredTensor] = {}
    for shard in shards:
        if not (folder / shard).is_file():
            raise CheckpointError(
                f"--checkpoint {quoted(folder)} lacks '{shard}' (it has: {listing(folder)}); download it"
            )
        tensors.update(safetensors_header(folder / shard)[0])
    return family, config, tensors


def stored_linear_dtype(tensors: Mapping[str, StoredTensor]) -> str:
    """The stored dtype of most linear-weight (2-D) elements, as the header spells it."""
    counts: dict[str, int] = {}
    for t in tensors.values():
        if len(t.shape) == 2:
            counts[t.dtype] = counts.get(t.dtype, 0) + numel(t.shape)
    return max(counts, key=counts.__getitem__) if counts else "BF16"


def planned_dtype(stored: str) -> str:
    """The planner's weight dtype for linear weights stored as `stored` (checkpoint/info.py
    `planned_weight_dtype`'s rule for weight_dtype 'default'): a GGUF type stays quantized, fp8 stays fp8,
    anything else is held in the compute dtype."""
    if stored in GGUF_BLOCKS:
        return stored
    found = stored_dtype(stored)
    return found.short if found is not None and found.fp8 and found.short else "compute"


def preset_of(family: ModelFamily, dims: ModelDims) -> str | None:
    """The family's released model (a preset's name) with these dims, None when none has them."""
    return next((name for name, config in family.presets.items() if family.dims(config) == dims), None)


def inspect_for_plan(path: str) -> PlannedCheckpoint:
    """`path` (a .safetensors or .gguf file, or a diffusers folder): its family, config, weight dtype and
    the released model with its dims (None when none has them).

    CheckpointError (a ConfigError) names the path, what was found and the fix: a missing file, a file of
    no known family, a damaged or truncated header.
    """
    where = Path(path).expanduser()
    if not where.exists():
        raise missing_checkpoint(where)
    refuse_special(where, "checkpoint", CHECKPOINT_FIX)
    if where.is_dir():
        family, config, tensors = _read_folder(where)
    else:
        tensors = _model_tensors(where, _file_header(where))
        family, config = _detect_file(where, tensors)
    stored = stored_linear_dtype(tensors)
    preset = preset_of(family, family.dims(config))
    return PlannedCheckpoint(str(where), family, config, preset, planned_dtype(stored), stored)


def unreleased_dims(planned: PlannedCheckpoint) -> str:
    """Why a file whose dims are no released model's is not priced (its facts need the meta model, so
    torch and diffusers), and what to do instead."""
    family, dims = planned.family, planned.dims
    released = "; ".join(
        f"{name}: {d.heads} heads x {d.head_dim}, {d.blocks_text()}"
        for name, d in ((name, family.dims(c)) for name, c in family.presets.items())
    )
    return (
        f"--checkpoint {quoted(planned.path)} is a {family.title} transformer of {dims.heads} heads x "
        f"{dims.head_dim}, {dims.blocks_text()}, which no released model has ({released}); `plan` keeps "
        "the parameter shapes, TP splits and work of the released models only, and deriving them for other "
        "dims builds the model on torch's meta device (torch and diffusers). Plan the released model nearest "
        "to it (--model), or load it with layout 'auto', which plans from the file"
    )


__all__ = [
    "PlannedCheckpoint",
    "inspect_for_plan",
    "planned_dtype",
    "preset_of",
    "safetensors_header",
    "unreleased_dims",
]
