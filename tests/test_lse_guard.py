"""The LSE guard on two real ranks: a ring merge that needs the rank fixed, and kernels whose numbers are wrong.

diffusers 0.42.1 merges both LSE layouts itself, so on this machine the guard's probe finds nothing to do
(test_context_parallel.py checks that) and removing the probe changes no other test. Here the ring merge
of diffusers <= 0.37 on torch >= 2.9 (the ROCm bug: the kernel's [B, S, H] LSE reaches the merge as is)
is put back into diffusers' own `TemplatedRingAttention.forward` on both workers (tests/worker_jobs.py
`old_ring_merge`). The probe must find that this merge needs a 4-D LSE, the guard must be installed, and
the ring=2 forward must match the single-process forward.

Then the numeric check (backend/parallel/lse_check.py): the CPU flash kernel is replaced on both workers
by one with each known LSE bug of 2026's ROCm kernels (tests/lse_kernels.py: base 2, transposed with
S == H, padded varlen, +inf for an empty key chunk, and an unfixable one); each is fixed (the ring-2
forward matches the one-process forward) or refused with the kernel's name and the remedy.
"""

from __future__ import annotations

import pytest
import torch
from lse_kernels import BadKernel, MaskedRing, bad_kernel, sharpen_attention
from model_methods import BuildRandom, Inputs
from test_context_parallel import CONFIG, reference
from worker_jobs import OldMerge

from rocm_parallel.backend.flux.dims import FluxDims
from rocm_parallel.backend.flux.model import build_flux
from rocm_parallel.backend.parallel.context import cpu_flash_forward_op, math_forward_op
from rocm_parallel.backend.parallel.lse import NEEDS_4D
from rocm_parallel.backend.parallel.lse_check import (
    KernelRefused,
    LseFix,
    adapt_forward_op,
    check_kernel,
    device_name,
    require,
)
from rocm_parallel.backend.runtime.client import WorkerError, WorkerGroup
from rocm_parallel.testing.models import random_inputs

pytestmark = pytest.mark.torch_api


@pytest.fixture
def old_merge(group2: WorkerGroup):
    group2.call_all("old_ring_merge", OldMerge(on=True))
    try:
        yield group2
    finally:
        group2.call_all("old_ring_merge", OldMerge(on=False))  # the session group's later tests need 0.42's


def test_the_guard_makes_an_old_ring_merge_exact(old_merge: WorkerGroup) -> None:
    """Mutation tried: without `probe_ring` in `apply_context_parallel` (lse_shape stays 'any') every rank
    raised 'The size of tensor a (8) must match the size of tensor b (16) at non-singleton dimension 3'
    in the forward and this test failed."""
    inputs, expected = reference(CONFIG, batch=1, height=64, width=64, text_tokens=16)
    old_merge.call_all("build_random", BuildRandom(CONFIG, 7, "float32", ring=2))
    out = old_merge.call("forward", Inputs(inputs)).output
    assert out.shape == expected.shape
    assert (out - expected).abs().max().item() <= 1e-5
    states = old_merge.call_all("context_state")
    assert [s.lse_shape for s in states] == [NEEDS_4D, NEEDS_4D]  # the guard is installed on every rank
    # The negative control: the same merge with the guard off fails as on ROCm, so it did need the guard.
    unguarded = old_merge.call_all("forward_unguarded")
    for reply in unguarded:
        assert (
            "must match the size of tensor b" in reply.error and "at non-singleton dimension 3" in reply.error
        )


# ------------------------------------------------------------------ the numeric check (lse_check.py)

# Local sequence 8 = heads 8 on each of 2 ring ranks (8 image + 8 text tokens): a transposed LSE has the
# right shape here, only its numbers are wrong.
S_EQUALS_H = {"batch": 1, "height": 32, "width": 64, "text_tokens": 8}
FIXES = {
    "base2": "base-2 LSE (times ln 2)",
    "transposed": "LSE laid out [B, H, S] (reordered)",
    "padded": "LSE laid out [B, H, S] (reordered), padded along S (cut to S)",
}


