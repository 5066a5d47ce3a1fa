"""The one table of dtypes the pack knows: compute, fp8 weight, stored (safetensors) and wire dtypes.

Every other module asks this table instead of keeping its own: the planner (bytes per element, torch-free
so that the client plans before torch is needed), the loader (safetensors names, which stored dtypes it
reads, the fp8 weight formats), the fp8 layers, ComfyUI's quantized-file formats and the wire. Torch is
looked up lazily (`DType.torch`), so importing this module costs nothing.

Names: `name` is torch's attribute ("bfloat16", "float8_e4m3fn"), which is also how messages, JSON and
ComfyUI's quantization metadata ("format": "float8_e4m3fn") spell it; `short` is the other name users
pass ("bf16" for a compute dtype; ComfyUI's UNETLoader names "fp8_e4m3fn" for the fp8 weight dtypes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DType:
    """One dtype: torch's name, bytes per element, safetensors' name and its role in the pack."""

    name: str  # torch attribute, e.g. "bfloat16"
    bytes: int
    safetensors: str  # the dtype string of a safetensors header, e.g. "BF16"
    short: str | None = None  # the other name users pass: "bf16", or ComfyUI's "fp8_e4m3fn"
    compute: bool = False  # activations and weights may compute in it
    fp8: bool = False  # an fp8 weight format: held resident at 1 byte, upcast per layer

    @property
    def torch(self) -> Any:
        """The torch dtype (torch is imported here, on first use)."""
        import torch

        return getattr(torch, self.name)

    @property
    def loadable(self) -> bool:
        """Whether the checkpoint loader reads tensors stored in this dtype."""
        return self.compute or self.fp8


# Order matters: the compute dtypes come first, in the order messages list them ("bfloat16, float16,
# float32"), then the fp8 formats; the loader reads exactly these five. The rest only cross the wire.
DTYPES: tuple[DType, ...] = (
    DType("bfloat16", 2, "BF16", "bf16", compute=True),
    DType("float16", 2, "F16", "fp16", compute=True),
    DType("float32", 4, "F32", "fp32", compute=True),
    DType("float8_e4m3fn", 1, "F8_E4M3", "fp8_e4m3fn", fp8=True),
    DType("float8_e5m2", 1, "F8_E5M2", "fp8_e5m2", fp8=True),
    DType("float64", 8, "F64"),
    DType("int64", 8, "I64"),
    DType("int32", 4, "I32"),
    DType("int16", 2, "I16"),
    DType("int8", 1, "I8"),
    DType("uint8", 1, "U8"),
    DType("bool", 1, "BOOL"),
)

COMPUTE_DTYPES: tuple[DType, ...] = tuple(d for d in DTYPES if d.compute)
FP8_DTYPES: tuple[DType, ...] = tuple(d for d in DTYPES if d.fp8)
LOADABLE_DTYPES: tuple[DType, ...] = tuple(d for d in DTYPES if d.loadable)

# How the nn.Linear weights (>99.9 % of FLUX's bytes) are held resident, by name; fp8 weights are upcast
# layer by layer at compute time (parallel/weights.py); biases and norm scales always stay in the compute
# dtype.
# "default": the checkpoint's own fp8 weights stay fp8, everything else is held in the compute dtype —
#            ComfyUI's UNETLoader keeps fp8 files fp8 too when the model would not fit otherwise;
# "fp8_e4m3fn" / "fp8_e5m2": weights converted to that fp8 format while loading (ComfyUI's names);
# "compute": every weight upcast to the compute dtype at load (faster per step, twice the bytes of fp8).
WEIGHT_DTYPES: dict[str, DType | None] = {
    "default": None,
    **{d.short: d for d in FP8_DTYPES if d.short is not None},
    "compute": None,
}


# GGUF's quantized GGML types the loader reads (those ComfyUI-GGUF dequantizes in torch; parallel/ggml.py
# holds the formulas): name -> (values per block, bytes per block), ggml's sizes (the `gguf` package's
# GGML_QUANT_SIZES; tests/test_gguf.py checks they agree). Here, torch- and gguf-free, for the planner.
GGUF_BLOCKS: dict[str, tuple[int, int]] = {
    "Q8_0": (32, 34),
    "Q5_1": (32, 24),
    "Q5_0": (32, 22),
    "Q4_1": (32, 20),
    "Q4_0": (32, 18),
    "Q6_K": (256, 210),
    "Q5_K": (256, 176),
    "Q4_K": (256, 144),
    "Q3_K": (256, 110),
    "Q2_K": (256, 84),
    "IQ4_NL": (32, 18),
    "IQ4_XS": (256, 136),
}


def gguf_bytes_per_value(name: str) -> float:
    """Bytes one value of GGML type `name` takes (Q8_0: 34 / 32 = 1.0625; Q4_K: 144 / 256 = 0.5625)."""
    block, size = GGUF_BLOCKS[name]
    return size / block


def compute_dtype_named(name: str) -> DType | None:
    """The compute dtype called `name` or its short name ("bf16"); None when there is none."""
    return next((d for d in COMPUTE_DTYPES if name in (d.name, d.short)), None)


def stored_dtype(safetensors_name: str) -> DType | None:
    """The dtype a safetensors header calls `safetensors_name` ("BF16"); None for one the pack lacks."""
    return next((d for d in DTYPES if d.safetensors == safetensors_name), None)


def dtype_named(name: str) -> DType | None:
    """The dtype torch calls `name` ("float8_e4m3fn"); None for one the pack lacks."""
    return next((d for d in DTYPES if d.name == name), None)


def weight_dtype_alias(name: str) -> str:
    """A weight dtype's canonical name: torch's fp8 names ("float8_e4m3fn") become ComfyUI's."""
    found = dtype_named(name)
    return found.short if found is not None and found.fp8 and found.short else name


__all__ = [
    "COMPUTE_DTYPES",
    "DTYPES",
    "FP8_DTYPES",
    "GGUF_BLOCKS",
    "LOADABLE_DTYPES",
    "WEIGHT_DTYPES",
    "DType",
    "compute_dtype_named",
    "dtype_named",
    "gguf_bytes_per_value",
    "stored_dtype",
    "weight_dtype_alias",
]
