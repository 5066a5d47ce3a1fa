"""What every model family loads through: checkpoint files, key layouts, quantized formats, loading, LoRA.

A family brings only data (its `KeyLayout`, header detection, config from shapes: backend/family.py);
everything here works for any registered family.

* files.py  safetensors headers, file-kind and truncation checks (`CheckpointError`)
* keys.py   `KeyLayout` (BFL <-> diffusers as data): the machinery a family's layout is made of
* convert.py whole state dicts BFL <-> diffusers by their family, and the one writer `save_checkpoint`
* quant.py  ComfyUI's scaled fp8 / quantized "mixed" files
* gguf.py   GGUF files (ComfyUI-GGUF's): headers with the `gguf` package, a rank's rows / whole blocks
* foreign.py quantized formats refused by name (NF4 / bitsandbytes, GPTQ / AWQ, SVDQuant, quanto)
* info.py   `inspect_checkpoint` -> `CheckpointInfo` (headers only) and the dtype rules
* load.py   `load_model`: each rank reads only its shard
* lora/     LoRA files (LoRA, LoHa, LoKr, DoRA, .diff): inspect and check in the caller, apply per rank
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The package's names, each from its module, imported the first time it is read (PEP 562): `plan` reads
# headers (files.py, keys.py, the families' key layouts) without torch, which convert.py, info.py, load.py
# and lora/ import.
_SOURCES = {
    ".convert": ("bfl_to_diffusers", "diffusers_to_bfl", "save_checkpoint"),
    ".files": ("COMFY_PREFIX", "CheckpointError", "StoredTensor"),
    ".info": ("CheckpointInfo", "check_weight_dtype", "default_dtype", "describe_keys", "inspect_checkpoint",
              "planned_file_weights", "planned_weight_dtype", "resolve_dtype"),
    ".keys": ("Blocks", "Fused", "KeyLayout", "Source"),
    ".load": ("load_model", "read_parameter", "resident_dtype"),
    ".lora": ("LoraError", "LoraInfo", "apply_loras", "check_loras", "inspect_lora"),
}  # fmt: skip
_MODULE_OF = {name: module for module, names in _SOURCES.items() for name in names}

if TYPE_CHECKING:
    from .convert import bfl_to_diffusers, diffusers_to_bfl, save_checkpoint
    from .files import COMFY_PREFIX, CheckpointError, StoredTensor
    from .info import (
        CheckpointInfo,
        check_weight_dtype,
        default_dtype,
        describe_keys,
        inspect_checkpoint,
        planned_file_weights,
        planned_weight_dtype,
        resolve_dtype,
    )
    from .keys import Blocks, Fused, KeyLayout, Source
    from .load import load_model, read_parameter, resident_dtype
    from .lora import LoraError, LoraInfo, apply_loras, check_loras, inspect_lora


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)


__all__ = [
    "COMFY_PREFIX",
    "Blocks",
    "CheckpointError",
    "CheckpointInfo",
    "Fused",
    "KeyLayout",
    "LoraError",
    "LoraInfo",
    "Source",
    "StoredTensor",
    "apply_loras",
    "bfl_to_diffusers",
    "check_loras",
    "check_weight_dtype",
    "default_dtype",
    "describe_keys",
    "diffusers_to_bfl",
    "inspect_checkpoint",
    "inspect_lora",
    "load_model",
    "planned_file_weights",
    "planned_weight_dtype",
    "read_parameter",
    "resident_dtype",
    "resolve_dtype",
    "save_checkpoint",
]
