"""GGUF's quantized blocks dequantized in torch, with ComfyUI-GGUF's formulas: what a GGUF weight is at call time.

Why a port: the field has no torch-side dequantizer but ComfyUI-GGUF's own `dequant.py` (the `gguf`
package's are numpy, run on the CPU, and compute in float32, where ComfyUI-GGUF computes in float16), and
the pack's backend never imports a ComfyUI custom node. The formulas below are ComfyUI-GGUF's
(github.com/city96/ComfyUI-GGUF, dequant.py at 795e451, (c) City96, Apache-2.0), kept operation for
operation so that the numbers are the same: with its default `dequant_dtype` (None) each block is computed
in float16 (the block scales' dtype: `fp16 * int8` stays float16 under torch's promotion) and the result is
then cast to the compute dtype, as `dequantize_tensor(tensor, dtype)` does. The comfy tier compares this
module with ComfyUI-GGUF's own dequant.py bit for bit; tests/test_gguf.py with the `gguf` package's numpy
dequantizers (equal after float16 rounding for the legacy quants, within float16 steps for the K-quants).

A rank's shard of a row-parallel weight holds some whole blocks of every row: dequantizing those bytes
gives exactly those columns, since every block is independent of its neighbours.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..dtypes import GGUF_BLOCKS

QK_K = 256
K_SCALE_SIZE = 12
# ComfyUI-GGUF's IQ4 lookup table (dequant.py KVALUES).
KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

Blocks = Callable[[torch.Tensor, int, int], torch.Tensor]


def _to_uint32(x: torch.Tensor) -> torch.Tensor:
    x = x.view(torch.uint8).to(torch.int32)
    return (x[:, 0] | x[:, 1] << 8 | x[:, 2] << 16 | x[:, 3] << 24).unsqueeze(1)


def _to_uint16(x: torch.Tensor) -> torch.Tensor:
    x = x.view(torch.uint8).to(torch.int32)
    return (x[:, 0] | x[:, 1] << 8).unsqueeze(1)


def _split(blocks: torch.Tensor, *sizes: int) -> tuple[torch.Tensor, ...]:
    return torch.split(blocks, [*sizes, blocks.shape[1] - sum(sizes)], dim=1)


def _shifts(values: list[int], shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, device=device, dtype=torch.uint8).reshape(shape)


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.float16)


def _q8_0(blocks: torch.Tensor, block_size: int, type_size: int) -> torch.Tensor:
    d, x = _split(blocks, 2)
    return _fp16(d) * x.view(torch.int8)


def _q5_1(blocks: torch.Tensor, block_size: int, type_size: int) -> torch.Tensor:
    n = blocks.shape[0]
    d, m, qh, qs = _split(blocks, 2, 2, 4)
    d, m, qh = _fp16(d), _fp16(m), _to_uint32(qh)
    qh = qh.reshape((n, 1)) >> torch.arange(32, device=d.device, dtype=torch.int32).reshape(1, 32)
    ql = qs.reshape((n, -1, 1, block_size // 2)) >> _shifts([0, 4], (1, 1, 2, 1), d.device)
    qh = (qh & 1).to(torch.uint8)
    ql = (ql & 0x0F).reshape((n, -1))
    return (d * (ql | (qh << 4))) + m


def _q5_0(blocks: torch.Tensor, block_size: int, type_size: int) -> torch.Tensor:
    n = blocks.shape[0]
    d, qh, qs = _split(blocks, 2, 4)
    d, qh = _fp16(d), _to_uint32(qh)
    qh = qh.reshape(n, 1) >> torch.arange(32, device=d.device, dtype=torch.int32).reshape(1, 32)
    ql = qs.reshape(n, -1, 1, block_size // 2) >> _shifts([0, 4], (1, 1, 2, 1), d.device)
    qh = (qh & 1).to(torch.uint8)
    ql = (ql & 0x0F).reshape(n, -1)
    return d * ((ql | (qh << 4)).to(torch.int8) - 16)


def _q4_1(blocks: torch.Tensor, block_size: int, type_size: int) -> torch.Tensor:
    n = blocks.shape[0]
    d, m, qs = _split(blocks, 2, 2)
    d, m = _fp16(d), _fp16(m)
    qs = qs.reshape((n, -1, 1, block_size // 2)) >> _shifts([0, 4], (1, 1, 2, 1), d.device)
    return (d * (qs & 0x0F).reshape(n, -1)) + m


def _q4_0(blocks: torch.Tensor, block_size: int, type_size: int) -> torch.Tensor:
    n = blocks.shape[0]
    d, qs = _split(blocks, 2)
    d = _fp16(d)
    qs = qs.reshape((n, -1, 1, block_size // 2)) >> _shifts([0, 4], (1, 1, 2, 1), d.device)
    return d * ((qs & 0x0F).reshape((n, -1)).to(torch.int8) - 8)


def _scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = scales.shape[0]
    scales = scales.view(torch.uint8).reshape((n, 3, 4))
    d, m, m_d = torch.split(scales, scales.shape[-2] // 3, dim=-2)
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.reshape((n, 8)), mn.reshape((n, 8))


def _q6_k(blocks: torch.Tensor, block_size: int, type_size: int) -> torch.Tensor:
    n = blocks.shape[0]
    ql, qh, scales, d = _split(blocks, QK_K // 2, QK_K // 4, QK_K // 16)
    d = (_fp16(d) * scales.view(torch.int8)).reshape((n, QK_K // 16, 1))
    ql = ql.reshape((n, -1, 1, 64)) >> _shifts([0, 4], (1, 1, 2, 1), d.device)
    ql = (ql & 0x0F).reshape((n, -1, 32))
    qh = qh.reshape((n, -1, 1, 32)) >> _shifts([0, 2, 4, 6], (1, 1, 4, 1), d.device)
    qh = (qh & 0x03).reshape((n, -1, 32))
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape((n, QK_K // 16, -1))
    return (d * q).reshape((n, QK_K))


def _q5_k(blocks: torch.Tensor, block_size: int, type_size: int) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin, scales, qh, qs = _split(blocks, 2, 2, K_SCALE_SIZE, QK_K // 8)
    sc, m = _scale_min(scales)
    d = (_fp16(d) * sc).reshape((n, -1, 1))
    dm = (_fp16(dmin) * m).reshape((n, -1, 1))
    ql = qs.reshape((n, -1, 1, 32)) >> _shifts([0, 4], (1, 1, 2, 1), d.device)
    qh = qh.reshape((n, -1, 1, 32)) >> _shifts(list(range(8)), (1, 1, 8, 1), d.device)
    ql = (ql & 0x0F).reshape((n, -1, 32))
    qh = (qh & 0x01).reshape((n, -1, 32))
    return (d * (ql | (qh << 4)) - dm).reshape((n, QK_K))


def _q4_k(blocks: torch.Tensor, block_size: int, type_size: int) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin, scales, qs = _split(blocks, 2, 2, K_SCALE_SIZE)
    sc, m = _scale_min(scales)
    d = (_fp16(d) * sc).reshape((n, -1, 1))
    dm = (_fp16(dmin) * m).reshape((n, -1, 1))
    qs = qs.reshape((n, -1, 1, 32)) >> _shifts([0, 4], (1, 1, 2, 1), d.device)
    qs = (qs & 0x0F).reshape((n, -1, 32))
    return (d * qs - dm).reshape((n, QK_K))


def _q3_k(blocks: torch.Tensor, block_size: int, type_size: int) -> torch.Tensor:
    n = blocks.shape[0]
    hmask, qs, scales, d = _split(blocks, QK_K // 8, QK_K // 4, 12)
    d = _fp16(d)
    lscales, hscales = scales[:, :8], scales[:, 8:]
    lscales = (lscales.reshape((n, 1, 8)) >> _shifts([0, 4], (1, 2, 1), d.device)).reshape((n, 16))
    hscales = (hscales.reshape((n, 1, 4)) >> _shifts([0, 2, 4, 6], (1, 4, 1), d.device)).reshape((n, 16))
    scales = ((lscales & 0x0F) | ((hscales & 0x03) << 4)).to(torch.int8) - 32
    dl = (d * scales).reshape((n, 16, 1))
    ql = qs.reshape((n, -1, 1, 32)) >> _shifts([0, 2, 4, 6], (1, 1, 4, 1), d.device)
    qh = hmask.reshape(n, -1, 1, 32) >> _shifts(list(range(8)), (1, 1, 8, 1), d.device)
    ql = ql.reshape((n, 16, QK_K // 16)) & 3
    qh = (qh.reshape((n, 16, QK_K // 16)) & 1) ^ 1
    q = ql.to(torch.int8) - (qh << 2).to(torch.int8)
    return (dl * q).reshape((n, QK_K))


def _q2_k(blocks: torch.Tensor, block_size: int, type_size: int) -> torch.Tensor:
    n = blocks.shape[0]
    scales, qs, d, dmin = _split(blocks, QK_K // 16, QK_K // 4, 2)
    d, dmin = _fp16(d), _fp16(dmin)
    dl = (d * (scales & 0xF)).reshape((n, QK_K // 16, 1))
    ml = (dmin * (scales >> 4)).reshape((n, QK_K // 16, 1))
    qs = (qs.reshape((n, -1, 1, 32)) >> _shifts([0, 2, 4, 6], (1, 1, 4, 1), d.device)) & 3
    return (dl * qs.reshape((n, QK_K // 16, 16)) - ml).reshape((n, -1))


def _iq4_nl(blocks: torch.Tensor, block_size: int, type_size: int) -> torch.Tensor:
    n = blocks.shape[0]
    d, qs = _split(blocks, 2)
    d = _fp16(d)
    qs = qs.reshape((n, -1, 1, block_size // 2)) >> _shifts([0, 4], (1, 1, 2, 1), d.device)
    qs = (qs & 0x0F).reshape((n, -1, 1)).to(torch.int64)
    kvalues = torch.tensor(KVALUES, dtype=torch.int8, device=qs.device).expand(*qs.shape[:-1], 16)
    return d * torch.gather(kvalues, dim=-1, index=qs).reshape((n, -1))


def _iq4_xs(blocks: torch.Tensor, block_size: int, type_size: int) -> torch.Tensor:
    n = blocks.shape[0]
    d, scales_h, scales_l, qs = _split(blocks, 2, 2, QK_K // 64)
    d, scales_h = _fp16(d), _to_uint16(scales_h)
    shift_a = _shifts([0, 4], (1, 1, 2), d.device)
    shift_b = _shifts([2 * i for i in range(QK_K // 32)], (1, -1, 1), d.device)
    scales_l = (scales_l.reshape((n, -1, 1)) >> shift_a).reshape((n, -1)) & 0x0F
    scales_h = (scales_h.reshape((n, -1, 1)) >> shift_b).reshape((n, -1)).to(torch.uint8) & 0x03
    scales = (scales_l | (scales_h << 4)).to(torch.int8) - 32
    dl = (d * scales).reshape((n, -1, 1))
    qs = qs.reshape((n, -1, 1, 16)) >> shift_a.reshape((1, 1, 2, 1))
    qs = qs.reshape((n, -1, 32, 1)) & 0x0F
    kvalues = torch.tensor(KVALUES, dtype=torch.int8, device=qs.device).expand(*qs.shape[:-1], 16)
    return (dl * torch.gather(kvalues, dim=-1, index=qs.to(torch.int64)).reshape((n, -1, 32))).reshape(
        (n, -1)
    )


# GGML type name -> (values per block, bytes per block, the block formula): the types ComfyUI-GGUF
# dequantizes in torch (its `dequantize_functions`, less BF16, which the loader reads as a plain dtype),
# with ggml's sizes (dtypes.GGUF_BLOCKS).
_FORMULAS: dict[str, Blocks] = {
    "Q8_0": _q8_0,
    "Q5_1": _q5_1,
    "Q5_0": _q5_0,
    "Q4_1": _q4_1,
    "Q4_0": _q4_0,
    "Q6_K": _q6_k,
    "Q5_K": _q5_k,
    "Q4_K": _q4_k,
    "Q3_K": _q3_k,
    "Q2_K": _q2_k,
    "IQ4_NL": _iq4_nl,
    "IQ4_XS": _iq4_xs,
}
QUANTIZED: dict[str, tuple[int, int, Blocks]] = {
    name: (*GGUF_BLOCKS[name], formula) for name, formula in _FORMULAS.items()
}


# Byte range of each block's float16 scales (d, and dmin / m where the format has one), as the formulas
# above split a block: the only fields of a block that can hold NaN or inf (the rest are integers).
SCALE_BYTES: dict[str, tuple[int, int]] = {
    "Q8_0": (0, 2),
    "Q5_1": (0, 4),
    "Q5_0": (0, 2),
    "Q4_1": (0, 4),
    "Q4_0": (0, 2),
    "Q6_K": (208, 210),
    "Q5_K": (0, 4),
    "Q4_K": (0, 4),
    "Q3_K": (108, 110),
    "Q2_K": (80, 84),
    "IQ4_NL": (0, 2),
    "IQ4_XS": (0, 2),
}


def block_scales(data: torch.Tensor, qtype: str) -> torch.Tensor:
    """The float16 scales of every block of the uint8 blocks `data`: [blocks, 1 or 2]."""
    size = QUANTIZED[qtype][1]
    start, stop = SCALE_BYTES[qtype]
    blocks = data.reshape(-1, size)
    return blocks[:, start:stop].contiguous().view(torch.float16)


def is_quantized(qtype: str) -> bool:
    """Whether GGML type `qtype` is one of the block formats above (not F32/F16/BF16)."""
    return qtype in QUANTIZED


def row_bytes(qtype: str, values: int) -> int:
    """Bytes of `values` consecutive values of one row (whole blocks)."""
    block, size, _ = QUANTIZED[qtype]
    return values // block * size


def byte_shape(shape: tuple[int, ...], qtype: str) -> tuple[int, ...]:
    """The uint8 shape holding a tensor of logical `shape` in `qtype` (rows x bytes per row)."""
    return (*shape[:-1], row_bytes(qtype, shape[-1]))


def dequantize(data: torch.Tensor, qtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The float16 values of the uint8 blocks `data` (any shape whose rows are whole blocks) as a tensor of
    logical `shape`: ComfyUI-GGUF's `dequantize(data, qtype, oshape, dtype=None)`."""
    block, size, formula = QUANTIZED[qtype]
    blocks = data.reshape((-1, data.shape[-1])).view(torch.uint8)
    blocks = blocks.reshape((blocks.numel() // size, size))
    return formula(blocks, block, size).reshape(shape)


__all__ = [
    "QUANTIZED",
    "SCALE_BYTES",
    "block_scales",
    "byte_shape",
    "dequantize",
    "is_quantized",
    "row_bytes",
]
