"""Megatron-style tensor parallelism for diffusers transformers, declared as a plan: the generic machinery.

Each family brings a `TensorParallelSpec` (its folder's tp.py: FLUX.1's `FLUX_TP_PLAN` in
backend/flux/tp.py): module path -> split kind, plus the block forwards that replace a block's own. This
module applies any such spec. Beyond diffusers' own `_tp_plan` (and why it is written by hand):

* The AdaLN modulation linears (`Gathered`; 3.23 B of FLUX.1-dev's 11.9 B parameters) are sharded too.
  Every one of them reads the same `silu(temb)`, so all are evaluated right after the time embedding and
  their shards are all-gathered in **one** small collective per forward (`ModulationBank`). diffusers
  replicates them: 6.45 GB of bf16 on every GPU for FLUX.1-dev.
* A family's block forward may reduce several row-parallel outputs at once (`Row(reduce=False)` +
  `reduce_streams`): FLUX's double-stream blocks reduce the image and text streams together, two
  all-reduces per block instead of four (FLUX.1-dev: 76 per forward instead of 114).
* It runs on CPU/gloo, on the meta device and under the `fake` process group; diffusers' native TP
  refuses CPU and needs DTensor.

Column-parallel layers keep the diffusers module (a narrower nn.Linear), so the attention processor
runs unchanged: it reshapes by head_dim and lets -1 absorb the local head count.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError, ModelDims, validate_tp_degree
from .comm import all_gather_single
from .splits import (  # the split kinds and slicing, torch-free for the planner; re-exported here
    Column,
    Gathered,
    NormAcrossHeads,
    PackedColumn,
    PackedRow,
    Pieces,
    Row,
    Split,
    Vocab,
    shard_pieces,
    vocab_range,
)
from .vocab import VocabParallelEmbedding
from .weights import layer_dtype, linear_weight

# --------------------------------------------------------------------------------------------------
# Resolving a plan against a model. The split kinds and `shard_pieces` (which part of a full tensor a
# rank keeps) are splits.py's, torch-free for the planner.


def parameter_pieces(
    resolved: Mapping[str, Split],
    name: str,
    full_shape: tuple[int, ...],
    rank: int,
    degree: int,
    dims: ModelDims,
) -> Pieces | None:
    """The slice of parameter `name` (e.g. 'transformer_blocks.0.attn.to_q.weight') that `rank` keeps.

    `resolved` is `resolve_plan(model, plan)`; None means the rank keeps the whole tensor (replicated
    modules, row-parallel biases, degree 1). The checkpoint loader reads exactly this from disk.
    """
    module, _, param = name.rpartition(".")
    split = resolved.get(module)
    if split is None or degree == 1:
        return None
    return shard_pieces(split, param, full_shape, rank, degree, dims)


def _pattern(path: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(path).replace(r"\*", r"[^.]+") + "$")


def resolve_plan(model: nn.Module, plan: Mapping[str, Any], optional: Collection[str] = ()) -> dict[str, Any]:
    """Module name -> plan entry for every module the plan names; each plan key must match something, except
    the `optional` ones (modules some checkpoints of the family have and others not)."""
    names = [name for name, _ in model.named_modules()]
    resolved: dict[str, Any] = {}
    for key, value in plan.items():
        rx = _pattern(key)
        hits = [n for n in names if rx.match(n)]
        if not hits and key in optional:
            continue
        if not hits:
            raise ValueError(
                f"tensor-parallel plan entry '{key}' matches no module of {type(model).__name__}"
            )
        resolved.update(dict.fromkeys(hits, value))
    return resolved


# --------------------------------------------------------------------------------------------------
# Parallel modules


class RowParallelLinear(nn.Linear):
    """nn.Linear over a slice of the input features; sums partial results across the group."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, group: Any, reduce: bool) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight, self.bias = weight, bias
        self.group, self.reduce = group, reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, linear_weight(self, x.dtype))
        if not self.reduce:
            return y  # partial sum without bias: the owning block reduces it (see reduce_streams)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, reduce={self.reduce}"


