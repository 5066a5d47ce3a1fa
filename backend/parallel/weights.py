"""fp8 and GGUF weights held resident and upcast layer by layer: weight dtype separate from compute dtype.

Why: an fp8 FLUX.1-dev is 11.9 GB; upcast to bf16 at load it is 23.8 GB, so 2 x 12 GB cards cannot hold
it even when the TP shards of the fp8 file would fit. Keeping the nn.Linear weights in fp8 (1 byte) and
casting each one to the compute dtype only for its own matmul halves the resident bytes; the cast
copy lives for one layer.

Why the result equals upcast-at-load bit for bit: every fp8 value (e4m3fn and e5m2) is exactly
representable in bf16, fp16 and fp32 (fewer mantissa bits, a narrower exponent range), so the weight a
layer multiplies by is the very tensor an upcast-at-load model holds, and the same kernel runs on it.
ComfyUI's "scaled fp8" files store `weight` (fp8) with a scalar `scale_weight`; the layer's weight is
then `weight.to(compute) * scale_weight.to(compute)`, ComfyUI's `scaled_fp8_ops` arithmetic (which
scales the input instead when the input is the larger tensor; this always scales the weight, so every
rank and every sequence length rounds alike).

How: like ComfyUI's `comfy.ops.manual_cast`, at the weight access rather than with a hook, because not
every use of a weight goes through its module's forward: `linear_weight(module, dtype)` is the one
place a weight is read for a matmul. Plain nn.Linear modules become `UpcastLinear` (same parameters,
same hooks, a forward that calls it); the tensor-parallel `RowParallelLinear` and the AdaLN
`gather_modulation` call it themselves. Biases and norm scales stay in the compute dtype (a few MB).
diffusers' context-parallel hooks wrap a module's forward at the time they are registered, so the
class swap happens while loading, before `apply_context_parallel`.

GGUF weights take the same path: the module holds the quantized blocks (uint8, its rank's rows or whole
blocks of every row) and `linear_weight` dequantizes them with ComfyUI-GGUF's formulas (ggml.py) for each
matmul, then applies the module's LoRA patches to the result (`weight_patch`, set by checkpoint/lora/),
as ComfyUI-GGUF patches the dequantized weight at call time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..dtypes import FP8_DTYPES
from .ggml import dequantize

_FP8: tuple[torch.dtype, ...] = tuple(d.torch for d in FP8_DTYPES)
# Attribute of a model that keeps fp8 weights: the dtype its layers compute in.
COMPUTE_DTYPE_ATTR = "_rp_compute_dtype"


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in _FP8


def linear_weight(module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """`module.weight` as `dtype` for one matmul: itself when it already is, else the upcast copy
    (times the module's `scale_weight` when the fp8 file stored one). A GGUF weight held quantized
    (`hold_quantized`) is dequantized, and its LoRA patches applied to the result (`weight_patch`), as
    ComfyUI-GGUF's GGMLLayer.get_weight does."""
    qtype = getattr(module, "ggml_type", None)
    if qtype is not None:
        weight = dequantize(module.weight, qtype, module.ggml_shape).to(dtype)
        patch = getattr(module, "weight_patch", None)
        return weight if patch is None else patch(weight)
    weight = module.weight
    if weight.dtype == dtype:
        return weight
    weight = weight.to(dtype)
    scale = getattr(module, "scale_weight", None)
    return weight if scale is None else weight * scale.to(dtype)


def layer_dtype(module: nn.Module) -> torch.dtype:
    """The dtype a linear layer computes in: its weight's, or the compute dtype recorded for fp8."""
    return getattr(module, "compute_dtype", None) or module.weight.dtype


def hold_quantized(module: nn.Module, qtype: str | None, shape: tuple[int, ...] = ()) -> None:
    """Mark `module.weight` as the raw blocks of a GGUF weight of GGML type `qtype` and logical `shape`
    (None: a plain weight again); `keep_fp8_resident` then makes the module dequantize it per call."""
    module.ggml_type, module.ggml_shape = qtype, tuple(shape)
    if qtype is None:
        module.weight_patch = None


def is_held_quantized(module: nn.Module) -> bool:
    return getattr(module, "ggml_type", None) is not None


class UpcastLinear(nn.Linear):
    """An nn.Linear whose weight may be held in fp8: cast to the input's dtype for the matmul only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, linear_weight(self, x.dtype), self.bias)


def keep_fp8_resident(model: nn.Module, compute: torch.dtype) -> int:
    """Make every linear layer of `model` that holds an fp8 weight, or a GGUF weight's quantized blocks
    (`hold_quantized`), compute in `compute`; returns how many.

    Call after the weights are in place and before context-parallel hooks are registered. Raises
    RuntimeError when a parameter that is not a linear weight is fp8 or quantized (the loader never does
    that: only `linear_weight` knows how to upcast).
    """
    count = 0
    for name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            if not is_fp8(param.dtype) and not (pname == "weight" and is_held_quantized(module)):
                continue
            if not isinstance(module, nn.Linear) or pname != "weight":
                raise RuntimeError(f"{name}.{pname} is {param.dtype}; only linear weights may stay fp8")
            module.compute_dtype = compute
            if type(module) is nn.Linear:
                module.__class__ = UpcastLinear
            count += 1
    setattr(model, COMPUTE_DTYPE_ATTR, compute)
    return count


def compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype `model` computes in (inputs are cast to it): recorded by the loader, else its first
    parameter's (a model built in one dtype)."""
    recorded = getattr(model, COMPUTE_DTYPE_ATTR, None)
    return recorded if recorded is not None else next(model.parameters()).dtype


def resident_bytes_by_dtype(model: nn.Module) -> dict[str, int]:
    """Parameter bytes this process holds, per dtype name (e.g. {'float8_e4m3fn': ..., 'bfloat16': ...});
    a GGUF weight's blocks under its GGML type ('Q4_K'), not their uint8 container."""
    out: dict[str, int] = {}
    for module in model.modules():
        for pname, p in module.named_parameters(recurse=False):
            quantized = pname == "weight" and is_held_quantized(module)
            name = module.ggml_type if quantized else str(p.dtype).removeprefix("torch.")
            out[name] = out.get(name, 0) + p.numel() * p.element_size()
    return out


__all__ = [
    "UpcastLinear",
    "compute_dtype",
    "hold_quantized",
    "is_fp8",
    "is_held_quantized",
    "keep_fp8_resident",
    "layer_dtype",
    "linear_weight",
    "resident_bytes_by_dtype",
]
