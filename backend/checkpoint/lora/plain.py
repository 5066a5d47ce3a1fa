"""LoRA: delta = up @ down (comfy/weight_adapter/lora.py, LoRAAdapter).

ComfyUI's rules: `up` [out, rank] and `down` [rank, in] in any of its seven spellings (tried in this
order); scale = alpha / rank with rank = down.shape[0], or 1 without alpha; the delta is
`(strength * scale) * (up @ down)` in float32. A rank's block is `up[its rows] @ down[:, its columns]`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .reading import Device, delta_ranges, read_cols, read_rows
from .records import AdapterKind, LoraModule, Parsed, Ranges, Stats

# (up, down) spellings, in the order ComfyUI's LoRAAdapter.load tries them.
FACTOR_SUFFIXES: tuple[tuple[str, str], ...] = (
    (".lora_up.weight", ".lora_down.weight"),
    ("_lora.up.weight", "_lora.down.weight"),
    (".lora_B.weight", ".lora_A.weight"),
    (".lora.up.weight", ".lora.down.weight"),
    (".lora_B", ".lora_A"),
    (".lora_linear_layer.up.weight", ".lora_linear_layer.down.weight"),
    (".lora_B.default.weight", ".lora_A.default.weight"),
)


def parse(p: Parsed) -> tuple[int, float]:
    out, in_features = p.shape
    down = p.shape_of("down")
    rank = down[0] if len(down) == 2 else 0
    if len(down) != 2 or rank < 1 or down[1] != in_features:
        raise p.wrong_shape("down", [rank if rank >= 1 else "rank", in_features])
    if p.shape_of("up") != (out, rank):
        raise p.wrong_shape("up", [out, rank])
    return rank, 1.0 if p.alpha is None else p.alpha / rank


def block(f: Any, module: LoraModule, rows: Ranges, cols: Ranges | None, device: Device) -> torch.Tensor:
    up = read_rows(f, module.tensor("up"), delta_ranges(module, rows), device)
    return torch.mm(up, read_cols(f, module.tensor("down"), cols, device))


def bound(module: LoraModule, stats: Mapping[str, Stats]) -> float:
    return module.rank * stats[module.tensor("up")].peak * stats[module.tensor("down")].peak


KIND = AdapterKind(
    name="LoRA",
    roles={"up": tuple(u for u, _ in FACTOR_SUFFIXES), "down": tuple(d for _, d in FACTOR_SUFFIXES)},
    required=("up", "down"),
    parse=parse,
    block=block,
    bound=bound,
)

__all__ = ["FACTOR_SUFFIXES", "KIND"]
