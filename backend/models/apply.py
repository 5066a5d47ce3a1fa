"""Tensor parallelism by a plan, on ComfyUI's own modules: `apply_tensor_parallel(model, plan, group)`.

Applied to the model on the meta device, before any weight is read: every split layer keeps ComfyUI's own
module (its `comfy.ops` class decides casting, fp8 upcast and any other handling of its weight), holding the
narrower parameters of this rank, and the returned map says which slice of each stored tensor fills them
(load.py reads exactly that). Per kind (plan.py):

* `Columns`: the weight's rows (and bias) of this rank, every fused section split evenly; nothing else.
* `Rows`: the weight's columns of this rank, every fused section alike; a forward hook all-reduces the
  output over the tp group; the bias only on the group's first rank (added once).
* `Gathered`: as Columns, then the layer's forward serves the whole output: its bank evaluates every layer of
  the bank on the first input of a forward and rebuilds all their outputs with one all-gather
  (parallel/tensor.py `gather_last_dim`); the banks are emptied when the model's forward starts and ends.
* `HeadNorm`: parallel/tensor.py's `HeadShardedRMSNorm` (this rank's slice of the weight, the mean of squares
  summed over the group).
* `per_rank`: each attribute divided by the degree (refused by name when it does not divide).

The split kinds' slicing is parallel/splits.py's (`section_ranges`), shared with the diffusers engine.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config import ConfigError
from ..parallel.splits import Pieces, section_ranges
from ..parallel.tensor import HeadShardedRMSNorm, gather_last_dim, resolve_plan
from .plan import Columns, Gathered, ModelPlan, Rows, Sections, Split

PIECES_ATTR = "_rp_pieces"  # the model's parameter name -> this rank's Pieces (absent: whole)


def _section_sizes(sections: Sections, owner: nn.Module, total: int, name: str) -> list[int]:
    if isinstance(sections, int):
        if total % sections:
            raise ValueError(f"'{name}': {total} features do not split into {sections} equal sections")
        return [total // sections] * sections
    sizes = [int(getattr(owner, attribute)) for attribute in sections]
    if sum(sizes) != total:
        raise ValueError(f"'{name}': {total} features are not the sections {sections} = {sizes}")
    return sizes


def _narrow(module: nn.Module, param: str, pieces: Pieces | None) -> None:
    tensor = getattr(module, param)
    if tensor is not None and pieces is not None:
        setattr(module, param, nn.Parameter(pieces.take(tensor.detach()), requires_grad=False))


class GatherBank:
    """The Gathered layers of one bank: evaluated together on the first input of a forward, one all-gather
    for all of them (see the module docstring)."""

    def __init__(self, group: Any, degree: int) -> None:
        self.group, self.degree = group, degree
        self.layers: list[nn.Module] = []
        self.shape: tuple[int, ...] | None = None
        self.outputs: dict[int, torch.Tensor] = {}

    def add(self, layer: nn.Module) -> None:
        self.layers.append(layer)
        layer.forward = functools.partial(self.forward, layer)  # instance attribute: nn.Module calls it

    def forward(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.shape == tuple(x.shape) and id(layer) in self.outputs:
            return self.outputs[id(layer)]
        if self.shape is None:  # the forward's first call: every layer of the bank on this input
            outputs = gather_last_dim([type(m).forward(m, x) for m in self.layers], self.group, self.degree)
            self.shape, self.outputs = (
                tuple(x.shape),
                {id(m): o for m, o in zip(self.layers, outputs, strict=True)},
            )
            return self.outputs[id(layer)]
        # another input than the bank's in this forward (e.g. FLUX.2's text modulation with timestep-zero
        # references): this layer alone
        return gather_last_dim([type(layer).forward(layer, x)], self.group, self.degree)[0]

    def clear(self, *_: Any) -> None:
        self.shape, self.outputs = None, {}


def _all_reduce_output(group: Any, _module: nn.Module, _inputs: Any, output: torch.Tensor) -> None:
    dist.all_reduce(output, group=group)


def _check_linear(module: nn.Module, name: str, split: Split) -> None:
    if not isinstance(module, nn.Linear):
        raise TypeError(
            f"the plan splits '{name}' as {type(split).__name__}, a {type(module).__name__}; only linears split"
        )


def _split_linear(
    model: nn.Module, name: str, split: Split, rank: int, degree: int, group: Any
) -> dict[str, Pieces | None]:
    parent_name = name.rpartition(".")[0]
    owner = model.get_submodule(parent_name) if parent_name else model
    module = model.get_submodule(name)
    _check_linear(module, name, split)
    out_features, in_features = module.weight.shape
    if isinstance(split, Rows):
        ranges = section_ranges(_section_sizes(split.sections, owner, in_features, name), rank, degree)
        weight, bias = Pieces(1, ranges), None
        if rank != 0:
            module.bias = None  # added once, by the group's first rank, into the reduced sum
        module.register_forward_hook(functools.partial(_all_reduce_output, group))
    else:
        sections = split.sections if isinstance(split, Columns) else 1
        ranges = section_ranges(_section_sizes(sections, owner, out_features, name), rank, degree)
        weight = bias = Pieces(0, ranges)
    _narrow(module, "weight", weight)
    _narrow(module, "bias", bias)
    module.out_features, module.in_features = module.weight.shape
    out = {f"{name}.weight": weight}
    if module.bias is not None:
        out[f"{name}.bias"] = bias
    return out


def _split_norm(model: nn.Module, name: str, rank: int, degree: int, group: Any) -> dict[str, Pieces | None]:
    module = model.get_submodule(name)
    shape = getattr(module, "normalized_shape", None)
    if not isinstance(module, nn.RMSNorm) or shape is None or len(shape) != 1:
        raise TypeError(
            f"the plan names '{name}' a HeadNorm, a {type(module).__name__}; it must be an RMS norm"
        )
    width = int(shape[0])
    pieces = Pieces(0, section_ranges([width], rank, degree))
    _narrow(module, "weight", pieces)
    norm = HeadShardedRMSNorm(module.weight, module.eps, width, group)
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, norm)
    return {f"{name}.weight": pieces} if module.weight is not None else {}


def _per_rank(
    model: nn.Module, patterns: Mapping[str, tuple[str, ...]], degree: int, optional: tuple[str, ...]
) -> None:
    for name, attributes in resolve_plan(model, patterns, optional).items():
        module = model.get_submodule(name)
        for attribute in attributes:
            value = getattr(module, attribute)
            if value % degree:
                raise ConfigError(f"tp_degree={degree} does not divide '{name}.{attribute}' = {value}")
            setattr(module, attribute, value // degree)


def check_tensor_parallel(model: nn.Module, plan: ModelPlan, degree: int) -> None:
    """Refuse a degree that does not divide the model's heads, naming the degrees that do."""
    heads = plan.head_count(model)
    if heads % degree:
        valid = [d for d in range(2, heads + 1) if heads % d == 0]
        raise ConfigError(
            f"tp_degree={degree} does not divide {plan.name}'s {heads} attention heads; use {', '.join(map(str, valid))}"
        )


