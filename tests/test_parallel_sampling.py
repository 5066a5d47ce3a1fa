"""The whole job through the public API: checkpoint file → worker group → ComfyUI-exact sampling.

Parity is against the latents a real ComfyUI produced (tests/data/comfy_references.safetensors) for the
same weights, for tensor parallelism, ring, Ulysses and ring x Ulysses alike.
"""

from __future__ import annotations

import re

import pytest
import torch
from test_sampling import CASES, positive, reference

from rocm_parallel.backend.api import ParallelFlux
from rocm_parallel.backend.client import WorkerGroup
from rocm_parallel.backend.config import ConfigError, ParallelLayout
from rocm_parallel.backend.flux.sampling import resolution_mu

LAYOUTS = {
    2: [ParallelLayout(tp=2), ParallelLayout(ring=2), ParallelLayout(ulysses=2)],
    4: [
        ParallelLayout(tp=4),
        ParallelLayout(ring=4),
        ParallelLayout(ulysses=4),
        ParallelLayout(ring=2, ulysses=2),
    ],
}


def run_case(flux: ParallelFlux, name: str, progress=None) -> torch.Tensor:
    case, ref = CASES[name], reference(name)
    shift = case.get("shift")
    mu = (
        resolution_mu(case["width"], case["height"], shift["base_shift"], shift["max_shift"])
        if shift
        else None
    )
    latent = {"samples": ref["latent"]}
    if "mask" in ref:
        latent["noise_mask"] = ref["mask"]
    if case.get("batch_index") is not None:
        latent["batch_index"] = case["batch_index"]
    out = flux.sample(
        positive(ref["cond"], ref["pooled"], case.get("guidance")),
        latent,
        seed=case["seed"],
        steps=case.get("steps", 0),
        denoise=case.get("denoise", 1.0),
        sigmas=case.get("sigmas"),
        shift_mu=mu,
        progress=progress,
    )
    return out["samples"]


@pytest.mark.parametrize("groups", [2, 4], indirect=True)
def test_every_layout_matches_comfyui(groups: WorkerGroup, checkpoints: dict[str, str]) -> None:
    flux = ParallelFlux(group=groups)
    for layout in LAYOUTS[groups.world_size]:
        for variant in ("dev", "schnell"):
            flux.load(checkpoints[variant], layout=layout, dtype="float32")
            for name in sorted(n for n, c in CASES.items() if c["variant"] == variant):
                out = run_case(flux, name)
                diff = (out - reference(name)["output"]).abs().max().item()
                assert diff <= 1e-4, f"{layout} {name}: max abs diff {diff:.3g} vs ComfyUI"
    flux.unload()


def test_model_stays_resident_between_jobs(group2: WorkerGroup, checkpoints: dict[str, str]) -> None:
    flux = ParallelFlux(group=group2)
    first = flux.load(checkpoints["dev"], layout="tp", dtype="float32")
    again = flux.load(checkpoints["dev"], layout="tp", dtype="float32")
    assert [r["reused"] for r in first] == [False, False]
    assert [r["reused"] for r in again] == [True, True]
    other = flux.load(checkpoints["dev"], layout="context", dtype="float32")  # a new layout re-shards
    assert [r["reused"] for r in other] == [False, False]
    assert [r["loaded"]["ring"] for r in flux.status()] == [2, 2]
    flux.unload()
    assert [r["parameter_bytes"] for r in flux.status()] == [0, 0]


def test_progress_after_every_step(group2: WorkerGroup, checkpoints: dict[str, str]) -> None:
    flux = ParallelFlux(group=group2)
    flux.load(checkpoints["dev"], layout="tp", dtype="float32")
    seen: list[tuple[int, int]] = []
    run_case(flux, "dev_4steps", progress=lambda s, t: seen.append((s, t)))
    assert seen == [(1, 4), (2, 4), (3, 4), (4, 4)]


