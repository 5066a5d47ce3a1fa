"""The numeric LSE guard: before the first ring merge on a device, the kernel is checked against float64.

Ring attention is only as right as the log-sum-exp (LSE) its kernel returns: the merge
`out = prev_out - sigmoid(lse - prev_lse) * (prev_out - out)` needs the natural log, one value per
(batch, query, head), in diffusers' `[B, S, H]` order. Kernels of 2026 differ in more than rank (lse.py
handles the rank): AOTriton before 0.11 returned a **base-2** LSE (pytorch#156012), torch's varlen path
on ROCm a **padded** `[nseq, H, max_s]` (pytorch#187872), ROCm flash-attn's varlen path `(q_len, H)`
where callers expect `(H, q_len)` (vllm#57012), and AITER's CK kernel **+inf** for an empty key chunk.
A base-2 or transposed LSE of the right rank passes any shape check and silently corrupts every merge,
and when S == H no shape can tell a transposed LSE at all. So this module checks numbers, not shapes:

1. `check_kernel` runs the kernel on two tiny problems, one with S != H and one with S == H, on the
   device and in the dtype the model computes in, against float64 attention of the same (rounded)
   inputs: `out` must agree, and the LSE must agree in one known layout (`[B, S, H]`; `[B, H, S]`,
   padded along S or not; `[H, B*S]`; `[B*S, H]`) in natural log or base 2 — the same layout in both
   problems. Then the per-chunk results of two (or `chunks`) key halves, merged by their LSEs, must equal
   attention over all the keys. The verdict is `ok` (nothing to do), `adapted` (a known fix: transpose,
   unpad, times ln 2) or `refused` (`KernelRefused`, naming the kernel and the remedy). Verdicts are
   cached per (device name, torch version, kernel, dtype, head size): one check per worker process.
2. `adapt_forward_op` applies the fix on every call, and answers an **empty key chunk** itself (output
   0, LSE -inf: the exact values, which the merge then weighs by 0). An empty chunk is never handed to a
   kernel: AITER's CK fills +inf there and torch's CPU flash kernel dies of SIGFPE (measured, torch 2.13).
   (diffusers' merge gives NaN if the *first*, local, chunk is empty and more follow; in this pack every
   rank holds at least one real image token, config.ParallelLayout.validate_sequence, so it never is.)
3. `guard_ring_kernel` is what context parallelism calls once the ring exists: the check above, then
   the same merge through the installed diffusers ring (`TemplatedRingAttention`) on the real group,
   the ranks agreeing on the outcome (one refusing rank makes every rank refuse, none hangs).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..config import ConfigError
from .lse import ForwardOp, exact_merge, guard_forward_op

LN2 = math.log(2.0)
# Two problems: S != H (and B, S, H, S_k all different, so a wrong layout cannot broadcast), and S == H.
PROBES: tuple[tuple[int, int, int], ...] = ((2, 6, 3), (1, 4, 4))  # (B, S, H); the head size is the model's
REMEDY = "use attention='math' (exact, slower), or a layout without ring attention (ulysses, tp or batch)"


class KernelRefused(ConfigError):
    """An attention kernel's numbers are wrong in a way the guard cannot fix: ring attention is refused."""


# --------------------------------------------------------------------------------------------------
# Layouts an LSE comes back in, each turned into [B, S, H] (None when the shape does not fit it)


def _squeezed(lse: torch.Tensor) -> torch.Tensor:
    return lse.squeeze(-1) if lse.ndim == 4 and lse.shape[-1] == 1 else lse


def _bsh(lse: torch.Tensor, b: int, s: int, h: int) -> torch.Tensor | None:
    lse = _squeezed(lse)
    if lse.ndim == 3 and lse.shape[0] == b and lse.shape[2] == h and lse.shape[1] >= s:
        return lse[:, :s]  # padded along S: the first S are the queries
    return None


def _bhs(lse: torch.Tensor, b: int, s: int, h: int) -> torch.Tensor | None:
    lse = _squeezed(lse)
    if lse.ndim == 3 and lse.shape[0] == b and lse.shape[1] == h and lse.shape[2] >= s:
        return lse[..., :s].transpose(1, 2)  # the kernel's own [B, H, S] (varlen: padded to max_s)
    return None


