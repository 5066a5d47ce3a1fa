"""Composed layouts on one device mesh: batch x tp x ring x ulysses.

* On the session's 4 gloo workers, through the public API (`ParallelModel.load(layout=...)` and
  `forward`, the path ComfyUI's samplers take): tp 2 x ring 2, tp 2 x ulysses 2, batch 2 x tp 2 and
  batch 2 x ring 2 equal the same call in one process within 1e-5 (fp32), for FLUX.1 and FLUX.2, with odd
  token counts (35 image + 3 text tokens: every context-parallel stream padded), and for the batch
  layouts a batch of 1 (a group idles), 2 and 3 (2 + 1);
* on the workers, what each rank did, counted per mesh dimension: an idle group only gathers;
* the LSE guard on a ring sub-group, against diffusers' old merge;
* on the meta device at FLUX.1-dev size (1008x1008: 3969 image tokens, odd), the collectives of each
  dimension, counted by the group they ran on, equal the planner's, count and payload; and the planner's
  activations for these layouts are within 10 % of torch's MemTracker.
"""

from __future__ import annotations

import pytest
import torch
from test_sampling import flux2_model, flux_model

from rocm_parallel.backend.config import ParallelLayout
from rocm_parallel.backend.diffusion.api import ParallelModel
from rocm_parallel.backend.diffusion.messages import Conditioning, ForwardRequest
from rocm_parallel.backend.flux.dims import FluxDims
from rocm_parallel.backend.flux.forward import flux_call
from rocm_parallel.backend.flux.model import FLUX_DEV
from rocm_parallel.backend.flux.sampling import diffusers_model_fn
from rocm_parallel.backend.flux2.forward import flux2_call, flux2_model_fn
from rocm_parallel.backend.plan import Setup, collectives, estimate
from rocm_parallel.backend.runtime.client import WorkerGroup
from rocm_parallel.testing.meta import measure_on_meta
from rocm_parallel.testing.models import tiny_flux_config

TOL = 1e-5
DONE_WHEN = ("tp2xring2", "tp2xulysses2", "batch2xtp2", "batch2xring2")


def odd_call(family: str, batch: int, seed: int = 0) -> dict[str, torch.Tensor | None]:
    """A model call with 5 x 7 = 35 image tokens and 3 text tokens, every entry different (latent,
    prompt, timestep, guidance), so a split that mixed entries up could not pass."""
    g = torch.Generator().manual_seed(seed)
    if family == "flux1":  # 10 x 14 latent pixels, 2 x 2 patches
        x, pooled = torch.randn(batch, 16, 10, 14, generator=g), torch.randn(batch, 24, generator=g)
    else:  # FLUX.2: one token per latent pixel, no pooled vector
        x, pooled = torch.randn(batch, 128, 5, 7, generator=g), None
    return {
        "x": x,
        "timestep": torch.linspace(0.3, 0.9, batch),
        "context": torch.randn(batch, 3, 32, generator=g),
        "y": pooled,
        "guidance": torch.linspace(2.0, 5.0, batch),
    }


def one_process(model: torch.nn.Module, family: str, call: dict) -> torch.Tensor:
    with torch.no_grad():
        if family == "flux1":
            fn = diffusers_model_fn(model)
            return flux_call(fn, call["x"], call["timestep"], call["context"], call["y"], call["guidance"])
        fn = flux2_model_fn(model)
        return flux2_call(fn, call["x"], call["timestep"], call["context"], None, call["guidance"])


@pytest.mark.slow
@pytest.mark.parametrize("family", [pytest.param("flux1", marks=pytest.mark.torch_api), "flux2"])
def test_composed_layouts_equal_one_process(
    group4: WorkerGroup, checkpoints: dict[str, str], flux2_checkpoints: dict[str, str], family: str
) -> None:
    """Mutation tried: BatchSplit taking every group's share from the first entries (1.8 off at batch 2)."""
    path = checkpoints["dev"] if family == "flux1" else flux2_checkpoints["flux2"]
    model = flux_model("dev") if family == "flux1" else flux2_model("flux2")
    flux = ParallelModel(group=group4)
    worst = {}
    for layout in DONE_WHEN:
        flux.load(path, layout=layout, dtype="float32")
        assert flux.resident.layout == ParallelLayout.parse(layout)
        for batch in (1, 2, 3) if layout.startswith("batch") else (2,):
            call = odd_call(family, batch, seed=batch)
            out = flux.forward(call["x"], call["timestep"], call["context"], call["y"], call["guidance"])
            assert out.shape == call["x"][:, : out.shape[1]].shape and out.dtype == torch.float32
            worst[(layout, batch)] = (out - one_process(model, family, call)).abs().max().item()
    print(f"{family}: max |diff| per (layout, batch): {worst}")
    assert max(worst.values()) <= TOL, worst
    flux.unload()