@pytest.mark.parametrize("kind", list(FIXES))
def test_the_numeric_check_finds_each_fixable_lse_bug(kind: str) -> None:
    verdict = check_kernel(f"cpu_flash_{kind}", bad_kernel(kind), torch.device("cpu"), torch.float32, 16)
    assert verdict.status == "adapted"
    assert verdict.fix is not None and verdict.fix.describe() == FIXES[kind]
    assert verdict.lse_error <= 1e-5 and verdict.out_error <= 1e-5 and verdict.merge_error <= 1e-5
    # cached per (device, torch, kernel): the same kernel object is not checked again
    op = bad_kernel(kind)
    assert check_kernel("k", op, torch.device("cpu"), torch.float32, 16) is check_kernel(
        "k", op, torch.device("cpu"), torch.float32, 16
    )


def test_the_real_kernels_pass_untouched() -> None:
    for name, op in (("cpu_flash", cpu_flash_forward_op), ("math", math_forward_op)):
        for dtype in (torch.float32, torch.bfloat16):
            verdict = check_kernel(name, op, torch.device("cpu"), dtype, 16)
            assert (verdict.status, verdict.fix) == ("ok", LseFix()), verdict


def test_an_unfixable_lse_is_refused_with_the_kernel_and_the_remedy() -> None:
    verdict = check_kernel("native_flash", bad_kernel("garbage"), torch.device("cpu"), torch.float32, 16)
    assert verdict.status == "refused"
    with pytest.raises(KernelRefused) as err:
        require(verdict)
    assert str(err.value) == (
        f"ring attention refused: the attention kernel 'native_flash' on {device_name(torch.device('cpu'))} "
        f"(torch {torch.__version__}, float32) failed the LSE guard's numeric check: its LSE (shape (2, 6, 3) "
        "for B=2, S=6, H=3) matches float64 attention's in none of the known layouts ([B, S, H], [B, H, S], "
        "[H, B*S], [B*S, H]; natural log or base 2). Ring merges would be wrong; use attention='math' "
        "(exact, slower), or a layout without ring attention (ulysses, tp or batch)"
    )


def test_an_empty_key_chunk_never_reaches_the_kernel() -> None:
    """AITER's CK kernel returns +inf for it (bad_kernel('posinf_empty')); torch's CPU flash kernel dies of
    SIGFPE. The adapted op answers it: output 0, LSE -inf (what attention over no keys is)."""
    q = torch.randn(1, 4, 2, 8)
    empty = q.new_zeros(1, 0, 2, 8)
    out, lse = adapt_forward_op(bad_kernel("posinf_empty"), LseFix())(None, q, empty, empty, return_lse=True)
    assert torch.equal(out, torch.zeros(1, 4, 2, 8)) and bool((lse == float("-inf")).all())


@pytest.fixture
def bad_kernels(group2: WorkerGroup):
    try:
        yield group2
    finally:
        group2.call_all("use_bad_kernel", BadKernel(""))  # the session group's later tests need the real one


@pytest.mark.parametrize("kind", list(FIXES))
def test_a_ring_of_two_is_exact_with_each_fixable_kernel(bad_kernels: WorkerGroup, kind: str) -> None:
    """End to end: the bad kernel in place of the CPU flash kernel on both ranks, a ring-2 model, S == H.

    The model's q/k norms are scaled to real models' order (`sharpen_attention`): with the random 0.05
    weights every attention row is near uniform and a wrong LSE changes the output by ~1e-5 only.
    Mutation tried: with `guard_ring_kernel` returning the kernel unchecked (the numeric check removed),
    base2 was off by 1.0e-2 and transposed by 4.1e-2 (outputs up to 2.2; silently, no error; guarded:
    4.8e-7), padded failed in the merge ('The size of tensor a (32) must match the size of tensor b (8)'),
    and the garbage kernel of the test below was not refused: all four failed."""
    inputs = random_inputs(FluxDims.from_diffusers_config(CONFIG), **S_EQUALS_H).as_kwargs()
    with torch.no_grad():
        expected = sharpen_attention(build_flux(CONFIG, seed=7))(**inputs, return_dict=False)[0]
    bad_kernels.call_all("use_bad_kernel", BadKernel(kind))
    bad_kernels.call_all("build_random", BuildRandom(CONFIG, 7, "float32", ring=2))
    bad_kernels.call_all("sharpen_resident")
    out = bad_kernels.call("forward", Inputs(inputs)).output
    assert out.shape == expected.shape
    assert (out - expected).abs().max().item() <= 1e-5
    assert [f.fix for f in bad_kernels.call_all("kernel_fix")] == [FIXES[kind]] * 2


