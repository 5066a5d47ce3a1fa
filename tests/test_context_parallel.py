"""Context parallelism: parity with the single-process forward, validation, collectives, the LSE guard."""

from __future__ import annotations

import pytest
import torch
from cp_checks import Route
from diffusers.utils import is_torch_version
from model_methods import BuildRandom, Inputs

from rocm_parallel.backend.config import ConfigError, ParallelLayout
from rocm_parallel.backend.flux.dims import FluxDims
from rocm_parallel.backend.flux.model import build_flux
from rocm_parallel.backend.parallel.comm import CountCollectives, collectives_need_host
from rocm_parallel.backend.parallel.context import (
    cpu_flash_forward_op,
    masked_forward_op,
    math_forward_op,
    pad_for_ranks,
    split_sizes,
    unpad_from_ranks,
)
from rocm_parallel.backend.parallel.lse import (
    ANY,
    NEEDS_3D,
    NEEDS_4D,
    guard_forward_op,
    probe_merge_shape,
    probe_query_shape,
)
from rocm_parallel.backend.runtime.client import WorkerError, WorkerGroup
from rocm_parallel.testing.fake import fake_process_group
from rocm_parallel.testing.helpers import TEST_CONFIG
from rocm_parallel.testing.models import random_inputs, tiny_flux_config
from rocm_parallel.testing.parallel import apply_context_parallel

pytestmark = pytest.mark.torch_api

# 8 heads so that Ulysses 2 and 4 both split them; 2 double + 3 single blocks.
CONFIG = TEST_CONFIG

SHAPES = {
    # 16 image + 16 text tokens: divides by 2 and 4
    "even": {"batch": 1, "height": 64, "width": 64, "text_tokens": 16},
    # 3 x 7 = 21 image + 11 text tokens (odd latent 6x14): divides by neither 2 nor 4; batch 2
    "uneven_b2": {"batch": 2, "height": 48, "width": 112, "text_tokens": 11},
    # 1008x1008-like: 63 x 63 patches scaled down to 9 x 9 = 81 image tokens, 5 text tokens (< degree 4 + 1)
    "odd_square": {"batch": 1, "height": 144, "width": 144, "text_tokens": 5},
}

# (world size, ring, ulysses)
LAYOUTS = [(2, 2, 1), (2, 1, 2), (4, 4, 1), (4, 1, 4), (4, 2, 2)]


def reference(config: dict, **shape) -> tuple[dict, torch.Tensor]:
    inputs = random_inputs(FluxDims.from_diffusers_config(config), **shape)
    with torch.no_grad():
        out = build_flux(config, seed=7)(**inputs.as_kwargs(), return_dict=False)[0]
    return inputs.as_kwargs(), out


@pytest.mark.parametrize(
    ("groups", "ring", "ulysses"), LAYOUTS, indirect=["groups"], ids=[f"r{r}u{u}" for _, r, u in LAYOUTS]
)
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_cp_matches_single_process(groups: WorkerGroup, ring: int, ulysses: int, shape: dict) -> None:
    inputs, expected = reference(CONFIG, **shape)
    built = groups.call_all("build_random", BuildRandom(CONFIG, 7, "float32", ring=ring, ulysses=ulysses))
    assert len({b.parameter_bytes for b in built}) == 1  # every rank holds the whole model
    out = groups.call("forward", Inputs(inputs)).output
    assert out.shape == expected.shape  # rank 0 returns the whole gathered output, padding removed
    assert (out - expected).abs().max().item() <= 1e-5
    states = groups.call_all("context_state")
    for state in states:
        assert state.kernel == "cpu_flash"
        assert state.processors == ("ContextParallelFluxAttnProcessor",)
        assert not state.padding_left  # the per-forward padding plan is cleared after the forward
        # diffusers 0.42.1 merges both LSE layouts itself: the guard found nothing to do
        assert state.lse_shape == ANY