def _request(family: str, batch: int, key: int) -> ForwardRequest:
    call = odd_call(family, batch)
    held = {"context": call["context"], "y": call["y"], "ref_latents": ()}
    per_call = {
        "guidance": call["guidance"],
        "ref_latents_method": "offset" if family == "flux1" else "index",
    }
    return ForwardRequest(call["x"], call["timestep"], key, per_call, Conditioning(held))


@pytest.mark.torch_api
def test_each_group_computes_its_share_and_an_idle_group_only_gathers(
    group4: WorkerGroup, checkpoints: dict[str, str]
) -> None:
    """batch 2 x tp 2, counted per mesh dimension on every rank: with a call of 2 each TP pair runs its
    own entry (its all-reduces on its tp group, 2 x 2 double + 2 single blocks); with a call of 1 the
    second pair runs nothing and only takes part in the batch gather. Mutation tried: `BatchSplit.runs`
    always True (the idle pair ran the model on an empty batch: its tp counts appeared)."""
    flux = ParallelModel(group=group4)
    flux.load(checkpoints["dev"], layout="batch 2 x tp 2", dtype="float32")
    busy = {"tp:all_reduce": 6, "tp:all_gather": 1, "batch:all_gather": 1}
    both = group4.call_all("counted_forward", _request("flux1", 2, key=9001))
    assert [r.counts for r in both] == [busy] * 4
    assert [r.coordinate["batch"] for r in both] == [0, 0, 1, 1]  # TP innermost: pairs {0, 1}, {2, 3}
    one = group4.call_all("counted_forward", _request("flux1", 1, key=9002))
    assert [r.counts for r in one] == [busy, busy, {"batch:all_gather": 1}, {"batch:all_gather": 1}]
    call = odd_call("flux1", 1)
    assert (one[0].out - one_process(flux_model("dev"), "flux1", call)).abs().max().item() <= TOL
    flux.unload()


@pytest.mark.torch_api
def test_the_lse_guard_probes_the_ring_sub_group(group4: WorkerGroup, checkpoints: dict[str, str]) -> None:
    """tp 2 x ring 2 with diffusers' old ring merge (<= 0.37 on torch >= 2.9, which fails on ROCm's 3-D
    LSE): each ring of 2 ranks is probed on its own sub-group, answers '4d', and the guarded forward equals
    one process. Without the guard the same forward fails with the ROCm error (tried by hand: 'The size of
    tensor a (2) must match the size of tensor b (17) at non-singleton dimension 3' on every rank)."""
    flux = ParallelModel(group=group4)
    group4.call_all("old_ring_merge_on_mesh", _OldRingMerge(True))
    try:
        flux.load(checkpoints["dev"], layout="tp 2 x ring 2", dtype="float32")
        replies = group4.call_all("counted_forward", _request("flux1", 2, key=9003))
    finally:
        group4.call_all("old_ring_merge_on_mesh", _OldRingMerge(False))
        flux.unload()
    assert [r.lse_shape for r in replies] == ["4d"] * 4
    assert replies[0].counts == {
        "cp:all_gather": 1,
        "ring:all_gather": 4,
        "tp:all_gather": 1,
        "tp:all_reduce": 6,
    }
    expected = one_process(flux_model("dev"), "flux1", odd_call("flux1", 2))
    assert (replies[0].out - expected).abs().max().item() <= TOL


def _OldRingMerge(on: bool):  # the worker module's record (imported there by name)
    from mesh_methods import OldRingMerge

    return OldRingMerge(on)


