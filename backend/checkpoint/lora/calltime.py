"""LoRAs on GGUF weights held quantized: patched at call time, on the dequantized weight, as ComfyUI-GGUF does.

ComfyUI-GGUF never writes a patched weight back into a quantized tensor (the delta would not survive
re-quantization, and a dense patched copy would cost the memory GGUF saves): its GGUFModelPatcher hangs the
patches on the tensor, and GGMLLayer.get_weight dequantizes the weight and runs ComfyUI's
`calculate_weight` on the result for every call. Here a quantized module gets a `weight_patch`
(`CallTimePatch`), which `parallel/weights.py linear_weight` runs on the dequantized weight: the very
`Patcher.apply` every other weight is patched with (every adapter kind, DoRA, fused targets, this rank's
rows and columns only), reading the LoRA's tensors from a copy held in host memory (`ResidentFile`, like
ComfyUI-GGUF's default `patch_on_device=False`: the factors stay on the CPU and are moved per call).

Numerics: the patches run in float32 on the dequantized weight and the result is cast to the compute
dtype once. A GGUF file's unquantized F16 weights ComfyUI-GGUF patches once, like any weight, and rounds
back to float16 (`rounded_as_stored`, which the dense path applies). On a CPU in float32 that is ComfyUI-GGUF's arithmetic; in bf16 ComfyUI-GGUF adds each delta
already rounded to bf16 into the bf16 weight, so the two may differ by one bf16 rounding per weight.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ...parallel.tensor import Pieces
    from ..files import StoredTensor
    from .apply import Patch, Patcher


class _Slice:
    """safetensors' slice interface over a tensor in memory (what the adapter kinds read through)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.tensor[index]

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)


class ResidentFile:
    """The tensors `keys` of an open LoRA file, copied into host memory, behind safe_open's interface."""

    def __init__(self, f: Any, keys: Iterable[str]) -> None:
        self.tensors = {key: f.get_tensor(key) for key in keys}

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def get_slice(self, key: str) -> _Slice:
        return _Slice(self.tensors[key])


def rounded_as_stored(stored: StoredTensor, patched: torch.Tensor) -> torch.Tensor:
    """A patched weight as ComfyUI-GGUF holds an *unquantized* GGUF weight: patched once (not per call) in
    float32, then cast back to the tensor's own dtype (GGUFModelPatcher.patch_weight_to_device ->
    comfy.float.stochastic_rounding, which rounds to nearest for float16) and so cast to the compute dtype
    per call. For an F16 tensor that is one float16 rounding; F32 keeps float32, and every other stored
    tensor is left alone."""
    if stored.offset is not None and stored.dtype == "F16":
        return patched.to(torch.float16)
    return patched


class CallTimePatch:
    """One quantized parameter's patches, applied to its dequantized shard on every call."""

    def __init__(self, patcher: Patcher, name: str, pieces: Pieces | None, patches: list[Patch]) -> None:
        self.patcher, self.name, self.pieces, self.patches = patcher, name, pieces, patches

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        work = weight.to(torch.float32, copy=True)
        for patch in self.patches:
            self.patcher.apply(work, self.name, self.pieces, patch)
        return work.to(weight.dtype)


__all__ = ["CallTimePatch", "ResidentFile", "rounded_as_stored"]
