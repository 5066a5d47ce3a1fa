"""Validation messages: exact text, raised before anything is built."""

import pytest

from rocm_parallel.backend.config import ConfigError, ParallelLayout, validate_tp_degree
from rocm_parallel.backend.flux.dims import FluxDims
from rocm_parallel.backend.flux.model import FLUX_DEV

DEV = FluxDims.from_diffusers_config(FLUX_DEV)


def test_dev_dims() -> None:
    assert (DEV.heads, DEV.hidden, DEV.mlp, DEV.double_blocks, DEV.single_blocks) == (24, 3072, 12288, 19, 38)
    assert DEV.guidance


@pytest.mark.parametrize("degree", [1, 2, 3, 4, 6, 8, 12, 24])
def test_valid_tp_degrees(degree: int) -> None:
    validate_tp_degree(degree, DEV)


def test_tp_degree_not_dividing_heads() -> None:
    with pytest.raises(ConfigError) as err:
        validate_tp_degree(5, DEV)
    assert str(err.value) == "tp_degree=5 does not divide 24 attention heads; use 2, 3, 4, 6, 8, 12 or 24"


@pytest.mark.parametrize("bad", [0, -2, 2.0, True])
def test_tp_degree_not_positive_int(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"must be a positive integer; use 1 for no tensor parallelism"):
        validate_tp_degree(bad, DEV)  # type: ignore[arg-type]


def test_odd_mlp_ratio_is_caught() -> None:
    dims = FluxDims(heads=8, head_dim=8, double_blocks=1, single_blocks=1, guidance=False, mlp_ratio=4.0625)
    with pytest.raises(ConfigError) as err:
        validate_tp_degree(8, dims)
    assert str(err.value) == "tp_degree=8 does not divide the MLP width 260; use 2 or 4"


def test_layout_device_count() -> None:
    with pytest.raises(ConfigError) as err:
        ParallelLayout(tp=4).validate(DEV, devices=2)
    assert str(err.value) == (
        "the layout tp 4 needs 4 devices (batch x tp x ring x ulysses) but 2 were given; make the product 2 "
        "(e.g. tp 2)"
    )


def test_a_model_with_one_head_says_no_degree_fits() -> None:
    one_head = FluxDims(heads=1, head_dim=128, double_blocks=1, single_blocks=1, guidance=False)
    with pytest.raises(ConfigError) as err:
        validate_tp_degree(2, one_head)
    assert (
        str(err.value)
        == "tp_degree=2 does not divide 1 attention heads; use 1 (no degree above 1 divides it)"
    )
