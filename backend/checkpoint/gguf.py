"""GGUF diffusion models (ComfyUI-GGUF's files): headers read with the `gguf` package, a rank's blocks read
from the file's memory map, and the check that a tensor-parallel split keeps every quantization block whole.

What a GGUF diffusion model is (ComfyUI-GGUF's loader.py and tools/convert.py): the transformer's tensors
under ComfyUI's own key names (BFL's for FLUX.1 and FLUX.2, ComfyUI's for Qwen-Image; sometimes under
`model.diffusion_model.`), each stored in its own GGML type: the linear weights quantized (Q8_0, Q4_K, ...),
biases, norms and tiny tensors F32, what a quantizer cannot split F16 or BF16. GGUF lists a shape
fastest-varying dimension first, so a [out, in] weight appears as (in, out): reversed here, as ComfyUI-GGUF
does. A quantized row of `in` values is `in / block` blocks of a fixed byte size, independent of each other.

So a rank's shard is whole rows (column-parallel: the rows of its output features, also the row ranges of a
fused qkv / linear1) or, for row-parallel layers, the same whole blocks of every row: a split inside a block
is refused before any rank runs (`check_block_splits`). The bytes stay quantized on the device and are
dequantized layer by layer at call time (parallel/ggml.py, parallel/weights.py), as ComfyUI-GGUF does.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..config import ConfigError, validate_tp_degree
from ..parallel.ggml import QUANTIZED, block_scales, dequantize, is_quantized, row_bytes
from ..runtime.redact import quoted
from .files import CheckpointError, StoredTensor, full_shape, numel
from .gguf_header import read_gguf_header, supported_types  # torch-free: `plan` reads GGUF headers

if TYPE_CHECKING:
    from .info import CheckpointInfo

# GGML types read as plain tensors: their torch dtype (ComfyUI-GGUF casts them to the compute dtype).
PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_NUMPY = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}  # numpy has no bfloat16: its bits


def tensor_bytes(stored: StoredTensor) -> int:
    """Bytes a GGUF tensor takes in its file."""
    if is_quantized(stored.dtype):
        return math.prod(stored.shape[:-1]) * row_bytes(stored.dtype, stored.shape[-1])
    return numel(stored.shape) * PLAIN[stored.dtype].itemsize


def torch_name(qtype: str) -> str:
    """How messages and `CheckpointInfo.stored_dtypes` name a GGML type: torch's name for the plain ones."""
    return str(PLAIN[qtype]).removeprefix("torch.") if qtype in PLAIN else qtype


# --------------------------------------------------------------------------------------------------
# Reading a rank's pieces


@contextlib.contextmanager
def _mapped(stored: StoredTensor) -> Iterator[np.ndarray]:
    """The tensor's bytes as a numpy memory map of its own: [rows, bytes per row] for a quantized tensor,
    its shape for a plain one. Mapped per tensor, so the touched pages of one tensor at a time count as
    resident memory; copy-on-write, so numpy hands out writable views (torch warns on read-only ones)."""
    rows = math.prod(stored.shape[:-1]) if len(stored.shape) > 1 else 1
    if is_quantized(stored.dtype):
        shape: tuple[int, ...] = (rows, row_bytes(stored.dtype, stored.shape[-1]))
        kind: Any = np.uint8
    else:
        shape, kind = stored.shape, _NUMPY[stored.dtype]
    mapped = np.memmap(stored.file, dtype=kind, mode="c", offset=stored.offset or 0, shape=shape)
    try:
        yield mapped
    finally:
        mapped._mmap.close()  # type: ignore[attr-defined]


def _tensor(array: np.ndarray, qtype: str) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = torch.from_numpy(array)
    return out.view(torch.bfloat16) if qtype == "BF16" else out


