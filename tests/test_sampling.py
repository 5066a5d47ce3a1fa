"""FLUX sampling: parity with a real ComfyUI's KSampler / SamplerCustom, schedules, tokens, noise, errors.

The references in tests/data/comfy_references.safetensors were produced with ComfyUI itself by
tests/tools/make_comfy_references.py (the commit is in the file's metadata); these tests only read them.
"""

from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from rocm_parallel.backend.config import ConfigError
from rocm_parallel.backend.diffusion.api import ParallelModel
from rocm_parallel.backend.diffusion.sampling import denoise_schedule, euler, prepare_noise, simple_schedule
from rocm_parallel.backend.flux.forward import patchify, unpatchify
from rocm_parallel.backend.flux.model import build_flux
from rocm_parallel.backend.flux.sampling import (
    diffusers_model_fn,
    flux_sigma_table,
    resolution_mu,
    sample_flux,
    schnell_sigma_table,
)
from rocm_parallel.backend.flux2.forward import flux2_call, flux2_model_fn
from rocm_parallel.backend.flux2.model import build_flux2
from rocm_parallel.backend.flux2.sampling import flux2_schedule
from rocm_parallel.testing.models import tiny_flux2_config, tiny_flux_config

REFERENCES = Path(__file__).parent / "data" / "comfy_references.safetensors"
with safe_open(str(REFERENCES), "pt") as _f:
    META = _f.metadata()
ALL_CASES = json.loads(META["cases"])
# The cases the built-in Euler loop (`ParallelModel.sample`, `sample_flux`) reproduces: euler / simple at
# cfg 1 without a LoRA or Kontext's reference latents. The others (ComfyUI's other samplers, CFG, guiders, LoRA) run through ComfyUI's
# own sampling over the forward service: tests/test_service.py and the real-ComfyUI tier.
CASES = {
    name: case
    for name, case in ALL_CASES.items()
    if case.get("sampler", "euler") == "euler"
    and case.get("scheduler", "simple") == "simple"
    and case.get("cfg", 1.0) == 1.0
    and not {"lora", "guider", "record_calls", "negative", "refs"} & set(case)
}
MODELS = json.loads(META["models"])
# FLUX.2 (ComfyUI 0.3.75's template: EmptyFlux2LatentImage, Flux2Scheduler, euler, SamplerCustomAdvanced);
# the cases `ParallelModel.sample` reproduces are the ones without ReferenceLatent's latents.
FLUX2_MODELS = json.loads(META["flux2_models"])
FLUX2_CASES = {
    n: c for n, c in json.loads(META["flux2_cases"]).items() if not {"refs", "record_calls"} & set(c)
}


@cache
def flux2_model(variant: str) -> torch.nn.Module:
    spec = FLUX2_MODELS[variant]
    return build_flux2(
        tiny_flux2_config(**spec["config"]), seed=spec["seed"], init_scale=spec.get("init_scale", 0.05)
    )