def _h_bs(lse: torch.Tensor, b: int, s: int, h: int) -> torch.Tensor | None:
    if lse.ndim == 2 and lse.shape[0] == h and lse.shape[1] >= b * s:
        return lse[:, : b * s].reshape(h, b, s).permute(1, 2, 0)  # varlen's [H, total_q]
    return None


def _bs_h(lse: torch.Tensor, b: int, s: int, h: int) -> torch.Tensor | None:
    if lse.ndim == 2 and lse.shape[0] == b * s and lse.shape[1] == h:
        return lse.reshape(b, s, h)  # varlen's (q_len, H)
    return None


LAYOUTS: dict[str, Callable[[torch.Tensor, int, int, int], torch.Tensor | None]] = {
    "[B, S, H]": _bsh,
    "[B, H, S]": _bhs,
    "[H, B*S]": _h_bs,
    "[B*S, H]": _bs_h,
}


@dataclass(frozen=True)
class LseFix:
    """How a kernel's LSE becomes the merge's: which layout it comes in, and whether it is base 2."""

    layout: str = "[B, S, H]"
    base2: bool = False
    padded: bool = False  # seen longer than S along S (varlen's max_s): only for `describe`

    @property
    def identity(self) -> bool:
        return self.layout == "[B, S, H]" and not self.base2 and not self.padded

    def apply(self, lse: torch.Tensor, b: int, s: int, h: int) -> torch.Tensor:
        fixed = LAYOUTS[self.layout](lse, b, s, h)
        if fixed is None:
            raise RuntimeError(
                f"the attention kernel returned an LSE of shape {tuple(lse.shape)} where its check found "
                f"{self.layout} (B={b}, S={s}, H={h}); the kernel changed behaviour after the check"
            )
        return fixed.float() * LN2 if self.base2 else fixed

    def describe(self) -> str:
        parts = [] if self.layout == "[B, S, H]" else [f"LSE laid out {self.layout} (reordered)"]
        parts += ["padded along S (cut to S)"] if self.padded else []
        return ", ".join([*parts, *(["base-2 LSE (times ln 2)"] if self.base2 else [])]) or "none"


def adapt_forward_op(forward_op: ForwardOp, fix: LseFix) -> ForwardOp:
    """`forward_op` (diffusers' forward-op convention, [B, S, H, D]) with its LSE made natural-log
    [B, S, H] by `fix`, and empty key chunks answered without the kernel. Adapting twice changes nothing."""
    inner = getattr(forward_op, "__lse_adapted__", forward_op)

    def adapted(
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: Any = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
        return_lse: bool = False,
        _save_ctx: bool = True,
        _parallel_config: Any = None,
    ) -> Any:
        b, s, h = query.shape[:3]
        if key.shape[1] == 0:  # no keys: attention's exact answer (sum of nothing, log of 0)
            out = query.new_zeros((b, s, h, value.shape[-1]))
            lse = torch.full((b, s, h), float("-inf"), dtype=torch.float32, device=query.device)
            return (out, lse) if return_lse else out
        result = inner(
            ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
            _save_ctx=_save_ctx, _parallel_config=_parallel_config,
        )  # fmt: skip
        if not return_lse or fix.identity:
            return result
        out, lse, *rest = result
        return (out, fix.apply(lse, b, s, h), *rest)

    adapted.__lse_adapted__ = inner  # type: ignore[attr-defined]
    adapted.__lse_fix__ = fix  # type: ignore[attr-defined]
    adapted.__name__ = f"lse_adapted_{getattr(inner, '__name__', 'op')}"
    return adapted


# --------------------------------------------------------------------------------------------------
# The check


