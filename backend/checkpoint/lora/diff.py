"""Full differences: `.diff` adds `strength * diff` to a weight, `.diff_b` to its bias (comfy/lora.py
`load_lora` makes them ("diff", (tensor,)) patches; `calculate_weight` adds them in float32).

No alpha, no rank, no DoRA: ComfyUI scales a difference by the strength alone (an `.alpha` beside it is
read and ignored, and so it is here). The shape must be the patched tensor's exactly: ComfyUI skips a
mismatched one with a log line ("WEIGHT NOT MERGED"), which would leave the model silently unpatched.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .reading import Device, delta_ranges, read_block
from .records import AdapterKind, LoraModule, Parsed, Ranges, Stats


def parse(p: Parsed) -> tuple[int, float]:
    role = next(iter(p.roles.keys() & {"diff", "diff_b"}))
    if p.shape_of(role) != tuple(p.shape):
        raise p.wrong_shape(role, p.shape)
    return 0, 1.0


def block(f: Any, module: LoraModule, rows: Ranges, cols: Ranges | None, device: Device) -> torch.Tensor:
    return read_block(f, module.tensor(module.kind), delta_ranges(module, rows), cols, device)


def bound(module: LoraModule, stats: Mapping[str, Stats]) -> float:
    return stats[module.tensor(module.kind)].peak


WEIGHT = AdapterKind(
    name="full weight difference (.diff)",
    roles={"diff": (".diff",)},
    required=("diff",),
    parse=parse,
    block=block,
    bound=bound,
    dora=False,
)
BIAS = AdapterKind(
    name="bias difference (.diff_b)",
    roles={"diff_b": (".diff_b",)},
    required=("diff_b",),
    parse=parse,
    block=block,
    bound=bound,
    dora=False,
)

__all__ = ["BIAS", "WEIGHT"]
