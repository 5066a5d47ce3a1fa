"""A worker method for the NormAcrossHeads test (`WorkerGroup(methods=["norm_methods"])`): a toy attention
projection with an RMS norm over all heads, tensor-parallel over the world group, against the whole model
computed on each rank. Test-only: not in the package."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from rocm_parallel.backend.config import ModelDims
from rocm_parallel.backend.parallel.tensor import (
    Column,
    NormAcrossHeads,
    Row,
    TensorParallelSpec,
    apply_tensor_parallel,
)
from rocm_parallel.backend.runtime.transport import record
from rocm_parallel.backend.runtime.worker import WorkerContext, handler


class HeadsNormed(nn.Module):
    """q = RMSNorm_over_all_heads(to_q(x)); out = to_out(q): Wan's norm_q between two TP-split linears."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.to_q = nn.Linear(hidden, hidden)
        self.norm_q = nn.RMSNorm(hidden, eps=1e-6, elementwise_affine=True)
        self.to_out = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.to_out(self.norm_q(self.to_q(x)))


@record
@dataclass(frozen=True)
class NormCheck:
    split_norm: bool  # False: leave the norm whole on each rank's slice (what NormAcrossHeads prevents)


@record
@dataclass(frozen=True)
class NormDiff:
    max_diff: float
    all_reduces: int


@handler("norm_across_heads", NormCheck)
def norm_across_heads(ctx: WorkerContext, request: NormCheck) -> NormDiff:
    torch.manual_seed(0)
    hidden = 32
    model = HeadsNormed(hidden)
    with torch.no_grad():
        model.norm_q.weight.copy_(torch.rand(hidden) + 0.5)
    x = torch.randn(2, 5, hidden)
    with torch.no_grad():
        want = model(x)
    plan = {"to_q": Column(), "to_out": Row()}
    if request.split_norm:
        plan["norm_q"] = NormAcrossHeads()
    spec = TensorParallelSpec(plan=plan, block_forwards={}, modulation_source="", attention_processors=())
    dims = ModelDims(heads=4, head_dim=8, mlp=hidden, text_dim=hidden, token_channels=hidden)
    apply_tensor_parallel(model, None, spec, dims)
    if not request.split_norm:  # the mistake NormAcrossHeads prevents: each rank's slice normed by itself
        rank, width = dist.get_rank(), hidden // dist.get_world_size()
        norm = model.norm_q
        norm.weight = nn.Parameter(norm.weight.detach()[rank * width : (rank + 1) * width].clone())
        norm.normalized_shape = (width,)
    calls = []
    real = dist.all_reduce

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_reduce = counted
    try:
        with torch.no_grad():
            got = model(x)
    finally:
        dist.all_reduce = real
    return NormDiff(float((got - want).abs().max()), len(calls))
