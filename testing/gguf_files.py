"""GGUF files of test models, written the way ComfyUI-GGUF's tools/convert.py writes them, with the `gguf`
package's GGUFWriter.

Per tensor, convert.py's rules: 1-D tensors and tensors of at most 1024 values F32, everything else the
file's type, F16 where a row is not a whole number of blocks (the quantizer's QuantError). Keys are the
family's BFL / ComfyUI names (`diffusers_to_bfl`), as ComfyUI-GGUF stores them.

Quantization: the `gguf` package's own `gguf.quants.quantize` where it has one (F16, Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1). It has none for the K-quants (0.19: dequantizers only; files with them come from llama.cpp's
C quantizer with ComfyUI-GGUF's lcpp.patch), so `quantize_k` below encodes Q4_K / Q5_K / Q6_K blocks in
numpy: a plain min/max fit per sub-block, not llama.cpp's error search. Only the block layout matters
for these tests (every decoder reads the same bytes); tests/test_gguf.py checks the `gguf` package's
dequantizers read these blocks back within each format's step.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..backend.checkpoint import diffusers_to_bfl
from ..backend.checkpoint.files import COMFY_PREFIX

QUANTIZATION_THRESHOLD = 1024  # convert.py: tensors this small stay F32
ARCH = {"flux1": "flux", "flux2": "flux", "qwen_image": "qwen_image"}  # general.architecture
QK_K = 256


def _round(x: np.ndarray) -> np.ndarray:
    return np.floor(x + 0.5)


def _fp16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _scales_6bit(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(super-block scale as float16, 6-bit codes [n, 8]) of non-negative per-sub-block values."""
    top = values.max(axis=1, keepdims=True)
    d = (top / 63).astype(np.float16).astype(np.float32)
    codes = np.where(d > 0, np.clip(_round(values / np.where(d > 0, d, 1)), 0, 63), 0).astype(np.uint8)
    return d, codes


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """The 12 bytes of 8 six-bit scales and mins (inverse of ggml's get_scale_min)."""
    n = sc.shape[0]
    out = np.zeros((n, 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    return out


def _q45_k(blocks: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K (bits=4) or Q5_K (bits=5) blocks: y = d * sc * q - dmin * m per sub-block of 32."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 8, 32)
    low = np.minimum(sub.min(axis=2), 0)
    step = (sub.max(axis=2) - low) / (2**bits - 1)
    d, sc = _scales_6bit(step)
    dmin, mn = _scales_6bit(-low)
    scale = (d * sc)[:, :, None]
    offset = (dmin * mn)[:, :, None]
    q = np.where(scale > 0, _round((sub + offset) / np.where(scale > 0, scale, 1)), 0)
    q = np.clip(q, 0, 2**bits - 1).astype(np.uint8)  # [n, 8, 32]
    ql = q & 0x0F
    qs = (ql[:, 0::2] | (ql[:, 1::2] << 4)).reshape(n, 128)  # byte c*32+i: sub-blocks 2c and 2c+1
    parts = [_fp16_bytes(d), _fp16_bytes(dmin), _pack_scales(sc, mn)]
    if bits == 5:
        high = (q >> 4) & 1  # [n, 8, 32]: bit b of byte i is sub-block b's value i
        parts.append((high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1).astype(np.uint8))
    parts.append(qs)
    return np.concatenate(parts, axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K blocks: y = d * scale * (q - 32) per sub-block of 16, int8 scales."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    step = np.abs(sub).max(axis=2) / 31
    d = (step.max(axis=1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
    scales = np.where(d > 0, np.clip(_round(step / np.where(d > 0, d, 1)), -128, 127), 0).astype(np.int8)
    scale = (d * scales)[:, :, None]
    q = np.where(scale != 0, _round(sub / np.where(scale != 0, scale, 1)), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(n, 256)
    v = np.arange(256)
    k, i = v // 32, v % 32
    ql = np.zeros((n, 128), dtype=np.uint8)
    qh = np.zeros((n, 64), dtype=np.uint8)
    for idx in range(256):  # ggml's interleaving (the inverse of ComfyUI-GGUF's dequantize_blocks_Q6_K)
        h, s, b = int(k[idx] // 4), int((k[idx] // 2) % 2), int((k[idx] % 2) * 32 + i[idx])
        ql[:, h * 64 + b] |= ((q[:, idx] & 0x0F) << (4 * s)).astype(np.uint8)
        qh[:, h * 32 + int(i[idx])] |= ((q[:, idx] >> 4) << (2 * int(k[idx] % 4))).astype(np.uint8)
    return np.concatenate([ql, qh, scales.view(np.uint8), _fp16_bytes(d)], axis=1)


K_QUANTS = {"Q4_K": lambda b: _q45_k(b, 4), "Q5_K": lambda b: _q45_k(b, 5), "Q6_K": _q6_k}


def quantize_k(data: np.ndarray, qtype: str) -> np.ndarray:
    """`data` [..., k * 256] as `qtype` K-quant blocks: uint8 [..., k * type_size] (gguf.quants' layout)."""
    rows = data.astype(np.float32).reshape(-1, data.shape[-1])
    blocks = K_QUANTS[qtype](rows.reshape(-1, QK_K))
    return blocks.reshape(*data.shape[:-1], -1)


def quantize(data: np.ndarray, qtype: str) -> tuple[np.ndarray, str]:
    """(stored data, GGML type name) of one tensor by convert.py's rules for a file of type `qtype`."""
    import gguf

    if data.ndim == 1 or data.size <= QUANTIZATION_THRESHOLD:
        return data.astype(np.float32), "F32"
    kind = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[kind][0]
    if data.shape[-1] % block:
        return data.astype(np.float16), "F16"  # convert.py's fallback on QuantError
    if qtype in K_QUANTS:
        return quantize_k(data, qtype), qtype
    return gguf.quants.quantize(data.astype(np.float32), kind), qtype


def write_gguf(
    tensors: Mapping[str, torch.Tensor], path: str | Path, qtype: str, arch: str = "flux", prefix: str = ""
) -> str:
    """Write BFL / ComfyUI `tensors` as a GGUF file of type `qtype` (e.g. "Q8_0", "Q4_K", "F16")."""
    import gguf

    writer = gguf.GGUFWriter(path=None, arch=arch)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, tensor in tensors.items():
        data, kind = quantize(tensor.detach().to(torch.float32).numpy(), qtype)
        writer.add_tensor(prefix + key, data, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file(path=str(path))
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def save_gguf(
    model_or_state: torch.nn.Module | Mapping[str, torch.Tensor],
    path: str | Path,
    qtype: str,
    family: str | None = None,
    prefix: bool = False,
) -> str:
    """A diffusers model (or state dict) of any family as a ComfyUI-GGUF file of type `qtype`."""
    from ..backend.family import family_of, get_family

    if isinstance(model_or_state, torch.nn.Module):
        family = family or family_of(model_or_state).name
        model_or_state = model_or_state.state_dict()
    bfl = diffusers_to_bfl(model_or_state, family)
    arch = ARCH[get_family(family).name] if family else "flux"
    return write_gguf(bfl, path, qtype, arch, COMFY_PREFIX if prefix else "")


def dequantized_state(path: str | Path) -> dict[str, Any]:
    """key -> float32 values of every tensor of a GGUF file, by the `gguf` package's numpy dequantizers."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    out = {}
    for t in reader.tensors:
        values = gguf.quants.dequantize(np.array(t.data), t.tensor_type)
        out[t.name] = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(
            tuple(int(v) for v in reversed(t.shape.tolist()))
        )
    return out


__all__ = ["K_QUANTS", "dequantized_state", "quantize", "quantize_k", "save_gguf", "write_gguf"]
