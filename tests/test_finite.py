"""all_finite: the one NaN/inf check behind the loader, every model call and every step."""

from __future__ import annotations

import pytest
import torch

from rocm_parallel.backend.diffusion import finite
from rocm_parallel.backend.diffusion.finite import all_finite, non_finite_kind

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2]


BAD = [(float("nan"), "NaN"), (float("inf"), "inf"), (-float("inf"), "inf")]
# float8_e4m3fn has no inf (torch saturates one to 448 on the way in): NaN is its only non-finite value.
CASES = [(d, b, k) for d in DTYPES for b, k in BAD if k == "NaN" or d != torch.float8_e4m3fn]


@pytest.mark.parametrize(("dtype", "bad", "kind"), CASES, ids=str)
def test_one_bad_value_anywhere_is_found(dtype: torch.dtype, bad: float, kind: str) -> None:
    clean = torch.randn(4, 16, 9, 7).to(dtype)
    assert all_finite(clean)
    for index in (0, 517, clean.numel() - 1):  # first, middle, last
        broken = clean.clone().view(-1)
        broken[index] = torch.tensor(bad).to(dtype)
        assert not all_finite(broken.view(clean.shape))
        assert non_finite_kind(broken) == kind


def test_every_chunk_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(finite, "CHUNK", 10)
    x = torch.zeros(95)
    assert all_finite(x)
    x[94] = float("nan")  # in the last, short chunk
    assert not all_finite(x)


def test_views_extremes_and_other_tensors() -> None:
    x = torch.randn(8, 6)
    x[5, 2] = float("inf")
    assert not all_finite(x.t())  # a non-contiguous view
    big = torch.tensor([torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max])
    assert all_finite(big)  # finite extremes are finite (their difference would overflow)
    assert all_finite(torch.empty(0)) and all_finite(torch.arange(5))
