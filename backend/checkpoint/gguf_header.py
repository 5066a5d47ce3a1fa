"""A GGUF file's header (ComfyUI-GGUF's diffusion models), read with the `gguf` package: its tensors' names,
shapes and GGML types, and the refusals that need nothing but the header.

Apart from gguf.py (which reads the blocks, with torch) so that `plan --checkpoint` reads a GGUF file's
header without torch; the `gguf` package imports numpy, which only a .gguf file brings in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..dtypes import GGUF_BLOCKS
from ..family import families
from ..runtime.redact import quoted
from .files import CheckpointError, StoredTensor

# GGML types read as plain tensors (gguf.py PLAIN: their torch dtypes)
PLAIN_TYPES = ("F32", "F16", "BF16")
# ComfyUI-GGUF's reshaped tensors (tools/convert.py shape_fix, for SD1/SDXL): rows that are not the weight's
ORIG_SHAPE = "comfy.gguf.orig_shape."
# GGUF files of text models (ComfyUI-GGUF's TXT_ARCH_LIST): a text encoder, not a diffusion model.
TEXT_ARCHS = ("t5", "t5encoder", "llama", "qwen2vl", "qwen3", "qwen3vl")
ARCH = "general.architecture"
FIX = (
    "Use a Q8_0, Q6_K, Q5_K or Q4_K GGUF file of the model (city96's and most others are), or its safetensors"
)


def supported_types() -> str:
    return ", ".join([*PLAIN_TYPES, *GGUF_BLOCKS])


def _fields(reader: Any) -> dict[str, Any]:
    """The header's string and integer fields (the key-value part), for the info's metadata."""
    from gguf import GGUFValueType

    out: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        if field.types == [GGUFValueType.STRING]:
            out[name] = str(bytes(field.parts[field.data[-1]]), encoding="utf-8")
        elif len(field.types) == 1 and field.types[0] != GGUFValueType.ARRAY:
            out[name] = str(field.parts[field.data[-1]][0])
        else:
            out[name] = "[...]"
    return out


def _family_titles() -> str:
    """'FLUX.1, FLUX.2 or Qwen-Image': the registered families, for messages."""
    titles = [f.title for f in families()]
    return " or ".join(filter(None, (", ".join(titles[:-1]), titles[-1])))


def read_gguf_header(path: Path) -> tuple[dict[str, StoredTensor], dict[str, str]]:
    """(key -> stored tensor, the header's fields as strings) of a GGUF file, with the `gguf` package's
    GGUFReader (header only: its memory map is dropped here, nothing of the data is read).

    CheckpointError for a damaged file, a text model, a reshaped tensor, or a GGML type ComfyUI-GGUF does not
    dequantize in torch (its numpy fallback is far too slow to run per layer on a GPU).
    """
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path), "r")
    except Exception as err:  # the reader raises ValueError, IndexError, struct errors, ... for damage
        size = path.stat().st_size
        raise CheckpointError(
            f"{quoted(path)} is truncated or corrupt: the gguf package cannot read its header ({size} bytes; "
            f"{type(err).__name__}: {err}). Download or copy it again"
        ) from err
    fields = _fields(reader)
    arch = fields.get(ARCH, "")
    if arch in TEXT_ARCHS:
        raise CheckpointError(
            f"{quoted(path)} is a GGUF text encoder (architecture '{arch}'), not a diffusion model: load it with "
            f"ComfyUI-GGUF's CLIPLoader (GGUF) and pick a {_family_titles()} diffusion model here"
        )
    tensors: dict[str, StoredTensor] = {}
    end = 0
    for t in reader.tensors:
        qtype = t.tensor_type.name
        if ORIG_SHAPE + t.name in reader.fields:
            raise CheckpointError(
                f"{quoted(path)}: tensor '{t.name}' was reshaped by ComfyUI-GGUF's converter (an SD1/SDXL file); "
                f"{_family_titles()} files are never reshaped, so this is not one of them"
            )
        if qtype not in PLAIN_TYPES and qtype not in GGUF_BLOCKS:
            raise CheckpointError(
                f"{quoted(path)}: tensor '{t.name}' is stored as {qtype}; the pack reads the GGML types "
                f"ComfyUI-GGUF dequantizes on the GPU ({supported_types()}). {FIX}"
            )
        shape = tuple(int(v) for v in reversed(t.shape.tolist()))
        tensors[t.name] = StoredTensor(str(path), t.name, shape, qtype, int(t.data_offset))
        end = max(end, int(t.data_offset) + int(t.n_bytes))
    del reader  # closes the memory map
    if not tensors:
        raise CheckpointError(
            f"{quoted(path)} is a GGUF file without tensors ({len(fields)} header fields); it is damaged or holds no "
            "model. Download or copy it again"
        )
    if end > path.stat().st_size:
        raise CheckpointError(
            f"{quoted(path)} is truncated or corrupt: its header promises {end} bytes but the file has "
            f"{path.stat().st_size}. Download or copy it again"
        )
    return tensors, fields


__all__ = ["ARCH", "FIX", "ORIG_SHAPE", "PLAIN_TYPES", "TEXT_ARCHS", "read_gguf_header", "supported_types"]