def flux2_job(name: str) -> dict:
    """A FLUX.2 case as `ParallelModel.sample` takes it: CLIPTextEncode's CONDITIONING (FluxGuidance's value
    for [dev]) and EmptyFlux2LatentImage's latent."""
    case, ref = FLUX2_CASES[name], reference(name)
    extras = {"pooled_output": None} | ({"guidance": case["guidance"]} if "guidance" in case else {})
    latent = torch.zeros(1, 128, case["height"] // 16, case["width"] // 16)
    return {"positive": [[ref["cond"], extras]], "latent": {"samples": latent}, "seed": case["seed"],
            "steps": case["steps"]}  # fmt: skip


@cache
def flux_model(variant: str) -> torch.nn.Module:
    spec = MODELS[variant]
    return build_flux(tiny_flux_config(**spec["config"]), seed=spec["seed"])


def reference(name: str) -> dict[str, torch.Tensor]:
    with safe_open(str(REFERENCES), "pt") as f:
        return {k.split(".", 1)[1]: f.get_tensor(k) for k in f.keys() if k.startswith(name + ".")}


def flux_sigma(t: float, mu: float = 1.15) -> float:
    """The FLUX time shift, in float64, independently of the table code."""
    return math.exp(mu) / (math.exp(mu) + (1.0 / t - 1.0))


def positive(cond: torch.Tensor, pooled: torch.Tensor, guidance: float | None = None) -> list:
    extras = {"pooled_output": pooled}
    if guidance is not None:
        extras["guidance"] = guidance
    return [[cond, extras]]


# --- parity with ComfyUI --------------------------------------------------------------------------


def test_references_come_from_a_real_comfyui():
    assert len(META["comfyui_commit"]) == 40
    assert {"dev_4steps", "schnell_4steps", "img2img_denoise06", "inpaint_mask", "batch2", "batch2_index",
            "nonsquare", "model_sampling_flux", "custom_sigmas", "odd_size"} <= set(CASES)  # fmt: skip
    assert {"dpmpp_2m_beta", "euler_ancestral_normal", "heun_sgm_uniform", "cfg_negative",
            "custom_advanced_cfg_guider", "lora_bfl", "lora_kohya", "model_calls"} <= set(ALL_CASES)  # fmt: skip


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_comfyui(name):
    case, ref = CASES[name], reference(name)
    shift = case.get("shift")
    mu = None
    if shift is not None:
        mu = resolution_mu(case["width"], case["height"], shift["base_shift"], shift["max_shift"])
    steps_seen = []
    out = sample_flux(
        diffusers_model_fn(flux_model(case["variant"])),
        ref["latent"],
        positive(ref["cond"], ref["pooled"], case.get("guidance")),
        seed=case["seed"],
        steps=case.get("steps", 0),
        denoise=case.get("denoise", 1.0),
        sigmas=case.get("sigmas"),
        noise_mask=ref.get("mask"),
        batch_index=case.get("batch_index"),
        variant=case["variant"],
        shift_mu=mu,
        callback=lambda i, n: steps_seen.append((i, n)),
    )
    assert out.shape == ref["output"].shape
    assert out.dtype == torch.float32
    diff = (out - ref["output"]).abs().max().item()
    assert diff <= 1e-4, f"{name}: max abs diff {diff:.3g} vs ComfyUI"
    total = len(case["sigmas"]) - 1 if "sigmas" in case else case["steps"]
    assert steps_seen == [(i, total) for i in range(1, total + 1)]


def test_guidance_matters_for_dev_and_is_ignored_for_schnell():
    """Guards the parity test against guidance being silently dropped (or wrongly passed to schnell)."""
    ref = reference("dev_4steps")
    run = {
        v: lambda g, v=v: sample_flux(
            diffusers_model_fn(flux_model(v)),
            torch.zeros(1, 16, 4, 4),
            positive(ref["cond"], ref["pooled"], g),
            seed=1,
            steps=2,
            variant=v,
        )
        for v in ("dev", "schnell")
    }
    assert (run["dev"](1.0) - run["dev"](5.0)).abs().max() > 1e-3
    assert torch.equal(run["schnell"](1.0), run["schnell"](5.0))


# --- FLUX.2: ComfyUI's template, one process ------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FLUX2_CASES))
def test_flux2_schedule_is_comfyuis_flux2scheduler(name: str) -> None:
    """The sigmas ComfyUI's Flux2Scheduler gave for the case's size and steps, bit for bit."""
    case = FLUX2_CASES[name]
    assert torch.equal(
        flux2_schedule(case["steps"], case["width"], case["height"]), reference(name)["sigmas"]
    )


@pytest.mark.parametrize("name", sorted(FLUX2_CASES))
def test_flux2_sampling_matches_comfyui(name: str, flux2_checkpoints: dict[str, str]) -> None:
    """`sample()`'s plan and loop in one process (the family's schedule, conditioning padded to 512 tokens,
    the identity latent format) around the same transformer ComfyUI sampled."""
    case, job = FLUX2_CASES[name], flux2_job(name)
    plan = ParallelModel.check_sample(
        job["positive"], job["latent"], checkpoint=flux2_checkpoints[case["variant"]], seed=job["seed"],
        steps=job["steps"],
    )  # fmt: skip
    assert torch.equal(plan.sigmas, reference(name)["sigmas"])
    assert plan.inputs["context"].shape[1] == 512 and (plan.inputs["guidance"] is None) == (
        "guidance" not in case
    )
    steps_seen: list[tuple[int, int]] = []
    fn = flux2_model_fn(flux2_model(case["variant"]))
    call = lambda x, t, inputs: flux2_call(fn, x, t, **inputs)  # noqa: E731
    out = euler(call, plan, lambda i, n: steps_seen.append((i, n)))
    diff = (out - reference(name)["output"]).abs().max().item()
    assert diff <= 1e-4, f"{name}: max abs diff {diff:.3g} vs ComfyUI"
    assert steps_seen == [(i, case["steps"]) for i in range(1, case["steps"] + 1)]


def test_flux2_refuses_flux1s_shift_and_names_what_applies(flux2_checkpoints: dict[str, str]) -> None:
    job = flux2_job("flux2_4steps")
    with pytest.raises(ConfigError) as err:
        ParallelModel.check_sample(
            job["positive"],
            job["latent"],
            checkpoint=flux2_checkpoints["flux2"],
            seed=0,
            steps=4,
            shift_mu=1.15,
        )
    assert str(err.value) == (
        "shift_mu is FLUX.1's ModelSamplingFlux shift; FLUX.2 (4 heads, 2+2 blocks) samples with Flux2Scheduler's "
        "schedule, which sets its own shift from the image size and steps: leave shift_mu unset, or pass sigmas"
    )
    with pytest.raises(ConfigError) as err:
        ParallelModel.check_sample(
            job["positive"], {"samples": torch.ones(1, 16, 4, 6)}, checkpoint=flux2_checkpoints["flux2"], seed=0,
            steps=4,
        )  # fmt: skip
    assert str(err.value) == (
        "latent has 16 channels; FLUX.2 (4 heads, 2+2 blocks) latents have 128: encode the image with the FLUX.2 "
        "VAE (flux2-vae.safetensors) or start from EmptyFlux2LatentImage"
    )


# --- schedules --------------------------------------------------------------------------------------


def test_flux_table_follows_the_time_shift_formula():
    table = flux_sigma_table()
    assert table.shape == (10000,) and table.dtype == torch.float32
    for index in (0, 1, 999, 4999, 7499, 9998, 9999):
        t = (index + 1) / 10000
        assert table[index].item() == pytest.approx(flux_sigma(t), abs=1e-6)
    assert table[-1].item() == 1.0


def test_schnell_table_is_plain_time():
    table = schnell_sigma_table()
    assert table.shape == (1000,)
    assert torch.allclose(table, torch.arange(1, 1001, dtype=torch.float64).float() / 1000, atol=0, rtol=0)


def test_simple_schedule_dev_and_schnell():
    dev = simple_schedule(flux_sigma_table(), 4)
    expected = [flux_sigma(t) for t in (1.0, 0.75, 0.5, 0.25)] + [0.0]
    assert dev.tolist() == pytest.approx(expected, abs=1e-6)
    assert simple_schedule(schnell_sigma_table(), 4).tolist() == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])