@pytest.mark.parametrize(("ring", "ulysses", "routed"), [(2, 1, 5 + 1), (1, 2, 1)])
def test_gathers_routed_through_host_keep_the_result(
    group2: WorkerGroup, ring: int, ulysses: int, routed: int
) -> None:
    """On a GPU over gloo (two workers sharing a GPU; no NCCL/RCCL) diffusers' functional all-gather crashed
    the workers (torch 2.11, H100): there its gathers go through host memory. Forced here on CPU: the same
    output, and every gather of the forward took the route (ring: one K/V gather per attention and the
    output's; Ulysses: the output's, its all-to-alls work on GPUs). Mutation tried: without the
    `route_diffusers_gathers_through_host` call in apply_context_parallel, routed was -1 on both ranks."""
    inputs, expected = reference(CONFIG, **SHAPES["uneven_b2"])
    group2.call_all("route_collectives_through_host", Route(True))
    try:
        group2.call_all("build_random", BuildRandom(CONFIG, 7, "float32", ring=ring, ulysses=ulysses))
        before = group2.call_all("context_state")
        out = group2.call("forward", Inputs(inputs)).output
        after = group2.call_all("context_state")
    finally:
        group2.call_all("route_collectives_through_host", Route(False))
    assert (out - expected).abs().max().item() <= 1e-5
    assert all(b.routed >= 0 for b in before)
    assert [a.routed - b.routed for a, b in zip(after, before, strict=True)] == [routed, routed]
    assert [s.routed for s in group2.call_all("context_state")] == [-1, -1]  # undone for the next tests


def test_collectives_need_host_only_for_gloo_on_a_gpu() -> None:
    assert collectives_need_host("gloo", torch.device("cuda", 0))
    assert not collectives_need_host("nccl", torch.device("cuda", 0))
    assert not collectives_need_host("gloo", torch.device("cpu"))
    assert not collectives_need_host("gloo", torch.device("meta"))


def test_worker_reports_bad_ulysses_degree_before_building(group2: WorkerGroup) -> None:
    config = tiny_flux_config(heads=3, head_dim=16)
    with pytest.raises(WorkerError) as err:
        group2.call("build_random", BuildRandom(config, 0, "float32", ulysses=2))
    assert "ulysses_degree=2 does not divide 3 attention heads; use 3" in str(err.value)
    assert err.value.remote_type == "ConfigError"


def test_worker_reports_short_sequence(group4: WorkerGroup) -> None:
    group4.call_all("build_random", BuildRandom(CONFIG, 7, "float32", ring=2, ulysses=2))
    inputs = random_inputs(
        FluxDims.from_diffusers_config(CONFIG), height=48, width=16
    ).as_kwargs()  # 3 tokens
    with pytest.raises(WorkerError) as err:
        group4.call("forward", Inputs(inputs))
    assert "an image of 3 tokens is too short for ring=2 x ulysses=2 = 4 devices" in str(err.value)
    # every rank failed before any collective: the group still works
    inputs, expected = reference(CONFIG, **SHAPES["even"])
    assert (group4.call("forward", Inputs(inputs)).output - expected).abs().max().item() <= 1e-5


# --------------------------------------------------------------------------------------------------
# Padding: at most one pad token per rank, and padded keys never reach a softmax


@pytest.mark.parametrize(("length", "degree"), [(21, 4), (11, 2), (3, 4), (16, 4)])
def test_pad_and_unpad_round_trip(length: int, degree: int) -> None:
    x = torch.arange(length).view(1, length, 1).float() + 1
    padded = pad_for_ranks(x, 1, degree)
    width = -(-length // degree)
    assert padded.shape[1] == width * degree
    pieces = padded.chunk(degree, dim=1)
    assert [int((p != 0).sum()) for p in pieces] == split_sizes(length, degree)
    assert torch.equal(unpad_from_ranks(padded, 1, split_sizes(length, degree)), x)


def test_padded_keys_are_dropped_not_attended() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5, 3, 8, generator=g) for _ in range(3))
    valid = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0])
    flag = valid.view(1, 5, 1, 1).expand(2, 5, 3, 1)
    zeros = torch.zeros(2, 5, 3, 1)
    ext = (torch.cat([q, zeros], -1), torch.cat([k, flag], -1), torch.cat([v, zeros], -1))
    out, lse = masked_forward_op(cpu_flash_forward_op)(None, *ext, None, 0.0, False, 8**-0.5, False, True)
    keep = valid.bool()
    expected, expected_lse = math_forward_op(None, q, k[:, keep], v[:, keep], return_lse=True)
    assert out.shape == (2, 5, 3, 9) and torch.all(out[..., -1] == 0)
    assert torch.allclose(out[..., :-1], expected, atol=1e-6) and torch.allclose(lse, expected_lse, atol=1e-6)
    unmasked = math_forward_op(None, q, k, v)
    assert (unmasked - expected).abs().max() > 1e-2  # what unmasked padding would have produced