@pytest.mark.parametrize(
    ("latent", "message"),
    [
        (torch.ones(1, 8, 8, 8), "latent has 8 channels; FLUX latents have 16"),
        (torch.ones(1, 16, 8, 9, 1), "latent samples have shape (1, 16, 8, 9, 1); expected [batch, 16"),
    ],
)
def test_bad_latent_fails_before_any_step(
    group2: WorkerGroup, checkpoints: dict[str, str], latent: torch.Tensor, message: str
) -> None:
    flux = ParallelFlux(group=group2)
    flux.load(checkpoints["dev"], layout="tp", dtype="float32")
    ref = reference("dev_4steps")
    with pytest.raises(ConfigError, match=re.escape(message)):
        flux.sample(positive(ref["cond"], ref["pooled"]), {"samples": latent}, seed=0, steps=2)


def test_sequence_too_short_for_the_degree(group4: WorkerGroup, checkpoints: dict[str, str]) -> None:
    flux = ParallelFlux(group=group4)
    flux.load(checkpoints["dev"], layout="context", dtype="float32")
    ref = reference("dev_4steps")
    with pytest.raises(ConfigError) as err:  # 16x32 px = 1x2 image tokens for 4 devices
        flux.sample(
            positive(ref["cond"], ref["pooled"]), {"samples": torch.zeros(1, 16, 2, 4)}, seed=0, steps=2
        )
    assert str(err.value) == (
        "an image of 2 tokens is too short for ring=4 x ulysses=1 = 4 devices: each needs at least one image "
        "token (16x16 pixels); use an image of at least 4 tokens or fewer devices"
    )


def test_sample_without_a_checkpoint() -> None:
    flux = ParallelFlux(["cpu", "cpu"])
    with pytest.raises(ConfigError, match=r"no checkpoint is loaded; call load\(checkpoint\) first"):
        flux.sample([], {"samples": torch.zeros(1, 16, 8, 8)}, seed=0, steps=1)
    assert not flux.started  # validation needed no worker


def test_a_killed_worker_fails_the_job_and_the_next_job_recovers(checkpoints: dict[str, str]) -> None:
    """Own group: a worker is SIGKILLed mid-job; the caller hears which rank, the next job just works."""
    import os
    import signal
    import threading

    from rocm_parallel.backend.client import WorkerError

    with ParallelFlux(["cpu", "cpu"], threads=1) as flux:
        flux.load(checkpoints["dev"], layout="tp", dtype="float32")
        victim = flux.group.pids[1]
        ref = reference("dev_4steps")

        def kill_at_step(step: int, total: int) -> None:
            if step == 2:
                threading.Thread(target=os.kill, args=(victim, signal.SIGKILL)).start()

        with pytest.raises(WorkerError) as err:
            flux.sample(
                positive(ref["cond"], ref["pooled"], 3.5),
                {"samples": ref["latent"]},
                seed=0,
                steps=400,
                progress=kill_at_step,
            )
        assert f"worker rank 1 (cpu, pid {victim}) exited with code -9" in str(err.value)
        assert not flux.started
        out = run_case(flux, "dev_4steps")  # a fresh group, the checkpoint loaded again
        assert (out - ref["output"]).abs().max().item() <= 1e-4
        assert victim not in flux.group.pids


def test_cancel_mid_sampling_keeps_the_model_resident(
    group2: WorkerGroup, checkpoints: dict[str, str]
) -> None:
    class Interrupted(Exception):
        pass

    flux = ParallelFlux(group=group2)
    flux.load(checkpoints["dev"], layout="context", dtype="float32")
    steps: list[int] = []

    def cancel_at_three(step: int, total: int) -> None:
        steps.append(step)
        if step == 3:
            raise Interrupted

    ref = reference("dev_4steps")
    with pytest.raises(Interrupted):
        flux.sample(positive(ref["cond"], ref["pooled"]), {"samples": ref["latent"]}, seed=0, steps=300,
                    progress=cancel_at_three)  # fmt: skip
    assert steps[-1] <= 4
    # every rank stopped at the agreed step (mutation tried: `step_done` never raising JobCancelled)
    errors = [r.error for r in group2.last_replies.values()]
    assert errors[0] == errors[1] and errors[0] in (
        f"JobCancelled: cancelled after step {s} of 300" for s in (3, 4)
    )
    assert all(r["loaded"] is not None for r in flux.status())
    out = run_case(flux, "dev_4steps")
    assert (out - ref["output"]).abs().max().item() <= 1e-4