def test_denoise_keeps_the_tail_of_a_longer_schedule():
    # steps 5 at denoise 0.6 -> int(5 / 0.6) = 8 steps, the last 5 (+ the final 0) are run.
    sigmas = denoise_schedule(flux_sigma_table(), 5, 0.6)
    expected = [flux_sigma(k / 8) for k in (5, 4, 3, 2, 1)] + [0.0]
    assert sigmas.tolist() == pytest.approx(expected, abs=1e-6)
    assert (
        denoise_schedule(flux_sigma_table(), 5, 1.0).tolist()
        == simple_schedule(flux_sigma_table(), 5).tolist()
    )
    assert len(denoise_schedule(flux_sigma_table(), 5, 0.0)) == 0


def test_resolution_shift():
    assert resolution_mu(1024, 1024) == pytest.approx(1.15)
    assert resolution_mu(256, 256) == pytest.approx(0.5)
    assert resolution_mu(512, 512) == pytest.approx(0.5 + 0.65 * (1024 - 256) / 3840)
    # mu shifts the whole table: larger images keep more noise at the same t.
    assert flux_sigma_table(resolution_mu(1024, 1024))[4999] > flux_sigma_table(resolution_mu(512, 512))[4999]


# --- tokens and noise ------------------------------------------------------------------------------


