"""Tensor parallelism: parity with the single-process forward, collective counts, per-rank bytes."""

from __future__ import annotations

import pytest
import torch
from model_methods import BuildRandom, Inputs

from rocm_parallel.backend.config import ConfigError
from rocm_parallel.backend.flux.dims import FluxDims
from rocm_parallel.backend.flux.model import FLUX_DEV, build_flux
from rocm_parallel.backend.parallel.comm import CountCollectives
from rocm_parallel.backend.parallel.tensor import (
    GatheredLinear,
    PackedRow,
    RowParallelLinear,
    parameter_bytes,
    shard_pieces,
)
from rocm_parallel.backend.runtime.client import WorkerError, WorkerGroup
from rocm_parallel.testing.fake import fake_process_group
from rocm_parallel.testing.helpers import TEST_CONFIG
from rocm_parallel.testing.models import random_inputs, tiny_flux_config
from rocm_parallel.testing.parallel import apply_tensor_parallel

pytestmark = pytest.mark.torch_api

# 8 heads so that TP 2 and 4 both split them; 2 double + 3 single blocks.
CONFIG = TEST_CONFIG


def reference(config: dict, **shape) -> tuple[dict, torch.Tensor]:
    inputs = random_inputs(FluxDims.from_diffusers_config(config), **shape)
    with torch.no_grad():
        out = build_flux(config, seed=7)(**inputs.as_kwargs(), return_dict=False)[0]
    return inputs.as_kwargs(), out


@pytest.mark.parametrize("groups", [2, 4], indirect=True)
@pytest.mark.parametrize("guidance", [True, False])
@pytest.mark.parametrize(
    "shape",
    [
        {"batch": 1, "height": 64, "width": 64, "text_tokens": 16},
        {"batch": 2, "height": 64, "width": 64, "text_tokens": 16},
        {"batch": 1, "height": 48, "width": 112, "text_tokens": 11},  # non-square, odd token counts
    ],
    ids=["b1", "b2", "nonsquare"],
)
def test_tp_matches_single_process(groups: WorkerGroup, guidance: bool, shape: dict) -> None:
    config = {**CONFIG, "guidance_embeds": guidance}
    inputs, expected = reference(config, **shape)
    built = groups.call_all("build_random", BuildRandom(config, 7, "float32", tp=groups.world_size))
    assert len({b.parameter_bytes for b in built}) == 1  # every rank holds an equal share
    out = groups.call("forward", Inputs(inputs)).output
    assert out.shape == expected.shape
    assert (out - expected).abs().max().item() <= 1e-5


def test_packed_row_split_is_not_contiguous() -> None:
    """The single-block proj_out must take each rank's attention *and* MLP columns."""
    dims = FluxDims(heads=4, head_dim=16, double_blocks=1, single_blocks=1, guidance=False)
    pieces = shard_pieces(PackedRow(), "weight", (64, 64 + 256), rank=1, degree=2, dims=dims)
    assert pieces.dim == 1
    assert pieces.ranges == ((32, 64), (64 + 128, 64 + 256))


def test_worker_reports_bad_degree_before_building(group2: WorkerGroup) -> None:
    config = tiny_flux_config(heads=3, head_dim=16)
    with pytest.raises(WorkerError) as err:
        group2.call("build_random", BuildRandom(config, 0, "float32", tp=2))
    assert "tp_degree=2 does not divide 3 attention heads; use 3" in str(err.value)
    assert err.value.remote_type == "ConfigError"


def test_apply_validates_before_sharding() -> None:
    model = build_flux(tiny_flux_config(heads=6, head_dim=16), device="meta")
    before = parameter_bytes(model)
    with (
        fake_process_group(4),
        pytest.raises(ConfigError, match="tp_degree=4 does not divide 6 attention heads"),
    ):
        apply_tensor_parallel(model)
    assert parameter_bytes(model) == before


