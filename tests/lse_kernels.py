"""Attention kernels with the LSE bugs of 2026's ROCm kernels, and the worker methods that put them in place
of the CPU flash kernel (`WorkerGroup(methods=["lse_kernels"])`). Test-only.

Each bad kernel is the real CPU flash kernel with its LSE spoiled the way a known kernel spoils it:
- `base2`: AOTriton before 0.11 (pytorch#156012) returned log2 of the sum, not the natural log;
- `transposed`: ROCm flash-attn's varlen path, `(q_len, H)` where `(H, q_len)` is expected (vllm#57012),
  i.e. a kernel that hands back its own [B, H, S]: with S == H no shape can tell;
- `padded`: torch's varlen path on ROCm, a padded `[nseq, H, max_s]` (pytorch#187872), the padding garbage;
- `posinf_empty`: AITER's CK kernel, +inf for an empty key chunk (the real CPU kernel dies of SIGFPE there);
- `garbage`: an LSE that is no function of the scores at all (nothing can fix it: refused).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from rocm_parallel.backend.parallel import context, lse_check
from rocm_parallel.backend.runtime.transport import record
from rocm_parallel.backend.runtime.worker import handler

REAL_CPU_FLASH = context.cpu_flash_forward_op
PAD_TO = 32  # varlen's max_s: a multiple the probe's and the tests' sequences are all below or between


def bad_kernel(kind: str) -> Any:
    """The CPU flash kernel with the `kind` LSE bug (module docstring)."""

    def op(
        ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        if kind == "posinf_empty" and key.shape[1] == 0:
            b, s, h = query.shape[:3]
            out = query.new_zeros((b, s, h, value.shape[-1]))
            return out, torch.full((b, s, h), float("inf"))
        result = REAL_CPU_FLASH(ctx, query, key, value, *args, **kwargs)
        if not isinstance(result, tuple):
            return result
        out, lse = result  # [B, S, H], natural log
        if kind == "base2":
            lse = lse / math.log(2.0)
        elif kind == "transposed":
            lse = lse.transpose(1, 2).contiguous()
        elif kind == "padded":
            heads_first = lse.transpose(1, 2)
            pad = PAD_TO * math.ceil((heads_first.shape[-1] + 1) / PAD_TO) - heads_first.shape[-1]
            lse = torch.cat([heads_first, torch.full((*heads_first.shape[:2], pad), 1e4)], -1)
        elif kind == "garbage":
            lse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(0))
        return out, lse

    op.__name__ = f"cpu_flash_{kind}"
    return op


KINDS = ("base2", "transposed", "padded", "posinf_empty", "garbage")


@record
@dataclass(frozen=True)
class BadKernel:
    """Put the `kind` kernel in place of the CPU flash kernel on the ranks `ranks` (empty: every rank; the
    others get the real one); '' puts the real one back everywhere."""

    kind: str
    ranks: tuple[int, ...] = ()


@record
@dataclass(frozen=True)
class KernelFix:
    rank: int
    kernel: str
    fix: str  # LseFix.describe() of the resident ring model's kernel ('' when not adapted)


@handler("use_bad_kernel", BadKernel)
def use_bad_kernel(ctx: Any, request: BadKernel) -> None:
    bad = request.kind and (not request.ranks or ctx.rank in request.ranks)
    context.cpu_flash_forward_op = bad_kernel(request.kind) if bad else REAL_CPU_FLASH
    lse_check.clear_verdicts()


@handler("kernel_fix")
def kernel_fix(ctx: Any) -> KernelFix:
    """What the LSE guard did to the resident ring model's kernel."""
    kernel = ctx.resident.require()._rp_context_state.kernel
    fix = getattr(kernel.forward_op, "__lse_fix__", None)
    return KernelFix(
        ctx.rank, getattr(kernel.forward_op, "__name__", ""), "" if fix is None else fix.describe()
    )


def sharpen_attention(model: torch.nn.Module, factor: float = 20.0) -> torch.nn.Module:
    """Scale the q/k RMS-norm weights (0.05-sized in a random test model, which makes every attention row
    nearly uniform and every LSE about log(keys): then a base-2 or transposed LSE changes the merge by
    ~1e-5 only) to real models' order of 1: scores of order 1, LSEs that differ between queries and heads."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.rsplit(".", 2)[-2] in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
                p.mul_(factor)
    return model


@handler("sharpen_resident")
def sharpen_resident(ctx: Any) -> None:
    sharpen_attention(ctx.resident.require())


@record
@dataclass(frozen=True)
class MaskedRing:
    """One attention call through the resident ring model's context attention: global Q/K/V [B, S, H, D]
    (the same on every rank) split over the ring, keys valid where `valid` [S] is True."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    valid: torch.Tensor


@record
@dataclass(frozen=True)
class LocalOut:
    rank: int
    out: torch.Tensor


@handler("masked_ring_attention", MaskedRing)
def masked_ring_attention(ctx: Any, request: MaskedRing) -> LocalOut:
    model = ctx.resident.require()
    state = model._rp_context_state
    n, rank = ctx.world_size, ctx.rank
    q, k, v = (x.chunk(n, dim=1)[rank].contiguous() for x in (request.q, request.k, request.v))
    mask = request.valid.chunk(n)[rank].reshape(1, 1, 1, -1)
    state.masked = True  # what a family's padding hook decides for a forward with a text mask
    try:
        with torch.inference_mode():
            out = context.ContextAttention(state)(
                q, k, v, attn_mask=mask, parallel_config=model._parallel_config
            )
    finally:
        state.masked = False
    return LocalOut(rank, out)
