"""Quantized formats the pack does not read, recognized by name from a header, with what to use instead.

Without this an NF4 FLUX file (lllyasviel's flux1-dev-bnb-nf4, diffusers' bitsandbytes saves) was "a FLUX.1
variant this loader does not know": its weights sit beside companions (`absmax`, `quant_map`,
`quant_state.bitsandbytes__nf4`) the layout lacks. Each format here leaves such companions next to the
weights, and each is recognized by them: bitsandbytes (NF4 / FP4 / int8), GPTQ and AWQ, Nunchaku's
SVDQuant, optimum-quanto. ComfyUI's own fp8 / nvfp4 layouts are quant.py's; GGUF is gguf.py's.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ..runtime.redact import quoted
from .files import CheckpointError, StoredTensor

INSTEAD = (
    "Use a GGUF file of the same model (Q4_K or Q4_0 is about NF4's size, Q8_0 about fp8's; this loader "
    "reads it from models/diffusion_models or models/unet and splits it across the GPUs), or an fp8, bf16 "
    "or fp16 .safetensors file"
)

# (key suffix or fragment, the format's name), checked in this order.
SIGNATURES: tuple[tuple[str, str], ...] = (
    (".quant_state.bitsandbytes__nf4", "a bitsandbytes NF4 (4-bit) file"),
    (".quant_state.bitsandbytes__fp4", "a bitsandbytes FP4 (4-bit) file"),
    (".absmax", "a bitsandbytes 4-bit (NF4/FP4) file"),
    (".quant_map", "a bitsandbytes 4-bit (NF4/FP4) file"),
    (".SCB", "a bitsandbytes int8 (LLM.int8) file"),
    (".wscales", "a Nunchaku SVDQuant (int4/fp4) file; it runs in ComfyUI through ComfyUI-nunchaku"),
    (".smooth_factor", "a Nunchaku SVDQuant (int4/fp4) file; it runs in ComfyUI through ComfyUI-nunchaku"),
    (".qzeros", "a GPTQ / AWQ int4 file"),
    (".g_idx", "a GPTQ int4 file"),
    (".qweight", "a GPTQ / AWQ int4 file"),
    (".weight._data", "an optimum-quanto file"),
    (".weight._scale", "an optimum-quanto file"),
)


def refuse_foreign_quantization(path: Path, header: Mapping[str, StoredTensor]) -> None:
    """CheckpointError naming the format when the header's keys are those of a quantized format the pack
    does not read (see SIGNATURES), with what to use instead; nothing for any other file."""
    for suffix, name in SIGNATURES:
        key = next((k for k in sorted(header) if k.endswith(suffix)), None)
        if key is not None:
            raise CheckpointError(
                f"{quoted(path)} is {name} (tensor '{key}'); this loader does not read that quantization. {INSTEAD}"
            )


__all__ = ["INSTEAD", "SIGNATURES", "refuse_foreign_quantization"]
