"""LoKr: delta = kron(w1, w2), a Kronecker product (comfy/weight_adapter/lokr.py, LoKrAdapter).

ComfyUI's rules: w1 is `lokr_w1` or `lokr_w1_a @ lokr_w1_b`, w2 is `lokr_w2` or `lokr_w2_a @ lokr_w2_b`;
the rank alpha divides by is w2_b.shape[0] when w2 is factored, else w1_b.shape[0] when w1 is, and with
neither factored (or no alpha) the scale is 1: ComfyUI then ignores alpha. Its Tucker form (lokr_t2) is
an einsum over 4-D convolution kernels, which fails on a linear layer in ComfyUI too (names.py refuses it).

A shard without the whole product: kron(w1, w2)[r, c] = w1[r // h2, c // w2'] * w2[r % h2, c % w2'] for
w2 of shape [h2, w2'], one multiplication per entry exactly as torch.kron does, so a rank computes its rows
and columns from the two (small) factors alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ...runtime.redact import quoted
from .reading import Device, delta_ranges, indices, read_all
from .records import AdapterKind, LoraError, LoraModule, Parsed, Ranges, Stats

ROLES = {
    "w1": ".lokr_w1",
    "w2": ".lokr_w2",
    "w1_a": ".lokr_w1_a",
    "w1_b": ".lokr_w1_b",
    "w2_a": ".lokr_w2_a",
    "w2_b": ".lokr_w2_b",
}


def _factor(p: Parsed, n: str) -> tuple[tuple[int, int], int | None]:
    """(shape of w<n>, the rank of its factors or None when stored whole)."""
    full, a, b = f"w{n}", f"w{n}_a", f"w{n}_b"
    have = [r for r in (full, a, b) if r in p.roles]
    if full in p.roles and len(have) > 1:
        raise LoraError(
            f"LoRA {quoted(p.path)}: '{p.key}' has both '{p.roles[full]}' and '{p.roles[have[1]]}'; a LoKr factor "
            "is stored whole or as two parts, not both. The file is malformed"
        )
    if full in p.roles:
        shape = p.shape_of(full)
        if len(shape) != 2:
            raise p.wrong_shape(full, ["rows", "columns"])
        return (shape[0], shape[1]), None
    if len(have) != 2:
        lack = ROLES[full] if not have else ROLES[a if b in have else b]
        where = f"'{p.roles[have[0]]}' has no matching '{lack}'" if have else f"'{ROLES[full]}' is missing"
        raise LoraError(
            f"LoRA {quoted(p.path)}: {where} for '{p.key}'; the file is incomplete. Download it again"
        )
    left, right = p.shape_of(a), p.shape_of(b)
    if len(right) != 2 or right[0] < 1:
        raise p.wrong_shape(b, ["rank", "columns"])
    if len(left) != 2 or left[1] != right[0]:
        raise p.wrong_shape(a, ["rows", right[0]])
    return (left[0], right[1]), right[0]


def parse(p: Parsed) -> tuple[int, float]:
    (a, b), rank1 = _factor(p, "1")
    (c, d), rank2 = _factor(p, "2")
    if (a * c, b * d) != tuple(p.shape):
        w1 = p.roles.get("w1", p.roles.get("w1_a"))
        w2 = p.roles.get("w2", p.roles.get("w2_a"))
        raise LoraError(
            f"LoRA {quoted(p.path)}: '{w1}' ({a} x {b}) and '{w2}' ({c} x {d}) make a {a * c} x {b * d} Kronecker "
            f"product but this checkpoint's '{p.key}' needs {list(p.shape)}; the LoRA was made for a "
            "different model"
        )
    rank = rank2 if rank2 is not None else rank1  # ComfyUI's `dim`: w2's rank overrides w1's
    if p.alpha is None or rank is None:
        return rank or 0, 1.0
    return rank, p.alpha / rank


def _whole(f: Any, module: LoraModule, n: str, device: Device) -> torch.Tensor:
    if module.has(f"w{n}"):
        return read_all(f, module.tensor(f"w{n}"), device)
    a, b = read_all(f, module.tensor(f"w{n}_a"), device), read_all(f, module.tensor(f"w{n}_b"), device)
    return torch.mm(a, b)


def block(f: Any, module: LoraModule, rows: Ranges, cols: Ranges | None, device: Device) -> torch.Tensor:
    w1, w2 = _whole(f, module, "1", device), _whole(f, module, "2", device)
    height, width = w2.shape
    r = indices(delta_ranges(module, rows), device)
    c = indices(cols if cols is not None else ((0, module.shape[1]),), device)
    outer = w1.index_select(0, r // height).index_select(1, c // width)
    inner = w2.index_select(0, r % height).index_select(1, c % width)
    return outer * inner


def _peak(module: LoraModule, stats: Mapping[str, Stats], n: str) -> float:
    if module.has(f"w{n}"):
        return stats[module.tensor(f"w{n}")].peak
    left, right = stats[module.tensor(f"w{n}_a")], stats[module.tensor(f"w{n}_b")]
    return right.shape[0] * left.peak * right.peak


def bound(module: LoraModule, stats: Mapping[str, Stats]) -> float:
    return _peak(module, stats, "1") * _peak(module, stats, "2")


KIND = AdapterKind(
    name="LoKr",
    roles={role: (suffix,) for role, suffix in ROLES.items()},
    required=(),  # w1 or its two parts, and w2 or its two parts: parse checks
    parse=parse,
    block=block,
    bound=bound,
)

__all__ = ["KIND"]
