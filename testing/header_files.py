"""Checkpoints of a released model's size that take no disk: a real safetensors header, sparse data.

`plan --checkpoint` reads a file's header only, so a test of what it prices for FLUX.2 [dev] needs the
header of a 32-billion-parameter file, not its bytes: the header is written from the preset's stored
facts (backend/plan/facts.json, parameter shapes) through the family's key layout, with the dtypes a
test picks, and the file is extended to the size the header promises without writing it (a sparse file:
the filesystem stores no zeros).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

from ..backend.checkpoint.quant import COMFY_QUANT, WEIGHT_SCALE
from ..backend.dtypes import stored_dtype
from ..backend.family import get_family
from ..backend.plan.facts import decode, stored

DTypeOf = Callable[[str, tuple[int, ...]], str]


def _bytes(dtype: str) -> int:
    return {"U8": 1, "F32": 4}.get(dtype) or stored_dtype(dtype).bytes


def write_released_header(path: str | Path, family: str, preset: str, dtype_of: DTypeOf) -> str:
    """A BFL / ComfyUI single file of `family`'s `preset` whose tensors are stored as `dtype_of(key, shape)`
    says ("BF16", "F8_E4M3"); an fp8 weight gets ComfyUI's `weight_scale` and `comfy_quant` companions, as
    in a Comfy-Org fp8 mixed file. Returns the path."""
    fam = get_family(family)
    dims = fam.dims(fam.presets[preset])
    parameters = {name: shape for name, shape, _, _ in decode(stored()[family][preset]).parameters}
    entries: dict[str, dict[str, object]] = {}
    offset = 0

    def add(key: str, dtype: str, shape: tuple[int, ...]) -> None:
        nonlocal offset
        size = _bytes(dtype)
        for n in shape:
            size *= n
        entries[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size

    marker = json.dumps({"format": "float8_e4m3fn"}).encode()
    for key, shape in fam.keys.bfl_shapes(dims, parameters).items():
        dtype = dtype_of(key, shape)
        add(key, dtype, shape)
        if dtype.startswith("F8") and key.endswith(".weight"):
            layer = key.removesuffix(".weight")
            add(layer + WEIGHT_SCALE, "F32", ())
            add(layer + COMFY_QUANT, "U8", (len(marker),))
    header = json.dumps(entries).encode()
    header += b" " * (-len(header) % 8)  # safetensors aligns the data to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + offset)  # sparse: nothing written
    return str(path)


def fp8_blocks(blocks: tuple[str, ...]) -> DTypeOf:
    """`dtype_of` of a Comfy-Org fp8 mixed file: linear weights under `blocks` (BFL prefixes) fp8, else bf16."""
    return lambda key, shape: "F8_E4M3" if key.startswith(blocks) and len(shape) == 2 else "BF16"


def bf16(key: str, shape: tuple[int, ...]) -> str:
    return "BF16"


__all__ = ["bf16", "fp8_blocks", "write_released_header"]