def _count_forward(
    config: dict, degree: int, device: str, **shape
) -> tuple[CountCollectives, torch.nn.Module]:
    dims = FluxDims.from_diffusers_config(config)
    with fake_process_group(degree, rank=degree - 1):
        model = apply_tensor_parallel(build_flux(config, device=device, seed=0 if device == "cpu" else None))
        inputs = random_inputs(dims, device=device, **shape)
        with CountCollectives() as counter, torch.no_grad():
            model(**inputs.as_kwargs())
    return counter, model


@pytest.mark.parametrize("degree", [2, 4])
def test_collectives_per_forward_small(degree: int) -> None:
    counter, model = _count_forward(CONFIG, degree, "cpu")
    # 2 per double block (attention, feed-forward: both streams at once) + 1 per single block,
    # and one all-gather for every AdaLN modulation vector of the forward.
    assert dict(counter.log.counts) == {"all_reduce": 2 * 2 + 3, "all_gather": 1}
    assert sum(isinstance(m, GatheredLinear) for m in model.modules()) == 2 * 2 + 3 + 1
    assert sum(isinstance(m, RowParallelLinear) for m in model.modules()) == 4 * 2 + 3


def test_collectives_per_forward_flux_dev_meta() -> None:
    counter, _ = _count_forward(FLUX_DEV, 4, "meta", height=1024, width=1024, text_tokens=512)
    assert dict(counter.log.counts) == {"all_reduce": 76, "all_gather": 1}
    # every all-reduce carries the whole joint sequence: (4096 image + 512 text tokens) x 3072, fp32 on meta
    assert counter.log.payload_bytes["all_reduce"] == 76 * (4096 + 512) * 3072 * 4


def flux_parameters(dims: FluxDims, degree: int) -> int:
    """FLUX parameter count per rank from the architecture, independent of the plan's code.

    Sharded: every linear of the blocks (AdaLN included), column biases. Replicated: row-parallel
    biases, q/k RMS norm weights, the embedders, the final projection.
    """
    d, hd, mlp = dims.hidden, dims.head_dim, dims.mlp

    def lin(i: int, o: int) -> int:
        return i * o + o

    double_sharded = 2 * lin(d, 6 * d) + 6 * lin(d, d) + 2 * d * d + 2 * (lin(d, 4 * d) + 4 * d * d)
    double_repl = 4 * d + 4 * hd
    single_sharded = lin(d, 3 * d) + 3 * lin(d, d) + lin(d, mlp) + (d + mlp) * d
    single_repl = d + 2 * hd
    top_sharded = lin(d, 2 * d)  # norm_out
    top_repl = lin(dims.in_channels, d) + lin(dims.text_dim, d) + lin(256, d) + lin(d, d)
    top_repl += lin(dims.pooled_dim, d) + lin(d, d) + lin(d, dims.in_channels)
    if dims.guidance:
        top_repl += lin(256, d) + lin(d, d)
    sharded = dims.double_blocks * double_sharded + dims.single_blocks * single_sharded + top_sharded
    repl = dims.double_blocks * double_repl + dims.single_blocks * single_repl + top_repl
    assert sharded % degree == 0
    return sharded // degree + repl


def test_flux_dev_parameter_count() -> None:
    model = build_flux(FLUX_DEV, device="meta")
    count = sum(p.numel() for p in model.parameters())
    assert count == flux_parameters(FluxDims.from_diffusers_config(FLUX_DEV), 1) == 11_901_408_320


@pytest.mark.parametrize("degree", [2, 4, 8])
def test_flux_dev_bytes_per_rank(degree: int) -> None:
    dims = FluxDims.from_diffusers_config(FLUX_DEV)
    with fake_process_group(degree, rank=degree - 1):
        model = apply_tensor_parallel(build_flux(FLUX_DEV, device="meta", dtype=torch.bfloat16))
    assert parameter_bytes(model) == 2 * flux_parameters(dims, degree)
    if degree == 4:
        assert parameter_bytes(model) <= 6.2e9