def apply_tensor_parallel(model: nn.Module, plan: ModelPlan, group: Any) -> dict[str, Pieces | None]:
    """Shard ComfyUI's `model` (on the meta device, or materialized: each rank keeps its slices) in place
    across `group` by `plan`; returns parameter name -> this rank's Pieces of the stored tensor (None: the
    whole tensor) for every parameter the plan split, and records it on the model (`PIECES_ATTR`).
    Degree 1 changes nothing."""
    degree, rank = dist.get_world_size(group), dist.get_rank(group)
    pieces: dict[str, Pieces | None] = {}
    if degree > 1:
        check_tensor_parallel(model, plan, degree)
        banks: dict[str, GatherBank] = {}
        for name, split in resolve_plan(model, plan.linears, plan.optional).items():
            pieces.update(_split_linear(model, name, split, rank, degree, group))
            if isinstance(split, Gathered):
                key = split.bank or name  # an unnamed bank holds one layer
                banks.setdefault(key, GatherBank(group, degree)).add(model.get_submodule(name))
        for name in resolve_plan(model, plan.norms, plan.optional):
            pieces.update(_split_norm(model, name, rank, degree, group))
        _per_rank(model, plan.per_rank, degree, plan.optional)
        for bank in banks.values():  # a stale vector can never be served: empty at every forward's ends
            model.register_forward_pre_hook(bank.clear)
            model.register_forward_hook(bank.clear)
    setattr(model, PIECES_ATTR, pieces)
    return pieces


__all__ = ["PIECES_ATTR", "GatherBank", "apply_tensor_parallel", "check_tensor_parallel"]