class GatheredLinear(nn.Linear):
    """A shard of an AdaLN modulation linear; returns the full vector that ModulationBank gathered."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, group: Any, degree: int) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight, self.bias = weight, bias
        self.group, self.degree = group, degree
        self.gathered: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gathered is not None and self.gathered.shape[0] == x.shape[0]:
            return self.gathered
        # Called outside a model forward (or with another batch): gather this layer alone.
        return gather_modulation([self], x, self.group, self.degree)[0]


def gather_modulation(
    layers: list[GatheredLinear], x: torch.Tensor, group: Any, degree: int
) -> list[torch.Tensor]:
    """Evaluate the shards of `layers` on x and rebuild each full output with one all-gather."""
    local = [F.linear(x.to(layer_dtype(m)), linear_weight(m, layer_dtype(m)), m.bias) for m in layers]
    return gather_last_dim(local, group, degree)


def gather_last_dim(outputs: list[torch.Tensor], group: Any, degree: int) -> list[torch.Tensor]:
    """Several outputs split along their last dimension across the group (each rank holds its contiguous
    slice of each, all of one shape but the last dimension) -> the whole outputs, with one all-gather."""
    local = torch.cat(outputs, dim=-1)
    flat = local.new_empty((degree * local.shape[0], *local.shape[1:]))  # backends want rank-major rows
    all_gather_single(flat, local.contiguous(), group=group)
    gathered = flat.view(degree, *local.shape)
    outs, offset = [], 0
    for out in outputs:
        width = out.shape[-1]
        piece = gathered[..., offset : offset + width]  # [degree, ..., width]
        outs.append(piece.movedim(0, -2).reshape(*local.shape[:-1], degree * width))
        offset += width
    return outs


class ModulationBank:
    """Computes every AdaLN modulation vector of one forward with a single all-gather.

    Filled by a hook on the spec's `modulation_source` (FLUX.1: `time_text_embed`; its output `temb` is
    the only input of every AdaLN linear), emptied when the model forward starts and ends, so a stale
    vector can never be used.
    """

    def __init__(self, layers: list[GatheredLinear], group: Any, degree: int) -> None:
        self.layers, self.group, self.degree = layers, group, degree

    def fill(self, temb: torch.Tensor) -> None:
        for m, full in zip(
            self.layers, gather_modulation(self.layers, F.silu(temb), self.group, self.degree), strict=True
        ):
            m.gathered = full

    def clear(self) -> None:
        for m in self.layers:
            m.gathered = None


class HeadShardedRMSNorm(nn.Module):
    """RMS norm over a width split across the tp group (`NormAcrossHeads`): x * rsqrt(mean(x^2) + eps) *
    weight, the mean's sum of squares all-reduced over the group's slices, computed in float32 as
    torch's rms_norm accumulates it."""

    def __init__(self, weight: nn.Parameter | None, eps: float | None, width: int, group: Any) -> None:
        super().__init__()
        self.weight, self.eps, self.width, self.group = weight, eps, width, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        squares = x.float().pow(2).sum(-1, keepdim=True)
        dist.all_reduce(squares, group=self.group)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        out = (x.float() * torch.rsqrt(squares / self.width + eps)).to(x.dtype)
        return out if self.weight is None else out * self.weight.to(x.dtype)

    def extra_repr(self) -> str:
        return f"width={self.width}, local={self.weight.shape[0] if self.weight is not None else '?'}, eps={self.eps}"


def reduce_streams(
    partials: list[torch.Tensor], layers: list[RowParallelLinear], group: Any
) -> list[torch.Tensor]:
    """One all-reduce for several row-parallel partial sums [B, S_i, D]; adds each layer's bias."""
    flat = torch.cat(partials, dim=1)
    dist.all_reduce(flat, group=group)
    outs = flat.split([p.shape[1] for p in partials], dim=1)
    return [o if m.bias is None else o + m.bias for o, m in zip(outs, layers, strict=True)]


# --------------------------------------------------------------------------------------------------
# A family's spec


@dataclass(frozen=True)
class BlockForward:
    """A forward that replaces a block's own under TP (bound to the block, which gets `tp_group`).

    Such a forward reduces several Row(reduce=False) partial sums together (`reduce_streams`);
    `reductions` is how many all-reduces one call issues, so the planner counts collectives from data.
    """

    forward: Callable[..., Any]
    reductions: int