def test_a_ring_of_two_answers_an_empty_key_chunk_itself(bad_kernels: WorkerGroup) -> None:
    """Rank 1's keys all masked out: rank 0 meets an empty chunk in the ring. With AITER's +inf it would
    take that chunk's zeros for the whole answer. Mutation tried: without the empty-chunk branch in
    `adapt_forward_op` the +inf reached the merge, rank 0's half was off by 2.5, and this test (and the
    unit test above) failed."""
    bad_kernels.call_all("use_bad_kernel", BadKernel("posinf_empty"))
    bad_kernels.call_all("build_random", BuildRandom(CONFIG, 7, "float32", ring=2))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 8, 8, 16, generator=g) for _ in range(3))
    valid = torch.tensor([True] * 3 + [False] + [False] * 4)  # rank 0: 3 real keys; rank 1: none
    replies = bad_kernels.call_all("masked_ring_attention", MaskedRing(q, k, v, valid))
    out = torch.cat([r.out for r in replies], dim=1)
    expected = torch.softmax(torch.einsum("bshd,bthd->bhst", q.double(), k[:, valid].double()) * 16**-0.5, -1)
    expected = torch.einsum("bhst,bthd->bshd", expected, v[:, valid].double())
    assert (out.double() - expected).abs().max().item() <= 1e-5


def test_a_ring_with_an_unfixable_kernel_is_refused_on_every_rank(bad_kernels: WorkerGroup) -> None:
    bad_kernels.call_all("use_bad_kernel", BadKernel("garbage"))
    with pytest.raises(WorkerError) as err:
        bad_kernels.call_all("build_random", BuildRandom(CONFIG, 7, "float32", ring=2))
    assert "ring attention refused: the attention kernel 'cpu_flash' on " in str(err.value)
    assert "matches float64 attention's in none of the known layouts" in str(err.value)
    assert "use attention='math' (exact, slower)" in str(err.value)
    assert bad_kernels.alive  # every rank refused at the same point: nobody waits in a collective
    assert bad_kernels.call("ping") is not None


def test_one_rank_refusing_its_kernel_alone_makes_every_rank_refuse(bad_kernels: WorkerGroup) -> None:
    """Only rank 1's kernel fails the numeric check (two GPUs of different kinds, or one whose kernel
    library differs): the ranks agree on the verdict before any ring collective, so rank 0, whose own kernel
    passed, refuses too, naming the other rank, and neither waits in a collective the other never joins;
    the group stays up. The case the agreement (`lse_check._agree`) exists for: the test above has every
    rank refuse on its own.

    Mutation tried: with `_agree` returning this rank's own verdict, rank 0 went on into the ring merge check
    alone; rank 1's refusal then left it waiting in a collective, the group was stopped, and this test
    failed."""
    bad_kernels.call_all("use_bad_kernel", BadKernel("garbage", ranks=(1,)))
    with pytest.raises(WorkerError) as err:
        bad_kernels.call_all("build_random", BuildRandom(CONFIG, 7, "float32", ring=2))
    replies = bad_kernels.last_replies
    assert sorted(replies) == [0, 1] and not any(r.ok for r in replies.values())
    assert {r.error_type for r in replies.values()} == {"KernelRefused"}
    assert replies[1].error.startswith(
        "KernelRefused: ring attention refused: the attention kernel 'cpu_flash' on "
    )
    assert replies[0].error.startswith(
        "KernelRefused: ring attention refused: another rank's attention kernel failed the LSE guard's numeric check (its "
        "error names it); this rank's 'cpu_flash' on "
    )
    assert replies[0].error.rstrip().endswith(": out and LSE agree with float64"), replies[0].error
    assert str(err.value) in {
        f"rank {r} (cpu): {replies[r].error.rstrip()}" for r in (0, 1)
    }  # the first read
    assert bad_kernels.alive
    assert bad_kernels.call("ping") is not None
