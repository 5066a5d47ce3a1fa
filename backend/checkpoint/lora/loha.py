"""LoHa: delta = (w1_a @ w1_b) * (w2_a @ w2_b), a Hadamard product (comfy/weight_adapter/loha.py).

ComfyUI's rules: scale = alpha / rank with rank = hada_w1_b.shape[0], or 1 without alpha. Its Tucker form
(hada_t1 / hada_t2) is an einsum over 4-D convolution kernels, which fails on a linear layer in ComfyUI
too, so names.py refuses those keys. A rank's block is the product of the two factors' blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .reading import Device, delta_ranges, read_cols, read_rows
from .records import AdapterKind, LoraModule, Parsed, Ranges, Stats

ROLES = {"w1_a": ".hada_w1_a", "w1_b": ".hada_w1_b", "w2_a": ".hada_w2_a", "w2_b": ".hada_w2_b"}


def _pair(p: Parsed, a: str, b: str) -> int:
    out, in_features = p.shape
    right = p.shape_of(b)
    rank = right[0] if len(right) == 2 else 0
    if len(right) != 2 or rank < 1 or right[1] != in_features:
        raise p.wrong_shape(b, ["rank", in_features])
    if p.shape_of(a) != (out, rank):
        raise p.wrong_shape(a, [out, rank])
    return rank


def parse(p: Parsed) -> tuple[int, float]:
    rank = _pair(p, "w1_a", "w1_b")
    _pair(p, "w2_a", "w2_b")
    return rank, 1.0 if p.alpha is None else p.alpha / rank


def block(f: Any, module: LoraModule, rows: Ranges, cols: Ranges | None, device: Device) -> torch.Tensor:
    rows = delta_ranges(module, rows)
    m1 = torch.mm(
        read_rows(f, module.tensor("w1_a"), rows, device), read_cols(f, module.tensor("w1_b"), cols, device)
    )
    m2 = torch.mm(
        read_rows(f, module.tensor("w2_a"), rows, device), read_cols(f, module.tensor("w2_b"), cols, device)
    )
    return m1 * m2


def _product(module: LoraModule, stats: Mapping[str, Stats], a: str, b: str) -> float:
    left, right = stats[module.tensor(a)], stats[module.tensor(b)]
    return right.shape[0] * left.peak * right.peak


def bound(module: LoraModule, stats: Mapping[str, Stats]) -> float:
    return _product(module, stats, "w1_a", "w1_b") * _product(module, stats, "w2_a", "w2_b")


KIND = AdapterKind(
    name="LoHa",
    roles={role: (suffix,) for role, suffix in ROLES.items()},
    required=tuple(ROLES),
    parse=parse,
    block=block,
    bound=bound,
)

__all__ = ["KIND"]