@dataclass(frozen=True)
class TensorParallelSpec:
    """Everything model-specific about tensor parallelism, as data (a family's `tp`).

    - `plan`: module path (``*`` = one path component) -> split kind; the loader reads the same plan to
      slice the file.
    - `block_forwards`: module path -> the BlockForward that replaces that block's forward.
    - `modulation_source`: the module whose output `temb` feeds every Gathered linear (through silu):
      the ModulationBank evaluates them all right after it.
    - `attention_processors`: the diffusers processor classes (by name) whose math is shard-safe.
    - `optional`: plan keys a model of the family may lack (Wan's image cross-attention, in its I2V
      checkpoints only); every other key must name a module.
    """

    plan: Mapping[str, Split]
    block_forwards: Mapping[str, BlockForward]
    modulation_source: str
    attention_processors: tuple[str, ...]
    optional: tuple[str, ...] = ()

    def resolve(self, model: nn.Module) -> dict[str, Split]:
        """Module name -> split kind for `model` (`resolve_plan` of the plan)."""
        return resolve_plan(model, self.plan, self.optional)


# --------------------------------------------------------------------------------------------------
# Applying a plan


@dataclass(frozen=True)
class TensorParallelInfo:
    degree: int
    rank: int


def _split_module(
    module: nn.Module, split: Split, rank: int, degree: int, dims: ModelDims, group: Any
) -> nn.Module:
    """A new (or narrowed) module holding only this rank's shard of `module`'s parameters."""
    if isinstance(split, NormAcrossHeads):
        return _split_norm(module, rank, degree, dims, group)
    if isinstance(split, Vocab):
        return _split_embedding(module, rank, degree, group)
    if not isinstance(module, nn.Linear):
        raise TypeError(
            f"tensor-parallel plan names a {type(module).__name__} as {type(split).__name__}; only nn.Linear "
            "can be split that way (an RMS norm across heads is NormAcrossHeads)"
        )

    def shard(param: str) -> nn.Parameter | None:
        tensor = getattr(module, param)
        if tensor is None:
            return None
        pieces = shard_pieces(split, param, tuple(tensor.shape), rank, degree, dims)
        return nn.Parameter(
            tensor.detach() if pieces is None else pieces.take(tensor.detach()), requires_grad=False
        )

    weight, bias = shard("weight"), shard("bias")
    if isinstance(split, Column | PackedColumn):
        module.weight, module.bias, module.out_features = weight, bias, weight.shape[0]
        return module
    if isinstance(split, Gathered):
        return GatheredLinear(weight, bias, group, degree)
    reduce = split.reduce if isinstance(split, Row) else True
    return RowParallelLinear(weight, bias, group, reduce)


def _split_norm(module: nn.Module, rank: int, degree: int, dims: ModelDims, group: Any) -> nn.Module:
    """A `NormAcrossHeads` entry: torch's RMSNorm over the full width, as this rank's slice."""
    shape = getattr(module, "normalized_shape", None)
    if not isinstance(module, nn.RMSNorm) or shape is None or len(shape) != 1:
        raise TypeError(
            f"tensor-parallel plan names a {type(module).__name__} as NormAcrossHeads; it must be a torch "
            "RMSNorm over one dimension (diffusers' qk_norm 'rms_norm_across_heads')"
        )
    width = int(shape[0])
    weight = module.weight
    if weight is not None:
        pieces = shard_pieces(NormAcrossHeads(), "weight", tuple(weight.shape), rank, degree, dims)
        assert pieces is not None
        weight = nn.Parameter(pieces.take(weight.detach()), requires_grad=False)
    return HeadShardedRMSNorm(weight, module.eps, width, group)


def _split_embedding(module: nn.Module, rank: int, degree: int, group: Any) -> nn.Module:
    """A `Vocab` entry: this rank's block of an nn.Embedding's rows (parallel/vocab.py)."""
    if not isinstance(module, nn.Embedding):
        raise TypeError(
            f"tensor-parallel plan names a {type(module).__name__} as Vocab; it must be an nn.Embedding"
        )
    size = module.weight.shape[0]
    start, stop = vocab_range(size, rank, degree)
    weight = nn.Parameter(module.weight.detach()[start:stop].clone(), requires_grad=False)
    return VocabParallelEmbedding(weight, start, size, group, getattr(module, "out_dtype", None))


