"""What a LoRA file patches, as data: which adapter (`LoraModule`), on which rows of which diffusers
parameters (`LoraTarget`), and the adapter kinds' interface (`AdapterKind`).

Coordinates. ComfyUI patches one tensor of *its* model per LoRA module: a BFL weight, or a row range of one
(`linear1_qkv`, a diffusers `to_q` of a fused `qkv`), whose rows are the module's rows here ("weight rows").
The pack's model is diffusers', so a module's weight rows land on one or several diffusers parameters
(`LoraTarget.segments`). The file's delta rows are the weight rows, except where ComfyUI reorders the delta
before adding it (its `swap_scale_shift` for diffusers' `norm_out.linear`): `LoraModule.delta_rows`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...config import ConfigError
from ...runtime.redact import quoted

Ranges = Sequence[tuple[int, int]]  # [start, stop) ranges, concatenated in order
Segments = tuple[tuple[int, int, int], ...]  # (destination row, source row, rows)


class LoraError(ConfigError):
    """A LoRA that cannot be applied to this checkpoint; the message names the file, the key and the fix."""


@dataclass(frozen=True)
class LoraTarget:
    """One diffusers parameter a module patches: its rows [p, p + n) take the module's weight rows
    [w, w + n), for each (p, w, n) in `segments`; rows outside them are left alone."""

    param: str  # e.g. "transformer_blocks.0.attn.to_q.weight"
    segments: Segments


@dataclass(frozen=True)
class LoraModule:
    """One adapter in a file, as ComfyUI applies it to one tensor of its model (comfy/weight_adapter/)."""

    key: str  # the module's key in the file, e.g. "lora_unet_double_blocks_0_img_attn_qkv"
    kind: str  # "lora", "loha", "lokr", "diff" (weights) or "diff_b" (biases)
    tensors: tuple[tuple[str, str], ...]  # (role, tensor key), e.g. ("up", "<key>.lora_up.weight")
    shape: tuple[int, ...]  # the tensor ComfyUI patches: (out, in) for weights, (out,) for biases
    scale: float  # ComfyUI's `alpha` factor: alpha / rank, or 1 (its per-kind rule)
    rank: int  # the rank the scale divides by (0: none)
    targets: tuple[LoraTarget, ...]
    delta_rows: Segments  # (weight row, delta row, rows): where the file's delta rows go
    dora: str = ""  # "output" (dora_scale [out, 1]) or "input" ([1, in]): DoRA's norm axis; "" without

    def tensor(self, role: str) -> str:
        return dict(self.tensors)[role]

    def has(self, role: str) -> bool:
        return role in dict(self.tensors)


@dataclass(frozen=True)
class LoraInfo:
    """What a LoRA file patches in one checkpoint, from its header (and alphas) alone."""

    path: str
    format: str  # "bfl", "kohya", "diffusers", or several joined by "+"
    modules: tuple[LoraModule, ...]
    skipped: tuple[str, ...]  # text-encoder keys, ignored as ComfyUI's model-only loader does

    @property
    def params(self) -> frozenset[str]:
        """The diffusers parameters this LoRA changes."""
        return frozenset(t.param for m in self.modules for t in m.targets)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The adapter kinds in the file, e.g. ('lokr', 'dora', 'diff_b')."""
        found = {m.kind for m in self.modules} | {"dora" for m in self.modules if m.dora}
        return tuple(sorted(found))


@dataclass(frozen=True)
class Parsed:
    """A module's tensors as `AdapterKind.parse` sees them: shapes from the header, before any value is read."""

    path: str
    key: str  # the module key
    roles: Mapping[str, str]  # role -> tensor key
    shapes: Mapping[str, tuple[int, ...]]  # tensor key -> shape
    alpha: float | None
    shape: tuple[int, ...]  # what this checkpoint needs: (out, in) or (out,)

    def shape_of(self, role: str) -> tuple[int, ...]:
        return tuple(self.shapes[self.roles[role]])

    def wrong_shape(self, role: str, want: Sequence[int | str]) -> LoraError:
        return LoraError(
            f"LoRA {quoted(self.path)}: '{self.roles[role]}' has shape {list(self.shape_of(role))} but this "
            f"checkpoint's '{self.key}' needs {list(want)}; the LoRA was made for a different model"
        )


@dataclass(frozen=True)
class Stats:
    """One tensor's largest |value| and shape, from the caller's scan of the file's values."""

    peak: float
    shape: tuple[int, ...]


@dataclass(frozen=True)
class AdapterKind:
    """One adapter kind, as ComfyUI computes it (one module per kind: plain.py, loha.py, lokr.py, diff.py).

    * roles: role -> the suffixes that spell it (ComfyUI's loader tries them in this order);
    * required: roles that must all be present (`optional` may be);
    * parse(Parsed) -> (rank, scale): checks the shapes against the checkpoint, applies the alpha rule;
    * block(file, module, weight rows, columns or None for all, device) -> the unscaled float32 delta
      ("lora_diff") at those rows and columns, reading only what they need;
    * bound(module, stats) -> the largest |entry| the unscaled delta can have, from each tensor's largest
      |value| and shape (the caller refuses an overflow before any worker starts).
    """

    name: str  # for messages, e.g. "LoKr"
    roles: Mapping[str, tuple[str, ...]]
    required: tuple[str, ...]
    parse: Callable[[Parsed], tuple[int, float]]
    block: Callable[[Any, LoraModule, Ranges, Ranges | None, Any], torch.Tensor]
    bound: Callable[[LoraModule, Mapping[str, Stats]], float]
    dora: bool = True  # ComfyUI runs its weight_decompose for this kind when a dora_scale is given


__all__ = [
    "AdapterKind",
    "LoraError",
    "LoraInfo",
    "LoraModule",
    "LoraTarget",
    "Parsed",
    "Ranges",
    "Segments",
    "Stats",
]
