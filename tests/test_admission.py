"""Admission control (backend/diffusion/admission.py): an image too large for the machine is refused in the caller,
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

from rocm_parallel.backend.checkpoint import inspect_checkpoint
from rocm_parallel.backend.config import ConfigError, ParallelLayout
from rocm_parallel.backend.diffusion.admission import activation_estimate
from rocm_parallel.backend.diffusion.api import ParallelModel
from rocm_parallel.backend.runtime.client import WorkerGroup

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


@pytest.mark.slow
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


def test_the_gpu_limit_is_the_fullest_gpus() -> None:
    """Every rank holds the same shard of activations: the GPU with the least free memory bounds them all.
    Mutation tried: `max(free)` (the emptiest GPU) allowed 9.0 GB where the fullest had 2.0 GB free."""
    from rocm_parallel.backend.diffusion.admission import memory_limit
    from rocm_parallel.backend.resident.admission import GPU_SHARE
    from rocm_parallel.backend.resident.messages import DeviceMemory, RankStatus

    reports = [
        RankStatus(rank, f"cuda:{rank}", memory=DeviceMemory(10.0, 10.0, free, 24.0))
        for rank, free in enumerate((10.0, 2.0, 6.0))
    ]
    limit, why = memory_limit(["cuda:0", "cuda:1", "cuda:2"], reports)
    assert limit == pytest.approx(2.0 * 1e9 * GPU_SHARE)
    assert why == "the fullest GPU has 2.0 GB free after loading the weights"


def test_a_5d_latent_is_priced_by_its_height_and_width(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen-Image's latents are [B, C, 1, H, W]: priced as [B, C, H, W], and named so when refused.
    Mutation tried: reading them as 4-D (H = 1) priced this tiny model 67 times low (the issue saw Qwen-Image
    at 1280 px priced 0.02 GB instead of 0.42)."""
    from rocm_parallel.backend.checkpoint import save_checkpoint
    from rocm_parallel.backend.diffusion import admission
    from rocm_parallel.backend.qwen_image.model import build_qwen_image
    from rocm_parallel.testing.models import tiny_qwen_image_config

    config = tiny_qwen_image_config(heads=4, head_dim=16, blocks=2, text_dim=32)
    path = save_checkpoint(build_qwen_image(config, seed=0), tmp_path / "qwen.safetensors", prefix=True)
    info = inspect_checkpoint(path)
    layout = ParallelLayout(tp=2)
    five = activation_estimate(info, layout, (1, 16, 1, 160, 160), dtype="float32", text_tokens=16)
    four = activation_estimate(info, layout, (1, 16, 160, 160), dtype="float32", text_tokens=16)
    assert (
        five
        == four
        > 10 * activation_estimate(info, layout, (1, 16, 160, 1), dtype="float32", text_tokens=16)
    )
    monkeypatch.setattr(admission, "memory_limit", lambda devices, reports: (four / 2, "a test's limit"))
    with pytest.raises(
        ConfigError, match=r"^latent of 1280x1280 px \(batch 1, shape \[1, 16, 1, 160, 160\]\) "
    ):
        admission.admit(
            info, layout, ["cpu", "cpu"], [], (1, 16, 1, 160, 160), dtype="float32", text_tokens=16
        )


def test_a_model_call_is_priced_with_its_reference_latents(
    group2: WorkerGroup, checkpoints: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kontext's reference latents ride along as image tokens: a call that fits without them and not with
    them is refused before the ranks. Mutation tried: `forward` admitting without the reference tokens ran
    the call."""
    from rocm_parallel.backend.diffusion import admission

    flux = ParallelModel(group=group2)
    flux.load(checkpoints["dev"], layout="tp", dtype="float32")
    info = inspect_checkpoint(checkpoints["dev"])
    layout, x, ref = ParallelLayout(tp=2), torch.zeros(1, 16, 16, 16), torch.zeros(1, 16, 64, 64)
    alone = activation_estimate(info, layout, tuple(x.shape), dtype="float32", text_tokens=16)
    tokens = info.model_family.tokens((1, 16, 64, 64))
    both = activation_estimate(
        info, layout, tuple(x.shape), dtype="float32", text_tokens=16, reference_tokens=tokens
    )
    assert both > alone
    monkeypatch.setattr(
        admission, "memory_limit", lambda devices, reports: ((alone + both) / 2, "a test's limit")
    )
    (cond, extras) = _prompt(info)[0]
    call = (x, torch.ones(1), cond, extras["pooled_output"], torch.full((1,), 3.5))
    flux.forward(*call)  # fits without references
    before = group2._job
    with pytest.raises(
        ConfigError, match=r"^x of 128x128 px \(batch 1, shape \[1, 16, 16, 16\]\) needs about "
    ):
        flux.forward(*call, ref_latents=[ref])
    assert group2._job == before
