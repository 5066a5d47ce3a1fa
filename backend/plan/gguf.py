"""When neither bf16 nor fp8 fits: the least quantized GGUF file that does, for `plan` to name.

GGUF weights stay quantized on the GPUs (checkpoint/gguf.py), so their bytes per value are what a rank
holds (Setup.linear_bytes); the ladder is the types GGUF FLUX and Qwen-Image files are published in, from
the most bits to the fewest.
"""

from __future__ import annotations

import dataclasses

from ..dtypes import GGUF_BLOCKS
from ..text import GB
from .cost import Estimate, plan
from .setup import Setup

LADDER = ("Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K")


def lightest_fitting_gguf(setup: Setup) -> tuple[str, Estimate] | None:
    """(GGUF type, its fastest fitting layout) of the type with the most bits per value that fits `setup`'s
    devices; None when none does. A setup that prices a GGUF type (`plan --checkpoint` of a .gguf file) is
    offered the lighter ones only."""
    ladder = LADDER
    if setup.weight_dtype in GGUF_BLOCKS:
        known = setup.weight_dtype in LADDER
        ladder = LADDER[LADDER.index(setup.weight_dtype) + 1 :] if known else ()
    for name in ladder:
        # a file of that type, every linear weight in it (the checkpoint's own mix, if any, is not that file)
        fitting = [
            e for e in plan(dataclasses.replace(setup, weight_dtype=name, file_weights=None)) if e.fits
        ]
        if fitting:
            return name, fitting[0]
    return None


def gguf_hint(setup: Setup) -> str | None:
    """The line `plan` prints under a setup that does not fit: which GGUF quantization would."""
    found = lightest_fitting_gguf(setup)
    if found is None:
        return None
    name, best = found
    first = LADDER.index(setup.weight_dtype) if setup.weight_dtype in LADDER else 0
    heavier = LADDER[first : LADDER.index(name)]
    not_fit = f"; {', '.join(heavier)} {'does' if len(heavier) == 1 else 'do'} not" if heavier else ""
    return (
        f"gguf: a {name} GGUF file of this model fits ({best.name}: {best.per_gpu / GB:.1f} GB per "
        f"{setup.device_word} of {setup.memory_gb:g}){not_fit}. The loader reads it from models/unet or "
        f"models/diffusion_models and keeps it quantized on the {setup.device_word}s"
    )


__all__ = ["LADDER", "gguf_hint", "lightest_fitting_gguf"]