# --------------------------------------------------------------------------------------------------
# The meta device: per-dimension collectives at FLUX.1-dev size, activations


def _planned_by_dimension(setup: Setup, layout: ParallelLayout, labels: set[str]) -> dict:
    """The planner's (dimension, kind) -> (count, payload), under the labels the counter used: a group
    serving two dimensions (ring alone: the ring group is diffusers' flattened cp group) is 'ring|cp'."""
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for c in collectives(setup, layout):
        dim = next((label for label in labels if c.dim in label.split("|")), c.dim)
        count, payload = out.get((dim, c.kind), (0, 0))
        out[(dim, c.kind)] = (count + c.count, payload + c.count * c.payload)
    return out


@pytest.mark.torch_api
@pytest.mark.parametrize(
    ("layout", "counts"),
    [
        ("tp2xring2", {("tp", "all_reduce"): 76, ("tp", "all_gather"): 1, ("ring", "all_gather"): 57, ("cp", "all_gather"): 1}),
        ("tp2xulysses2", {("tp", "all_reduce"): 76, ("tp", "all_gather"): 1, ("ulysses", "all_to_all"): 228, ("cp", "all_gather"): 1}),
        ("batch2xtp2", {("tp", "all_reduce"): 76, ("tp", "all_gather"): 1, ("batch", "all_gather"): 1}),
        ("batch2xring2", {("ring", "all_gather"): 57, ("cp", "all_gather"): 1, ("batch", "all_gather"): 1}),
    ],
)  # fmt: skip
def test_collectives_per_dimension_at_flux_dev_size(layout: str, counts: dict) -> None:
    """One forward of cond + uncond (batch 2) at 1008x1008 (63 x 63 = 3969 image tokens + 512 text: padded
    under CP) in bf16 on rank 3 of 4 (every coordinate 1): 76 fused TP all-reduces (2 per double block, 1
    per single) on the tp group, one modulation gather, one ring K/V gather or four Ulysses all-to-alls per
    attention (57), diffusers' output gather on the flattened ring x ulysses group, one batch gather."""
    parsed = ParallelLayout.parse(layout)
    measured = measure_on_meta(FLUX_DEV, parsed, 1008, 1008, batch=2, text_tokens=512, rank=3, memory=False)
    got = measured["by_dimension"]
    assert {key: n for key, (n, _) in got.items()} == counts
    setup = Setup(FluxDims.from_diffusers_config(FLUX_DEV), 1008, 1008, batch=2, text_tokens=512, devices=4)
    assert got == _planned_by_dimension(setup, parsed, {d for d, _ in got})


TINY = tiny_flux_config(heads=8, head_dim=32, double_blocks=2, single_blocks=4, text_dim=64, pooled_dim=32)


# torch 2.9's `fake` process group cannot resolve a sub-mesh's group by name inside MemTracker's trace
# ("Could not resolve the process group registered under the name 14", torch 2.9.1); the engine's composed
# layouts themselves run on 2.9 (the gloo tests above), only this meta-device measurement needs 2.10+.
@pytest.mark.torch_api
@pytest.mark.skipif(
    tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 10),
    reason="torch 2.9's fake process group cannot resolve a sub-mesh's group for MemTracker's trace",
)
@pytest.mark.parametrize("layout", DONE_WHEN)
def test_composed_activations_within_ten_percent_of_memtracker(layout: str) -> None:
    """An odd size (31 x 31 image + 61 text tokens, padded under CP) and a batch of 3 (2 + 1 under a batch
    degree: rank 0's group has 2): the planner's peak for the busiest rank against MemTracker's."""
    parsed = ParallelLayout.parse(layout)
    setup = Setup(FluxDims.from_diffusers_config(TINY), 496, 496, batch=3, text_tokens=61, devices=4)
    measured = measure_on_meta(TINY, parsed, 496, 496, batch=3, text_tokens=61, rank=0)
    assert estimate(setup, parsed).activations == pytest.approx(measured["activations"], rel=0.10)
    label = {d for d, _ in measured["by_dimension"]}
    assert measured["by_dimension"] == _planned_by_dimension(setup, parsed, label)
