"""The LSE guard: ring attention merges partial results correctly whatever LSE shape a kernel returns.

Ring attention computes attention of the local queries against one K/V chunk at a time and merges the
partial outputs by their log-sum-exp (LSE):

    out = prev_out - sigmoid(lse - prev_lse) * (prev_out - out)

`out` is `[B, S, H, D]`, so the merge needs `lse` as `[B, S, H, 1]`. Kernels disagree on what they
return: flash SDPA (ROCm's AOTriton path, flash-attn) gives `[B, S, H]` after diffusers' transpose, cuDNN
on torch >= 2.9 a trailing 1. diffusers <= 0.37 unsqueezed only when torch < 2.9, so on torch >= 2.9 a
3-D LSE reached the merge and the first denoising step failed with `The size of tensor a (24) must match
the size of tensor b (128) at non-singleton dimension 3`. diffusers 0.38 (ring) and 0.40 (ring_anything)
key the unsqueeze on `lse.ndim == 3` instead and accept both.

The guard never looks at a version. It *probes* the merge that will actually run: feed it a synthetic
kernel that returns a 3-D LSE, then one that returns a 4-D LSE, and compare with the exact merge. The
result is the LSE shape the merge accepts (`ANY`, `NEEDS_3D` or `NEEDS_4D`), and `guard_forward_op` wraps a
kernel so its LSE has that rank — returning the kernel unchanged for `ANY`, i.e. a no-op on diffusers that
already handle it. Wrapping twice changes nothing (idempotent).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

ANY = "any"  # the merge accepts [B, S, H] and [B, S, H, 1]: nothing to guard
NEEDS_3D = "3d"  # the merge adds the trailing 1 itself (diffusers <= 0.37 on torch < 2.9)
NEEDS_4D = "4d"  # the merge uses the LSE as is (diffusers <= 0.37 on torch >= 2.9: the ROCm failure)

ForwardOp = Callable[..., Any]
RunRing = Callable[[ForwardOp], torch.Tensor]

# Probe shapes: B, S, H, D all different so that a 3-D LSE cannot silently broadcast against [B, S, H, D].
_PROBE_SHAPE = (1, 2, 3, 5)


def lse_to_rank(lse: torch.Tensor, rank: int) -> torch.Tensor:
    """`[B, S, H]` <-> `[B, S, H, 1]` by shape; any other shape is a kernel we do not understand."""
    if lse.ndim == rank:
        return lse
    if rank == 4 and lse.ndim == 3:
        return lse.unsqueeze(-1)
    if rank == 3 and lse.ndim == 4 and lse.shape[-1] == 1:
        return lse.squeeze(-1)
    raise ValueError(
        f"an attention kernel returned an LSE of shape {tuple(lse.shape)}; expected [B, S, H] or [B, S, H, 1]"
    )


def guard_forward_op(forward_op: ForwardOp, lse_shape: str) -> ForwardOp:
    """Wrap a diffusers-style attention forward op so the LSE it returns has the rank the merge needs."""
    if lse_shape not in (ANY, NEEDS_3D, NEEDS_4D):
        # (the message keeps its historical 'layout=' wording)
        raise ValueError(f"layout={lse_shape!r} is not one of {ANY!r}, {NEEDS_3D!r}, {NEEDS_4D!r}")
    inner = getattr(forward_op, "__lse_guarded__", forward_op)  # idempotent: never wrap a wrapper
    if lse_shape == ANY:
        return inner
    rank = 3 if lse_shape == NEEDS_3D else 4

    def guarded(*args: Any, **kwargs: Any) -> Any:
        result = inner(*args, **kwargs)
        if isinstance(result, tuple):  # (out, lse): ring asks for the LSE; Ulysses does not
            out, lse, *rest = result
            return (out, lse_to_rank(lse, rank), *rest)
        return result

    guarded.__lse_guarded__ = inner  # type: ignore[attr-defined]
    guarded.__lse_shape__ = lse_shape  # type: ignore[attr-defined]
    guarded.__name__ = f"lse_guarded_{getattr(inner, '__name__', 'op')}"
    return guarded


def _synthetic_partials(chunks: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Partial outputs and LSEs that differ per chunk and per position (so weights are not uniform)."""
    b, s, h, d = _PROBE_SHAPE
    outs = [
        torch.arange(b * s * h * d, dtype=torch.float32).reshape(b, s, h, d) * (i + 1) / 10
        for i in range(chunks)
    ]
    lses = [torch.linspace(-1.0, 1.0, b * s * h).reshape(b, s, h) * (i - 0.5) for i in range(chunks)]
    return outs, lses


def exact_merge(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """The softmax-weighted combination the ring merge must reproduce: sum_i exp(lse_i - LSE) * out_i."""
    weights = torch.softmax(torch.stack(lses), dim=0).unsqueeze(-1)
    return (weights * torch.stack(outs)).sum(0)


def synthetic_forward_op(rank: int, chunks: int) -> ForwardOp:
    """A stand-in attention kernel for the probe: returns chunk i's synthetic (out, lse), LSE of `rank` dims.

    It ignores Q/K/V (so the probe's answer does not depend on what the ring exchanged) and counts calls.
    """
    outs, lses = _synthetic_partials(chunks)
    calls = itertools.count()

    def op(ctx: Any, query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        i = next(calls) % chunks
        out, lse = outs[i].to(query.device), lse_to_rank(lses[i], rank).to(query.device)
        return (out, lse)

    return op


def probe_merge_shape(run_ring: RunRing, chunks: int) -> str:
    """Which LSE rank does the ring merge behind `run_ring` accept? Decided by running it, never by versions.

    `run_ring(forward_op)` must run the ring once over `chunks` K/V chunks with `forward_op` as the kernel,
    on queries of shape `probe_query_shape()`, and return the merged output.
    """
    outs, lses = _synthetic_partials(chunks)
    expected = exact_merge(outs, lses)
    accepts = {}
    for rank in (3, 4):
        try:
            merged = run_ring(synthetic_forward_op(rank, chunks))
            accepts[rank] = merged.shape == expected.shape and torch.allclose(
                merged.float().cpu(), expected, atol=1e-5, rtol=1e-5
            )
        except RuntimeError:  # the shape mismatch of a merge that does not handle this rank
            accepts[rank] = False
    if accepts[3] and accepts[4]:
        return ANY
    if accepts[3]:
        return NEEDS_3D
    if accepts[4]:
        return NEEDS_4D
    raise RuntimeError(
        "the installed ring-attention merge gave a wrong result for both LSE layouts [B, S, H] and "
        "[B, S, H, 1]; this diffusers version is not supported for ring attention "
        "(use ulysses_degree instead)"
    )


def probe_query_shape() -> tuple[int, int, int, int]:
    """The [B, S, H, D] shape `run_ring` must use for its queries and keys."""
    return _PROBE_SHAPE
