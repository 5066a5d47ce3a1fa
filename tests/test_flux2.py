"""FLUX.2 on the engine: TP and context-parallel parity with the single-process forward (fp32)."""

from __future__ import annotations

import pytest
import torch
from flux2_methods import BuildRandomFlux2
from model_methods import Inputs

from rocm_parallel.backend.flux.dims import FluxDims
from rocm_parallel.backend.flux2.model import FLUX2_DEV, build_flux2
from rocm_parallel.backend.flux2.tp import FLUX2_TP_PLAN
from rocm_parallel.backend.parallel.comm import CountCollectives
from rocm_parallel.backend.parallel.tensor import (
    PackedColumn,
    parameter_bytes,
    shard_pieces,
)
from rocm_parallel.backend.runtime.client import WorkerGroup
from rocm_parallel.testing.fake import fake_process_group
from rocm_parallel.testing.models import random_inputs, tiny_flux2_config
from rocm_parallel.testing.parallel import apply_tensor_parallel

# 8 heads so that TP 2/4 and Ulysses 2 split them; 2 double + 3 single blocks, SwiGLU MLP x3.
CONFIG = tiny_flux2_config(
    heads=8, head_dim=16, double_blocks=2, single_blocks=3, text_dim=32, in_channels=16
)

SHAPES = {
    "even": {"batch": 1, "height": 64, "width": 64, "text_tokens": 16},
    "odd": {"batch": 2, "height": 48, "width": 80, "text_tokens": 11},  # 15 image + 11 text tokens, batch 2
}


def reference(config: dict, shape: dict) -> tuple[dict, torch.Tensor]:
    inputs = random_inputs(FluxDims.from_diffusers_config(config), **shape, family="flux2")
    with torch.no_grad():
        out = build_flux2(config, seed=7)(**inputs.as_kwargs(), return_dict=False)[0]
    return inputs.as_kwargs(), out