@dataclass(frozen=True)
class KernelVerdict:
    """What the check found for one kernel on one device (plain data: `bench gpu` and `doctor` print it)."""

    kernel: str
    device: str  # the device's name ('NVIDIA H100 80GB HBM3', 'AMD Radeon RX 7900 XTX', 'cpu (x86_64)')
    torch: str
    dtype: str
    status: str  # 'ok', 'adapted' or 'refused'
    fix: LseFix | None
    detail: str
    out_error: float = float("nan")  # the largest |kernel - float64| over both problems
    lse_error: float = float("nan")  # the same for the LSE, after the fix
    merge_error: float = float("nan")  # merged key chunks against attention over all keys

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["fix"] = None if self.fix is None else self.fix.describe()
        return out


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({platform.machine() or 'unknown'})"


def tolerance(dtype: torch.dtype) -> float:
    """How far a kernel in `dtype` may be from float64 on these problems (values and LSEs of order 1-5):
    far below what a base-2 LSE (x 1.44) or a transposed one (other queries' values) is off by."""
    return {torch.float64: 1e-6, torch.float32: 1e-4, torch.float16: 1e-2}.get(dtype, 5e-2)


def probe_inputs(
    b: int, s: int, h: int, d: int, keys: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q [B, S, H, D], K/V [B, keys, H, D], the same on every rank (a CPU generator), with queries scaled
    per (query, head) so that LSEs differ along both axes (a transposed LSE cannot agree by chance)."""
    g = torch.Generator().manual_seed(1234 + 7 * s + h)
    q = torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
    q = q * (0.5 + torch.rand(b, s, h, 1, generator=g, dtype=torch.float64) * 2.0)
    k = torch.randn(b, keys, h, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, keys, h, d, generator=g, dtype=torch.float64)
    return tuple(x.to(device=device, dtype=dtype) for x in (q, k, v))  # type: ignore[return-value]


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention in float64 on the CPU: out [B, S, H, D] and the natural-log LSE [B, S, H]."""
    q, k, v = (x.detach().to("cpu", torch.float64).transpose(1, 2) for x in (q, k, v))
    scores = q @ k.transpose(-2, -1) * scale
    return (torch.softmax(scores, -1) @ v).transpose(1, 2), scores.logsumexp(-1).transpose(1, 2)


def _run(forward_op: ForwardOp, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> Any:
    result = forward_op(None, q, k, v, None, 0.0, False, scale, False, True, _save_ctx=False)
    if not isinstance(result, tuple) or len(result) < 2:
        raise RuntimeError(f"it returned {type(result).__name__}, not (out, lse)")
    return result[0], result[1]


def _error(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a.detach().to("cpu", torch.float64) - b).abs().max())


def _matching_fixes(lse: torch.Tensor, expected: torch.Tensor, tol: float) -> dict[LseFix, float]:
    b, s, h = expected.shape
    found = {}
    for layout, read in LAYOUTS.items():
        view = read(lse.detach(), b, s, h)
        if view is None:
            continue
        for base2 in (False, True):
            error = _error(view.double() * (LN2 if base2 else 1.0), expected)
            if error <= tol * max(1.0, float(expected.abs().max())):
                found[LseFix(layout, base2)] = error
    return found


_VERDICTS: dict[tuple[Any, ...], KernelVerdict] = {}


def clear_verdicts() -> None:
    """Forget every cached verdict (tests that patch a kernel in a worker)."""
    _VERDICTS.clear()


def check_kernel(
    name: str,
    forward_op: ForwardOp,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int = 64,
    chunks: int = 2,
) -> KernelVerdict:
    """Run `forward_op` on the two probe problems against float64 and decide (cached). Never raises for a
    kernel's failure: a refusal is a verdict (`require` turns it into the error)."""
    key = (device_name(device), torch.__version__, name, forward_op, dtype, head_dim, chunks)
    if key not in _VERDICTS:
        _VERDICTS[key] = _check(name, forward_op, device, dtype, head_dim, chunks)
    return _VERDICTS[key]


def _verdict(name: str, device: torch.device, dtype: torch.dtype, **fields: Any) -> KernelVerdict:
    return KernelVerdict(
        kernel=name, device=device_name(device), torch=torch.__version__, dtype=str(dtype).removeprefix("torch."),
        **fields,
    )  # fmt: skip


def _check(
    name: str, forward_op: ForwardOp, device: torch.device, dtype: torch.dtype, head_dim: int, chunks: int
) -> KernelVerdict:
    tol, scale = tolerance(dtype), head_dim**-0.5
    fixes: dict[LseFix, float] | None = None
    out_error, padded = 0.0, False
    for b, s, h in PROBES:
        q, k, v = probe_inputs(b, s, h, head_dim, s + 2, device, dtype)
        want_out, want_lse = reference(q, k, v, scale)
        try:
            out, lse = _run(forward_op, q, k, v, scale)
        except Exception as exc:  # a kernel that does not run here: unsupported dtype, head size, arch
            what = (
                f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
            )
            return _verdict(name, device, dtype, status="refused", fix=None, detail=f"it failed: {what}")
        out_error = max(out_error, _error(out, want_out))
        if not out_error <= tol:
            return _verdict(
                name, device, dtype, status="refused", fix=None, out_error=out_error,
                detail=f"its output differs from float64 attention by {out_error:.3g} (limit {tol:g}) on a "
                f"B={b}, S={s}, H={h} problem",
            )  # fmt: skip
        padded = padded or lse.numel() > want_lse.numel()
        found = _matching_fixes(lse, want_lse, tol)
        fixes = found if fixes is None else {f: max(e, fixes[f]) for f, e in found.items() if f in fixes}
        if not fixes:
            return _verdict(
                name, device, dtype, status="refused", fix=None, out_error=out_error,
                detail=f"its LSE (shape {tuple(lse.shape)} for B={b}, S={s}, H={h}) matches float64 attention's "
                f"in none of the known layouts ({', '.join(LAYOUTS)}; natural log or base 2)",
            )  # fmt: skip
    assert fixes
    best = min(fixes, key=lambda f: (not f.identity, f.base2, list(LAYOUTS).index(f.layout)))
    fix = dataclasses.replace(best, padded=padded)
    merge_error = local_merge_error(adapt_forward_op(forward_op, fix), device, dtype, head_dim, chunks)
    if not merge_error <= tol:
        return _verdict(
            name, device, dtype, status="refused", fix=fix, out_error=out_error, lse_error=fixes[best],
            merge_error=merge_error,
            detail=f"{chunks} key chunks merged by its LSE differ from attention over all keys by "
            f"{merge_error:.3g} (limit {tol:g})",
        )  # fmt: skip
    return _verdict(
        name, device, dtype, status="ok" if fix.identity else "adapted", fix=fix, out_error=out_error,
        lse_error=fixes[best], merge_error=merge_error,
        detail="out and LSE agree with float64" if fix.identity else f"adapted: {fix.describe()}",
    )  # fmt: skip


def _chunked_problem(
    device: torch.device, dtype: torch.dtype, head_dim: int, chunks: int
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Queries, `chunks` K/V chunks of the ring's size, and float64 attention over all their keys."""
    b, s, h = PROBES[1]  # S == H: the case only numbers can tell
    q, k, v = probe_inputs(b, s, h, head_dim, s * chunks, device, dtype)
    want, _ = reference(q, k, v, head_dim**-0.5)
    return q, list(zip(k.chunk(chunks, dim=1), v.chunk(chunks, dim=1), strict=True)), want


def local_merge_error(
    forward_op: ForwardOp, device: torch.device, dtype: torch.dtype, head_dim: int, chunks: int
) -> float:
    """Each key chunk through the kernel, combined by its LSE as the merge must (lse.exact_merge), against
    attention over all keys. No group needed; `guard_ring_kernel` repeats it through the installed ring."""
    q, pieces, want = _chunked_problem(device, dtype, head_dim, chunks)
    results = [_run(forward_op, q, k, v, head_dim**-0.5) for k, v in pieces]
    merged = exact_merge([o.double().cpu() for o, _ in results], [lse.double().cpu() for _, lse in results])
    return _error(merged, want)


def require(verdict: KernelVerdict) -> KernelVerdict:
    if verdict.status == "refused":
        raise KernelRefused(
            f"ring attention refused: the attention kernel {verdict.kernel!r} on {verdict.device} (torch "
            f"{verdict.torch}, {verdict.dtype}) failed the LSE guard's numeric check: {verdict.detail}. "
            f"Ring merges would be wrong; {REMEDY}"
        )
    return verdict


# --------------------------------------------------------------------------------------------------
# On the ring


def _replay_op(
    forward_op: ForwardOp, q: torch.Tensor, pieces: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> ForwardOp:
    """A forward op for the installed ring: call i computes the real kernel on chunk i of the probe
    (ignoring the K/V the ring exchanged, so every rank merges the same problem)."""
    calls = itertools.count()

    def op(
        ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        k, v = pieces[next(calls) % len(pieces)]
        return forward_op(ctx, q, k, v, *args, **{**kwargs, "_save_ctx": False})

    return op


def ring_merge_error(
    forward_op: ForwardOp, parallel_config: Any, device: torch.device, dtype: torch.dtype, head_dim: int,
    chunks: int,
) -> float:  # fmt: skip
    """The probe's key chunks merged by diffusers' own ring (`TemplatedRingAttention`) on the real group,
    against float64 attention over all keys. Collective over the ring."""
    from diffusers.models.attention_dispatch import TemplatedRingAttention

    from .comm import WaitCollectives

    q, pieces, want = _chunked_problem(device, dtype, head_dim, chunks)
    op = _replay_op(forward_op, q, pieces)
    with WaitCollectives(), torch.no_grad():  # the op ignores the gathered K/V: nothing else would wait
        out = TemplatedRingAttention.apply(
            q, q, q, None, 0.0, False, head_dim**-0.5, False, False, op, None, parallel_config
        )
    return _error(out, want)


def _agree(refused: bool, group: Any, device: torch.device) -> bool:
    """True when any rank of `group` refused (every rank learns it: none waits in a collective alone)."""
    if group is None or not dist.is_initialized():
        return refused
    flag = torch.tensor([1 if refused else 0], dtype=torch.int32)
    if dist.get_backend(group) != "gloo":  # NCCL/RCCL collectives take device tensors
        flag = flag.to(device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def guard_ring_kernel(
    kernel: Any, parallel_config: Any, device: torch.device, dtype: torch.dtype, lse_shape: str, head_dim: int
) -> Any:
    """The kernel ring attention will use (context.AttentionKernel), checked numerically on this device
    and returned with its fix applied, or KernelRefused on every rank. Collective over the context group.
    On the meta device (sizing) there are no numbers: the kernel is returned as is."""
    if device.type == "meta":
        return kernel
    cp_config = parallel_config.context_parallel_config
    chunks = cp_config.ring_degree
    group = cp_config._flattened_mesh.get_group()
    verdict = check_kernel(kernel.name, kernel.forward_op, device, dtype, head_dim, chunks)
    if _agree(verdict.status == "refused", group, device):
        require(verdict)
        raise KernelRefused(
            f"ring attention refused: another rank's attention kernel failed the LSE guard's numeric check "
            f"(its error names it); this rank's {verdict.kernel!r} on {verdict.device}: {verdict.detail}"
        )
    assert verdict.fix is not None
    adapted = adapt_forward_op(kernel.forward_op, verdict.fix)
    error = ring_merge_error(
        guard_forward_op(adapted, lse_shape), parallel_config, device, dtype, head_dim, chunks
    )
    tol = tolerance(dtype)
    refused = not error <= tol
    if _agree(refused, group, device):
        raise KernelRefused(
            f"ring attention refused: the attention kernel {verdict.kernel!r} on {verdict.device} (torch "
            f"{verdict.torch}, {verdict.dtype}) passed the LSE guard alone, but diffusers' ring merge of "
            f"{chunks} key chunks "
            + (
                f"differs from attention over all keys by {error:.3g} (limit {tol:g})"
                if refused
                else "failed on another rank"
            )
            + f"; {REMEDY}"
        )
    return dataclasses.replace(kernel, forward_op=adapted)
