"""DoRA: ComfyUI's `weight_decompose` (comfy/weight_adapter/base.py), on some rows and columns of a weight.

What ComfyUI computes for a module with a `dora_scale` (LoRA, LoHa and LoKr alike), in float32:

    lora_diff *= scale                                  # alpha / rank
    weight_calc = weight + lora_diff
    norm = |weight[i, :]| per row      if dora_scale is [out, 1]   (the weight *before* the patch)
         = |weight_calc[:, j]| per column otherwise ([1, in])      (the patched weight)
    weight_calc *= dora_scale / (norm + eps(float32))
    weight = weight + strength * (weight_calc - weight)  (strength 1: weight = weight_calc)

So the strength interpolates between the weight and the decomposed weight instead of scaling the delta,
and a row norm reads the weight as it was before this module (its earlier patches included), a column
norm the weight after it. ComfyUI 0.33 on a GPU that prefers fp16 runs this in fp16 (its
`lora_compute_dtype`); on the CPU, and always here, it is float32.

A row norm needs whole rows and a column norm whole columns: a shard split along the other dimension has
them locally; one split along the same dimension does not, and apply.py reads what is missing.
"""

from __future__ import annotations

import torch

EPS = torch.finfo(torch.float32).eps


def output_norm(weight: torch.Tensor) -> torch.Tensor:
    """[rows, 1]: each row's norm over all its columns (ComfyUI's expression, so the rounding is the same)."""
    return weight.reshape(weight.shape[0], -1).norm(dim=1, keepdim=True)


def input_norm(weight_calc: torch.Tensor) -> torch.Tensor:
    """[1, columns]: each column's norm over all the rows given (ComfyUI's transpose-reshape-norm)."""
    columns = weight_calc.shape[1]
    return (
        weight_calc.transpose(0, 1)
        .reshape(columns, -1)
        .norm(dim=1, keepdim=True)
        .reshape(columns, 1)
        .transpose(0, 1)
    )


def decompose(
    weight: torch.Tensor,
    lora_diff: torch.Tensor,
    scale: float,
    dora_scale: torch.Tensor,
    strength: float,
    axis: str,
    norm: torch.Tensor | None = None,
) -> torch.Tensor:
    """The new value of `weight` (some rows x columns of the weight, rows in weight order) under one DoRA
    module: `lora_diff` is the module's unscaled delta there, `dora_scale` its magnitudes for those rows
    ([rows, 1], axis "output") or columns ([1, columns], axis "input"). `norm`: the norms when `weight` is
    not all the norm needs (apply.py computes them from the whole weight); None computes them here."""
    lora_diff *= scale
    weight_calc = weight + lora_diff
    if norm is None:
        norm = output_norm(weight) if axis == "output" else input_norm(weight_calc)
    norm = norm + EPS
    weight_calc *= dora_scale / norm
    if strength != 1.0:
        weight_calc -= weight
        return weight + strength * weight_calc
    return weight_calc


__all__ = ["EPS", "decompose", "input_norm", "output_norm"]
