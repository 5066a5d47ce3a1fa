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


def write_released_gguf_header(path: str | Path, family: str, preset: str, type_of: DTypeOf) -> str:
    """A ComfyUI-GGUF file of `family`'s `preset` whose tensors are stored as `type_of(key, shape)` says
    ("Q4_K", "Q6_K", "F16", "F32"): a real GGUF header (the `gguf` package's writer, as ComfyUI-GGUF's
    convert.py writes it) and data of the size it promises, not written (sparse). Returns the path."""
    import gguf
    import numpy as np

    from ..backend.dtypes import GGUF_BLOCKS
    from .gguf_files import ARCH

    fam = get_family(family)
    dims = fam.dims(fam.presets[preset])
    parameters = {name: shape for name, shape, _, _ in decode(stored()[family][preset]).parameters}
    writer = gguf.GGUFWriter(path=None, arch=ARCH[fam.name])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    sizes = []
    for key, shape in fam.keys.bfl_shapes(dims, parameters).items():
        kind = type_of(key, shape)
        count = 1
        for n in shape:
            count *= n
        if kind in GGUF_BLOCKS:
            block, size = GGUF_BLOCKS[kind]
            assert shape[-1] % block == 0, (key, shape, kind)
            nbytes, raw = count // block * size, gguf.GGMLQuantizationType[kind]
            writer.add_tensor_info(key, shape, np.dtype(np.float32), nbytes, raw_dtype=raw)
        else:
            numpy_dtype = {"F16": np.float16, "F32": np.float32}[kind]
            nbytes = count * np.dtype(numpy_dtype).itemsize
            writer.add_tensor_info(key, shape, np.dtype(numpy_dtype), nbytes)
        sizes.append(gguf.GGUFWriter.ggml_pad(nbytes, writer.data_alignment))
    writer.write_header_to_file(path=str(path))
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    f = writer.fout[0]
    start = gguf.GGUFWriter.ggml_pad(f.tell(), writer.data_alignment)
    f.truncate(start + sum(sizes))  # sparse: nothing written
    f.close()
    return str(path)


def gguf_mixed(ends: tuple[str, ...], special: str, rest: str) -> DTypeOf:
    """`type_of` of a mixed GGUF file as llama.cpp-style quantizers write them (a Q4_K_M keeps some layers in
    Q6_K): the weights of the modules ending in `ends` (BFL names: "img_attn.proj", "linear2", ...) in
    `special`, the other weights whose rows are whole 256-value blocks in `rest`, the narrow ones in F16 (the
    writer's fallback) and 1-D tensors in F32."""
    suffixes = tuple(f"{end}.weight" for end in ends)

    def type_of(key: str, shape: tuple[int, ...]) -> str:
        if len(shape) != 2:
            return "F32"
        if shape[-1] % 256:
            return "F16"
        return special if key.endswith(suffixes) else rest

    return type_of


def fp8_blocks(blocks: tuple[str, ...]) -> DTypeOf:
    """`dtype_of` of a Comfy-Org fp8 mixed file: linear weights under `blocks` (BFL prefixes) fp8, else bf16."""
    return lambda key, shape: "F8_E4M3" if key.startswith(blocks) and len(shape) == 2 else "BF16"


def bf16(key: str, shape: tuple[int, ...]) -> str:
    return "BF16"


__all__ = ["bf16", "fp8_blocks", "gguf_mixed", "write_released_gguf_header", "write_released_header"]