def read_gguf(
    stored: StoredTensor,
    rows: tuple[tuple[int, int], ...],
    cols: tuple[tuple[int, int], ...] | None,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """The `rows` x `cols` (None: all) of a GGUF tensor on `device`: its raw blocks when `dtype` is uint8
    (a quantized weight held as such), else its values in `dtype`, dequantized with ComfyUI-GGUF's formulas
    (parallel/ggml.py) and cast, as its `dequantize_tensor(tensor, dtype)`."""
    qtype = stored.dtype
    quantized = is_quantized(qtype)
    raw = dtype == torch.uint8
    if raw and not quantized:
        raise RuntimeError(f"{stored.key}: a {qtype} tensor is never held as raw blocks")
    if len(stored.shape) == 1:  # a vector: read whole, then sliced (biases and norms: a few KB)
        with _mapped(stored) as mapped:
            whole = _tensor(np.array(mapped).reshape(-1 if not quantized else (1, -1)), qtype)
        if quantized:
            whole = dequantize(whole, qtype, stored.shape)
        return torch.cat([whole[a:b] for a, b in rows]).to(device, dtype)
    width = stored.shape[-1]
    ranges = cols if cols is not None else ((0, width),)
    n_rows = sum(b - a for a, b in rows)
    n_cols = sum(d - c for c, d in ranges)
    shape = (n_rows, row_bytes(qtype, n_cols)) if raw else (n_rows, n_cols, *stored.shape[2:])
    out = torch.empty(shape, dtype=dtype, device=device)
    with _mapped(stored) as mapped:
        row = 0
        for a, b in rows:
            col = 0
            for c, d in ranges:
                if quantized:
                    piece = _tensor(mapped[a:b, row_bytes(qtype, c) : row_bytes(qtype, d)], qtype)
                    if raw:
                        width_bytes = piece.shape[1]
                        out[row : row + b - a, col : col + width_bytes].copy_(piece)
                        col += width_bytes
                        continue
                    piece = dequantize(piece.to(device), qtype, (b - a, d - c))
                else:
                    piece = _tensor(mapped[a:b, c:d] if cols is not None else mapped[a:b], qtype)
                out[row : row + b - a, col : col + d - c].copy_(piece)
                col += d - c
            row += b - a
    return out


def checked_values(stored: StoredTensor, tensor: torch.Tensor) -> torch.Tensor:
    """What the NaN / inf check reads of `tensor` read from `stored`: the blocks' float16 scales for raw
    blocks (their quants are integers: a block holds NaN or inf only through its scales; dequantizing
    the whole tensor for the check would hold a second, larger copy of it), else the tensor itself."""
    if tensor.dtype == torch.uint8 and is_quantized(stored.dtype):
        return block_scales(tensor, stored.dtype)
    return tensor


# --------------------------------------------------------------------------------------------------
# Tensor-parallel splits on block boundaries


def quantized_sources(info: CheckpointInfo) -> dict[str, StoredTensor]:
    """diffusers parameter -> its stored tensor, for the parameters stored in a quantized GGML type."""
    return {
        name: s for name, (s, _) in info.sources.items() if s.offset is not None and is_quantized(s.dtype)
    }


def _misplaced(info: CheckpointInfo, tp: int, resolved: dict[str, Any]) -> tuple[StoredTensor, int] | None:
    """The first quantized tensor whose rows `tp` would split inside a block, and where; None when none."""
    from ..parallel.tensor import parameter_pieces

    for name, stored in sorted(quantized_sources(info).items()):
        block = QUANTIZED[stored.dtype][0]
        for rank in range(tp):
            pieces = parameter_pieces(
                resolved, name, full_shape(stored, info.sources[name][1]), rank, tp, info.dims
            )
            if pieces is None or pieces.dim == 0:
                continue
            for edge in (e for r in pieces.ranges for e in r):
                if edge % block:
                    return stored, edge
    return None


def check_block_splits(info: CheckpointInfo, tp: int, resolved: dict[str, Any] | None = None) -> None:
    """CheckpointError unless tensor parallelism of degree `tp` leaves every quantized row split at block
    boundaries (each rank holds whole blocks), naming the tensor and the degrees that would. `resolved`:
    the family's plan resolved on its model (`resolve_plan`), when the caller has it (the loader does);
    else built here on the meta device."""
    if tp == 1 or not quantized_sources(info):
        return
    if resolved is None:
        family = info.model_family
        resolved = family.tp.resolve(family.build(info.config, device="meta"))
    found = _misplaced(info, tp, resolved)
    if found is None:
        return
    stored, edge = found
    block = QUANTIZED[stored.dtype][0]
    works = []
    for degree in range(2, info.dims.heads + 1):
        try:
            validate_tp_degree(degree, info.dims)
        except ConfigError:
            continue
        if _misplaced(info, degree, resolved) is None:
            works.append(str(degree))
    use = (
        f"use tp {', '.join(works)}"
        if works
        else "no tensor-parallel degree keeps its blocks whole: use context parallelism (ring / ulysses)"
    )
    raise CheckpointError(
        f"{quoted(info.path)}: tp_degree={tp} would split the rows of tensor '{stored.key}' ({stored.dtype}, blocks "
        f"of {block} values, {stored.shape[-1]} values per row) at value {edge}, inside a quantization "
        f"block; each rank must hold whole blocks. {use[0].upper() + use[1:]}, or a file with smaller blocks "
        "(Q8_0, Q4_0: 32 values)"
    )


__all__ = [
    "PLAIN",
    "check_block_splits",
    "checked_values",
    "quantized_sources",
    "read_gguf",
    "read_gguf_header",
    "supported_types",
    "tensor_bytes",
    "torch_name",
]