# --------------------------------------------------------------------------------------------------
# Collectives per forward, counted under the fake process group on the meta device


@pytest.mark.parametrize(
    ("ring", "ulysses", "expected"),
    [
        # one K/V all-gather per attention (2 double + 3 single blocks) + one output gather
        (4, 1, {"all_gather": 5 + 1}),
        # Q, K, V and the output exchanged per attention + one output gather
        (1, 4, {"all_to_all": 4 * 5, "all_gather": 1}),
        (2, 2, {"all_to_all": 4 * 5, "all_gather": 5 + 1}),
    ],
)
def test_collectives_per_forward(ring: int, ulysses: int, expected: dict) -> None:
    dims = FluxDims.from_diffusers_config(CONFIG)
    with fake_process_group(ring * ulysses, rank=ring * ulysses - 1):
        model = apply_context_parallel(build_flux(CONFIG, device="meta"), ring, ulysses)
        inputs = random_inputs(dims, height=64, width=64, device="meta")
        with CountCollectives() as counter, torch.no_grad():
            out = model(**inputs.as_kwargs())  # return_dict=True, which diffusers' CP hooks alone reject
    assert out.sample.shape == (1, 16, dims.in_channels)
    assert dict(counter.log.counts) == expected


def test_apply_validates_before_changing_the_model() -> None:
    model = build_flux(tiny_flux_config(heads=6, head_dim=16), device="meta")
    with fake_process_group(4), pytest.raises(ConfigError) as err:
        apply_context_parallel(model, ring_degree=1, ulysses_degree=4)
    assert str(err.value) == "ulysses_degree=4 does not divide 6 attention heads; use 2, 3 or 6"
    assert {type(m.processor).__name__ for m in model.modules() if getattr(m, "processor", None)} == {
        "FluxAttnProcessor"
    }


def test_layout_sequence_message() -> None:
    with pytest.raises(ConfigError) as err:
        ParallelLayout(ring=4, ulysses=2).validate_sequence(7)
    assert str(err.value) == (
        "an image of 7 tokens is too short for ring=4 x ulysses=2 = 8 devices: each needs at least one "
        "image token; use an image of at least 8 tokens or fewer devices"
    )
    ParallelLayout(ring=4, ulysses=2).validate_sequence(8)


# --------------------------------------------------------------------------------------------------
# The LSE guard. The ring loop below is diffusers' TemplatedRingAttention.forward merge, copied with the
# collective replaced by a list of K/V chunks; only the line that shapes the LSE differs per version.


def unsqueeze_diffusers_0_36(lse: torch.Tensor) -> torch.Tensor:
    # diffusers 0.36.0, attention_dispatch.py TemplatedRingAttention.forward:
    lse = lse.unsqueeze(-1)
    return lse


def unsqueeze_diffusers_0_37(lse: torch.Tensor) -> torch.Tensor:
    # diffusers 0.37.0, attention_dispatch.py TemplatedRingAttention.forward (fails on torch >= 2.9):
    # Refer to:
    # https://github.com/huggingface/diffusers/pull/12693#issuecomment-3627519544
    if is_torch_version("<", "2.9.0"):
        lse = lse.unsqueeze(-1)
    return lse


def unsqueeze_diffusers_0_42(lse: torch.Tensor) -> torch.Tensor:
    # diffusers 0.42.1 (fixed in 0.38): keyed on the shape
    if lse.ndim == 3:
        lse = lse.unsqueeze(-1)
    return lse