def _parity(group: WorkerGroup, config: dict, shape: dict, **layout: int) -> None:
    inputs, expected = reference(config, shape)
    built = group.call_all("build_random_flux2", BuildRandomFlux2(config, seed=7, **layout))
    assert len({b.parameter_bytes for b in built}) == 1  # every rank holds an equal share
    result = group.call("forward_flux2", Inputs(inputs))
    assert result.output.shape == expected.shape
    assert (result.output - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("groups", [2, 4], indirect=True)
@pytest.mark.parametrize("shape", ["even", "odd"])
def test_flux2_tp_matches_single_process(groups: WorkerGroup, shape: str) -> None:
    _parity(groups, CONFIG, SHAPES[shape], tp=groups.world_size)


def test_flux2_tp_without_guidance(group2: WorkerGroup) -> None:
    """[klein] has no guidance embedder."""
    _parity(group2, {**CONFIG, "guidance_embeds": False}, SHAPES["odd"], tp=2)


@pytest.mark.parametrize(
    ("world", "ring", "ulysses"),
    [(2, 2, 1), (4, 4, 1), (2, 1, 2), (4, 2, 2)],
    ids=["ring2", "ring4", "ulysses2", "ring2xulysses2"],
)
@pytest.mark.parametrize("shape", ["even", "odd"])
def test_flux2_context_parallel_matches_single_process(
    request: pytest.FixtureRequest, world: int, ring: int, ulysses: int, shape: str
) -> None:
    group = request.getfixturevalue(f"group{world}")
    _parity(group, CONFIG, SHAPES[shape], ring=ring, ulysses=ulysses)


def test_flux2_context_parallel_returns_flux2_output(group2: WorkerGroup) -> None:
    inputs, expected = reference(CONFIG, SHAPES["odd"])
    group2.call_all("build_random_flux2", BuildRandomFlux2(CONFIG, seed=7, ring=2))
    result = group2.call("forward_flux2", Inputs(inputs, return_dict=True))
    assert result.type == "Flux2Transformer2DModelOutput"
    assert (result.output - expected).abs().max().item() <= 1e-5


def test_packed_column_takes_each_part() -> None:
    """The single-block [q | k | v | gate | up] projection: rank 1 of 2 owns the second half of each."""
    dims = FluxDims.from_diffusers_config(CONFIG)  # hidden 128, mlp 384
    split = FLUX2_TP_PLAN["single_transformer_blocks.*.attn.to_qkv_mlp_proj"]
    assert split == PackedColumn(("hidden", "hidden", "hidden", "mlp", "mlp"))
    pieces = shard_pieces(split, "weight", (3 * 128 + 2 * 384, 128), rank=1, degree=2, dims=dims)
    assert pieces.dim == 0
    assert pieces.ranges == ((64, 128), (192, 256), (320, 384), (576, 768), (960, 1152))


@pytest.mark.torch_api
@pytest.mark.parametrize("degree", [2, 4])
def test_flux2_collectives_per_forward(degree: int) -> None:
    dims = FluxDims.from_diffusers_config(CONFIG)
    with fake_process_group(degree, rank=degree - 1):
        model = apply_tensor_parallel(build_flux2(CONFIG))
        with CountCollectives() as counter, torch.no_grad():
            model(**random_inputs(dims, family="flux2").as_kwargs())
    # 2 per double block (attention and feed-forward, both streams at once) + 1 per single block;
    # one all-gather for the four shared modulation vectors.
    assert dict(counter.log.counts) == {"all_reduce": 2 * 2 + 3, "all_gather": 1}


@pytest.mark.torch_api
def test_flux2_dev_bytes_per_rank_on_meta() -> None:
    """FLUX.2 [dev] at TP=4 in bf16: everything but the small embedders is split four ways."""
    full = parameter_bytes(build_flux2(FLUX2_DEV, device="meta", dtype=torch.bfloat16))
    with fake_process_group(4):
        sharded = parameter_bytes(
            apply_tensor_parallel(build_flux2(FLUX2_DEV, device="meta", dtype=torch.bfloat16))
        )
    hidden, text = 6144, 15360
    # Replicated: the input projections, the time/guidance embedders, the per-head q/k RMS norms and
    # the final projection (no biases anywhere in FLUX.2).
    replicated = 128 * hidden + text * hidden + 2 * (256 * hidden + hidden * hidden)
    replicated += 8 * 4 * 128 + 48 * 2 * 128 + hidden * 128
    assert sharded == (full - 2 * replicated) // 4 + 2 * replicated


# --------------------------------------------------------------------------------------------------
# Planner


@pytest.mark.parametrize("degree", [2, 4, 8])
def test_planner_weight_bytes_are_what_the_engine_holds(degree: int) -> None:
    from rocm_parallel.backend.config import ParallelLayout
    from rocm_parallel.backend.flux.dims import FluxDims
    from rocm_parallel.backend.plan import weight_bytes

    dims = FluxDims.from_diffusers_config(FLUX2_DEV)
    for rank in (0, degree - 1):
        with fake_process_group(degree, rank=rank):
            held = parameter_bytes(
                apply_tensor_parallel(build_flux2(FLUX2_DEV, device="meta", dtype=torch.bfloat16))
            )
        assert weight_bytes(dims, ParallelLayout(tp=degree), 2, rank=rank, family="flux2") == held


def test_planner_work_of_flux2_dev_is_swiglu_and_packed_single_blocks() -> None:
    """FLUX.2 [dev]'s per-token work from the meta model, against the architecture worked by hand: SwiGLU
    d -> 2m -> m -> d, the single block's packed [q | k | v | gate | up] and cat(attention, mlp) outputs;
    its shared modulation is 6 + 6 + 3 + 2 vectors of hidden whatever the block count."""
    from rocm_parallel.backend.plan import model_facts

    d, m = 6144, 18432
    facts = model_facts("flux2", FluxDims.from_diffusers_config(FLUX2_DEV))
    assert facts.image_macs == 128 * d + d * 128 + 8 * (4 * d * d + 3 * d * m)
    assert facts.text_macs == 15360 * d + 8 * (4 * d * d + 3 * d * m)
    assert facts.joint_macs == 48 * (d * (3 * d + 2 * m) + (d + m) * d)
    assert (facts.attentions, facts.tp_all_reduces, facts.modulation_width) == (56, 64, 17 * d)


def test_plan_cli_answers_for_flux2_dev(capsys: pytest.CaptureFixture[str]) -> None:
    from rocm_parallel.backend.cli import main

    code = main(["plan", "--model", "flux2-dev", "--devices", "4", "--memory-gb", "16"])
    out = capsys.readouterr().out
    assert out.startswith(
        "FLUX.2 (48 heads x 128, 8+48 blocks), bfloat16, 1024x1024, call batch 1 (4608 tokens)"
    )
    assert "auto:" in out
    assert code in (0, 1)