def test_patchify_layout_and_round_trip():
    latent = torch.randn(2, 16, 6, 10)
    tokens = patchify(latent)
    assert tokens.shape == (2, 15, 64)
    b, c, i, j, ph, pw = 1, 5, 2, 3, 1, 0
    assert tokens[b, i * 5 + j, c * 4 + ph * 2 + pw] == latent[b, c, 2 * i + ph, 2 * j + pw]
    assert torch.equal(unpatchify(tokens, 6, 10), latent)


def test_noise_is_reproducible_and_per_batch_index():
    shape = (2, 16, 4, 6)
    a, b = prepare_noise(shape, 42), prepare_noise(shape, 42)
    assert torch.equal(a, b)
    assert not torch.equal(a, prepare_noise(shape, 43))
    # Index k gets the k-th draw of the batch, whatever else is in the batch.
    assert torch.equal(prepare_noise(shape, 42, batch_index=[0, 1]), a)
    assert torch.equal(prepare_noise((1, 16, 4, 6), 42, batch_index=[1]), a[1:])
    assert torch.equal(prepare_noise(shape, 42, batch_index=[1, 1]), a[1:].repeat(2, 1, 1, 1))
    # Global RNG is left alone (ComfyUI reseeds it; a worker must not depend on that).
    torch.manual_seed(0)
    before = torch.get_rng_state()
    prepare_noise(shape, 42)
    assert torch.equal(torch.get_rng_state(), before)


def test_denoise_zero_returns_the_latent_untouched():
    ref = reference("dev_4steps")
    latent = torch.randn(1, 16, 4, 4)
    calls = []
    out = sample_flux(
        lambda *a: calls.append(1), latent, positive(ref["cond"], ref["pooled"]), seed=0, steps=4, denoise=0.0
    )
    assert torch.equal(out, latent) and not calls


# --- bad input ---------------------------------------------------------------------------------------


def run_with(latent=None, cond=None, **kwargs):
    ref = reference("dev_4steps")
    latent = torch.randn(1, 16, 4, 4) if latent is None else latent
    cond = positive(ref["cond"], ref["pooled"]) if cond is None else cond
    return sample_flux(lambda *a: pytest.fail("model called"), latent, cond, seed=0, steps=2, **kwargs)


def test_rejects_wrong_latent_channels():
    with pytest.raises(ConfigError) as err:
        run_with(latent=torch.randn(1, 4, 8, 8))
    assert str(err.value) == (
        "latent has 4 channels; FLUX latents have 16: encode the image with the FLUX VAE (ae.safetensors) "
        "or start from EmptySD3LatentImage"
    )


def test_rejects_several_conditioning_entries():
    ref = reference("dev_4steps")
    entry = [ref["cond"], {"pooled_output": ref["pooled"]}]
    with pytest.raises(ConfigError) as err:
        run_with(cond=[entry, entry])
    assert str(err.value) == (
        "positive conditioning has 2 entries; this sampler supports exactly 1 "
        "(no Conditioning Combine / Set Area / Concat yet): encode one prompt with CLIPTextEncode"
    )


def test_rejects_area_conditioning():
    ref = reference("dev_4steps")
    cond = [[ref["cond"], {"pooled_output": ref["pooled"], "area": (8, 8, 0, 0), "strength": 1.0}]]
    with pytest.raises(ConfigError) as err:
        run_with(cond=cond)
    assert str(err.value) == (
        "positive conditioning sets area, strength, which this sampler does not support yet "
        "(supported: pooled_output, guidance); remove the node that adds them"
    )


def test_rejects_bad_settings():
    with pytest.raises(ConfigError, match=r"^variant='pro' is not a FLUX.1 variant; use 'dev' or 'schnell'$"):
        run_with(variant="pro")
    with pytest.raises(ConfigError, match=r"^denoise=1.5 must be between 0 and 1$"):
        run_with(denoise=1.5)
    with pytest.raises(
        ConfigError, match=r"^batch_index \[0, 1\] must list one index >= 0 for each of the 1"
    ):
        run_with(batch_index=[0, 1])