def ring(forward_op, query, chunks, unsqueeze, convert_to_fp32: bool = True) -> torch.Tensor:
    """diffusers' ring merge (0.36-0.42 share it) over K/V `chunks`, the LSE line given by `unsqueeze`."""
    prev_out = prev_lse = None
    for i, (key, value) in enumerate(chunks):
        out, lse = forward_op(
            None,
            query,
            key,
            value,
            None,
            0.0,
            False,
            None,
            False,
            True,
            _save_ctx=i == 0,
            _parallel_config=None,
        )

        if convert_to_fp32:
            out = out.to(torch.float32)
            lse = lse.to(torch.float32)

        lse = unsqueeze(lse)
        if prev_out is not None:
            out = prev_out - torch.nn.functional.sigmoid(lse - prev_lse) * (prev_out - out)
            lse = prev_lse - torch.nn.functional.logsigmoid(prev_lse - lse)
        prev_out = out
        prev_lse = lse

    out = out.to(query.dtype)
    lse = lse.squeeze(-1)
    return out


def flux_dev_attention(chunks: int = 2, tokens: int = 6) -> tuple[torch.Tensor, list, torch.Tensor]:
    """FLUX.1-dev attention shapes (24 heads x 128): local queries, K/V chunks, exact full attention."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, tokens, 24, 128, generator=g)
    kv = [tuple(torch.randn(1, tokens, 24, 128, generator=g) for _ in "kv") for _ in range(chunks)]
    full_k, full_v = torch.cat([k for k, _ in kv], 1), torch.cat([v for _, v in kv], 1)
    return q, kv, math_forward_op(None, q, full_k, full_v)


def four_d(op):
    """A kernel that returns the LSE as [B, S, H, 1] (cuDNN on torch >= 2.9)."""

    def with_trailing_one(*args, **kwargs):
        out, lse = op(*args, **kwargs)
        return out, lse.unsqueeze(-1)

    return with_trailing_one


def test_old_merge_fails_on_a_3d_lse() -> None:
    """The original failure: diffusers 0.37's merge, torch >= 2.9, a flash kernel's [B, S, H] LSE."""
    assert is_torch_version(">=", "2.9.0"), "the failure needs torch >= 2.9 (the pack's tests run 2.13)"
    q, chunks, _ = flux_dev_attention()
    with pytest.raises(RuntimeError) as err:
        ring(cpu_flash_forward_op, q, chunks, unsqueeze_diffusers_0_37)
    assert (
        "The size of tensor a (24) must match the size of tensor b (128) at non-singleton dimension 3"
        in str(err.value)
    )


@pytest.mark.parametrize(
    ("unsqueeze", "layout"),
    [
        (unsqueeze_diffusers_0_36, NEEDS_3D),
        (unsqueeze_diffusers_0_37, NEEDS_4D),
        (unsqueeze_diffusers_0_42, ANY),
    ],
    ids=["diffusers-0.36", "diffusers-0.37", "diffusers-0.42"],
)
@pytest.mark.parametrize("kernel_lse", ["3d", "4d"])
def test_guard_makes_every_merge_exact(unsqueeze, layout: str, kernel_lse: str) -> None:
    q, chunks, expected = flux_dev_attention()
    probe = torch.zeros(probe_query_shape())
    probed = probe_merge_shape(lambda op: ring(op, probe, [(probe, probe)] * 2, unsqueeze), chunks=2)
    assert probed == layout
    kernel = cpu_flash_forward_op if kernel_lse == "3d" else four_d(cpu_flash_forward_op)
    out = ring(guard_forward_op(kernel, probed), q, chunks, unsqueeze)
    assert (out - expected).abs().max().item() <= 1e-5


def test_guard_is_idempotent_and_a_no_op_when_not_needed() -> None:
    op = cpu_flash_forward_op
    assert guard_forward_op(op, ANY) is op
    once = guard_forward_op(op, NEEDS_4D)
    twice = guard_forward_op(once, NEEDS_4D)
    assert twice.__lse_guarded__ is op  # wraps the kernel, never a wrapper
    assert guard_forward_op(once, ANY) is op
    q, chunks, expected = flux_dev_attention()
    assert (ring(twice, q, chunks, unsqueeze_diffusers_0_37) - expected).abs().max().item() <= 1e-5
