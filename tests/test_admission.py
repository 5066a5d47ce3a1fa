"""Admission control (backend/admission.py): an image too large for the machine is refused in the caller,
before the caller allocates anything for it and before any rank runs, with the size, the estimate, the
limit and what would fit. Steps are bounded as ComfyUI bounds them.

Mutation tried: with the `self._admit(...)` line removed from `ParallelModel.sample`, the first test fails
(the refusal does not come; the caller's noise alone grows it by 1 GB).
"""

from __future__ import annotations

import re

import psutil
import pytest
import torch

from rocm_parallel.backend.admission import activation_estimate
from rocm_parallel.backend.api import ParallelModel
from rocm_parallel.backend.checkpoint import inspect_checkpoint
from rocm_parallel.backend.client import WorkerGroup
from rocm_parallel.backend.config import ConfigError, ParallelLayout

MB = 1 << 20


def _prompt(info) -> list:  # a short prompt of the checkpoint's widths (T5 tokens, CLIP pooled)
    dims = info.dims
    return [
        [
            torch.zeros(1, 16, dims.text_dim),
            {"pooled_output": torch.zeros(1, dims.pooled_dim), "guidance": 3.5},
        ]
    ]


def _side_beyond(info, layout: ParallelLayout, limit: float) -> int:
    """A latent side (latent pixels) whose activation estimate exceeds `limit`."""
    side = 64
    while activation_estimate(info, layout, (1, 16, side, side), dtype="float32", text_tokens=16) <= limit:
        side *= 2
    return side


def test_an_image_too_large_for_the_machine_is_refused_before_anything_runs(
    group2: WorkerGroup, checkpoints: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    flux = ParallelModel(group=group2)
    flux.load(checkpoints["dev"], layout="tp", dtype="float32")
    info = inspect_checkpoint(checkpoints["dev"])
    side = _side_beyond(info, ParallelLayout(tp=2), psutil.virtual_memory().total)  # more than all RAM
    # A latent of that size without its memory (an expanded view): what the caller allocates is measured.
    latent = {"samples": torch.zeros(1, 16, 1, 1).expand(1, 16, side, side)}
    calls: list[str] = []
    real_call_all = group2.call_all
    monkeypatch.setattr(
        group2, "call_all", lambda method, *a, **k: calls.append(method) or real_call_all(method, *a, **k)
    )
    before = psutil.Process().memory_info().rss
    with pytest.raises(ConfigError) as err:
        flux.sample(_prompt(info), latent, seed=0, steps=4)
    grown = psutil.Process().memory_info().rss - before
    assert calls == []  # no rank ran anything for it
    assert grown < 64 * MB, f"the caller grew by {grown / MB:.0f} MB before refusing"
    px = side * 8
    text = str(err.value)
    pattern = (
        rf"latent of {px}x{px} px \(batch 1, shape \[1, 16, {side}, {side}\]\) needs about (\d+\.\d) GB of "
        r"activations per CPU worker in layout tp 2 \(float32\), but (\d+\.\d) GB of host memory are available "
        r"to 2 CPU worker\(s\) \(80% of it shared between them\): the limit is (\d+\.\d) GB per CPU worker\. "
        r"What fits: at most (\d+)x(\d+) px per image in this layout; or more devices, or a smaller image, "
        r"then upscale"
    )
    found = re.fullmatch(pattern, text)
    assert found, text
    estimate, available, limit, fit_w, fit_h = (float(g) for g in found.groups())
    assert estimate > limit and limit == pytest.approx(available * 0.8 / 2, abs=0.1)
    assert fit_w == fit_h and 0 < fit_w < px
    # What it says fits does fit, and the next job on the same group runs.
    fits = int(fit_w) // 8
    assert (
        activation_estimate(info, ParallelLayout(tp=2), (1, 16, fits, fits), dtype="float32", text_tokens=16)
        <= (limit + 0.05) * 1e9
    )
    out = flux.sample(_prompt(info), {"samples": torch.zeros(1, 16, 8, 8)}, seed=0, steps=1)
    assert out["samples"].shape == (1, 16, 8, 8) and calls  # ran on the ranks this time


def test_a_model_call_too_large_is_refused_before_the_ranks(
    group2: WorkerGroup, checkpoints: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    flux = ParallelModel(group=group2)
    flux.load(checkpoints["dev"], layout="tp", dtype="float32")
    info = inspect_checkpoint(checkpoints["dev"])
    side = _side_beyond(info, ParallelLayout(tp=2), psutil.virtual_memory().total)
    calls: list[str] = []
    real_call_all = group2.call_all
    monkeypatch.setattr(
        group2, "call_all", lambda method, *a, **k: calls.append(method) or real_call_all(method, *a, **k)
    )
    x = torch.zeros(1, 16, 1, 1).expand(2, 16, side, side)
    (cond, extras) = _prompt(info)[0]
    with pytest.raises(
        ConfigError,
        match=rf"^x of {side * 8}x{side * 8} px \(batch 2, shape \[2, 16, {side}, {side}\]\) needs about ",
    ):
        flux.forward(
            x,
            torch.ones(2),
            cond.expand(2, -1, -1),
            extras["pooled_output"].expand(2, -1),
            torch.full((2,), 3.5),
        )
    assert calls == []


@pytest.mark.parametrize("steps", [0, 10001, 10**9])
def test_steps_are_bounded_as_comfyui_bounds_them(checkpoints: dict[str, str], steps: int) -> None:
    info = inspect_checkpoint(checkpoints["dev"])
    with pytest.raises(ConfigError) as err:
        ParallelModel.check_sample(
            _prompt(info), {"samples": torch.zeros(1, 16, 8, 8)}, checkpoint=info, seed=0, steps=steps
        )
    assert str(err.value) == (f"steps={steps} must be from 1 to 10000, as ComfyUI's KSampler allows")
