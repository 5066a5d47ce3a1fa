"""The LSE guard on two real ranks, against a ring merge that needs it.

diffusers 0.42.1 merges both LSE layouts itself, so on this machine the guard's probe finds nothing to do
(test_context_parallel.py checks that) and removing the probe changes no other test. Here the ring merge
of diffusers <= 0.37 on torch >= 2.9 (the ROCm bug: the kernel's [B, S, H] LSE reaches the merge as is)
is put back into diffusers' own `TemplatedRingAttention.forward` on both workers (tests/worker_jobs.py
`old_ring_merge`). The probe must find that this merge needs a 4-D LSE, the guard must be installed, and
the ring=2 forward must match the single-process forward.
"""

from __future__ import annotations

import pytest
from model_methods import BuildRandom, Inputs
from test_context_parallel import CONFIG, reference
from worker_jobs import OldMerge

from rocm_parallel.backend.client import WorkerGroup
from rocm_parallel.backend.parallel.lse import NEEDS_4D


@pytest.fixture
def old_merge(group2: WorkerGroup):
    group2.call_all("old_ring_merge", OldMerge(on=True))
    try:
        yield group2
    finally:
        group2.call_all("old_ring_merge", OldMerge(on=False))  # the session group's later tests need 0.42's


def test_the_guard_makes_an_old_ring_merge_exact(old_merge: WorkerGroup) -> None:
    """Mutation tried: without `_probe_ring` in `apply_context_parallel` (lse_shape stays 'any') every rank
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