def check_tensor_parallel_ready(model: nn.Module, spec: TensorParallelSpec) -> None:
    """Everything that would make sharding wrong, checked before a single weight is touched."""
    if getattr(model, "_rp_tensor_parallel", None) is not None:
        raise ValueError(
            "this model is already tensor-parallel; build or load a fresh one to change the layout"
        )
    for name, module in model.named_modules():
        if getattr(module, "fused_projections", False):
            raise ValueError(f"'{name}' has fused QKV projections; call model.unfuse_qkv_projections() first")
        processor = getattr(module, "processor", None)
        if processor is not None and type(processor).__name__ not in spec.attention_processors:
            raise ValueError(
                f"'{name}' uses {type(processor).__name__}; tensor parallelism needs "
                f"{' or '.join(spec.attention_processors)} (IP-Adapter, KV-cache and custom processors "
                "are not supported)"
            )


def apply_tensor_parallel(
    model: nn.Module, group: Any, spec: TensorParallelSpec, dims: ModelDims
) -> nn.Module:
    """Shard `model` in place across `group` (None: the world) and return it, following `spec` (the model's
    family's `tp`) for a model of `dims` (its `dims(config)`): the caller that knows the family passes both
    down (`ModelFamily.tensor_parallel`), nothing here looks a family up.

    Works on materialized weights (each rank keeps its slice) and on the meta device (shapes only).
    All ranks must call it on identical models. Degree 1 leaves the model untouched.
    """
    check_tensor_parallel_ready(model, spec)
    degree, rank = dist.get_world_size(group), dist.get_rank(group)
    validate_tp_degree(degree, dims)
    if degree == 1:
        model._rp_tensor_parallel = TensorParallelInfo(1, 0)
        return model

    gathered: list[GatheredLinear] = []
    for name, split in spec.resolve(model).items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        new = _split_module(parent.get_submodule(child), split, rank, degree, dims, group)
        setattr(parent, child, new)  # also right for ModuleList children such as to_out.0
        if isinstance(new, GatheredLinear):
            gathered.append(new)

    for name, replacement in resolve_plan(model, spec.block_forwards).items():
        block = model.get_submodule(name)
        block.tp_group = group
        block.forward = replacement.forward.__get__(block)

    for module in model.modules():  # keep the attention modules' bookkeeping honest
        # diffusers' shared `Attention` (Qwen-Image) has no `head_dim`; diffusers 0.37's Qwen processor
        # unflattens the local projection by `attn.heads`, newer ones by `inner_dim // heads`: both hold
        # when heads and inner_dim shrink together
        if hasattr(module, "heads") and hasattr(module, "inner_dim"):
            module.heads //= degree
            module.inner_dim //= degree
            if getattr(module, "inner_kv_dim", None):
                module.inner_kv_dim //= degree
            if hasattr(module, "mlp_hidden_dim"):
                # FLUX.2's single-block processor splits its local projection in the proportion
                # 3 x inner_dim : 2 x mlp_hidden_dim; both must shrink alike.
                module.mlp_hidden_dim //= degree

    if gathered:  # a family whose plan shards modulation linears: one all-gather per forward for all
        bank = ModulationBank(gathered, group, degree)
        source = model.get_submodule(spec.modulation_source)
        source.register_forward_hook(lambda _m, _i, temb: bank.fill(temb))
        model.register_forward_pre_hook(lambda *_: bank.clear())
        model.register_forward_hook(lambda *_: bank.clear())
        model._rp_modulation_bank = bank
    model._rp_tensor_parallel = TensorParallelInfo(degree, rank)
    return model


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of parameters this process holds (meta tensors count their would-be size)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


__all__ = [
    "BlockForward",
    "Column",
    "ConfigError",
    "Gathered",
    "GatheredLinear",
    "HeadShardedRMSNorm",
    "ModulationBank",
    "NormAcrossHeads",
    "PackedColumn",
    "PackedRow",
    "Pieces",
    "Row",
    "RowParallelLinear",
    "TensorParallelSpec",
    "Vocab",
    "apply_tensor_parallel",
    "gather_last_dim",
    "parameter_bytes",
    "parameter_pieces",
    "reduce_streams",
    "resolve_plan",
    "shard_pieces",
]
