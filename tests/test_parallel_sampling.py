"""The whole job through the public API: checkpoint file → worker group → ComfyUI-exact sampling.

`sample` is the Euler loop in the caller over `forward` (one request to every rank per step). Parity is
against the latents a real ComfyUI produced (tests/data/comfy_references.safetensors) for the same
weights, FLUX.1 and FLUX.2, for tensor parallelism, ring, Ulysses and ring x Ulysses alike, and for FLUX.2
also against the same loop in one process.
"""

from __future__ import annotations

import re
import time

import pytest
import torch
from test_sampling import CASES, FLUX2_CASES, flux2_job, flux2_model, positive, reference

from rocm_parallel.backend.config import ConfigError, ParallelLayout
from rocm_parallel.backend.diffusion.api import ParallelModel
from rocm_parallel.backend.diffusion.sampling import euler
from rocm_parallel.backend.flux.sampling import resolution_mu
from rocm_parallel.backend.flux2.forward import flux2_call, flux2_model_fn
from rocm_parallel.backend.runtime.client import WorkerGroup

LAYOUTS = {
    2: [ParallelLayout(tp=2), ParallelLayout(ring=2), ParallelLayout(ulysses=2)],
    4: [
        ParallelLayout(tp=4),
        ParallelLayout(ring=4),
        ParallelLayout(ulysses=4),
        ParallelLayout(ring=2, ulysses=2),
    ],
}


def run_case(flux: ParallelModel, name: str, progress=None) -> torch.Tensor:
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


@pytest.mark.slow
@pytest.mark.parametrize("groups", [2, 4], indirect=True)
def test_every_layout_matches_comfyui(groups: WorkerGroup, checkpoints: dict[str, str]) -> None:
    flux = ParallelModel(group=groups)
    for layout in LAYOUTS[groups.world_size]:
        for variant in ("dev", "schnell"):
            flux.load(checkpoints[variant], layout=layout, dtype="float32")
            for name in sorted(n for n, c in CASES.items() if c["variant"] == variant):
                out = run_case(flux, name)
                diff = (out - reference(name)["output"]).abs().max().item()
                assert diff <= 1e-4, f"{layout} {name}: max abs diff {diff:.3g} vs ComfyUI"
    flux.unload()


def test_model_stays_resident_between_jobs(group2: WorkerGroup, checkpoints: dict[str, str]) -> None:
    flux = ParallelModel(group=group2)
    first = flux.load(checkpoints["dev"], layout="tp", dtype="float32")
    again = flux.load(checkpoints["dev"], layout="tp", dtype="float32")
    assert [r.reused for r in first] == [False, False]
    assert [r.reused for r in again] == [True, True]
    other = flux.load(checkpoints["dev"], layout="context", dtype="float32")  # a new layout re-shards
    assert [r.reused for r in other] == [False, False]
    assert [r.loaded.layout.ring for r in flux.status()] == [2, 2]
    flux.unload()
    assert [r.parameter_bytes for r in flux.status()] == [0, 0]


def test_progress_after_every_step(group2: WorkerGroup, checkpoints: dict[str, str]) -> None:
    flux = ParallelModel(group=group2)
    flux.load(checkpoints["dev"], layout="tp", dtype="float32")
    seen: list[tuple[int, int]] = []
    run_case(flux, "dev_4steps", progress=lambda s, t: seen.append((s, t)))
    assert seen == [(1, 4), (2, 4), (3, 4), (4, 4)]


@pytest.mark.parametrize(
    ("latent", "message"),
    [
        (torch.ones(1, 8, 8, 8), "latent has 8 channels; FLUX.1-dev latents have 16"),
        (torch.ones(1, 16, 8, 9, 1), "latent samples have shape (1, 16, 8, 9, 1); expected [batch, 16"),
    ],
)
def test_bad_latent_fails_before_any_step(
    group2: WorkerGroup, checkpoints: dict[str, str], latent: torch.Tensor, message: str
) -> None:
    flux = ParallelModel(group=group2)
    flux.load(checkpoints["dev"], layout="tp", dtype="float32")
    ref = reference("dev_4steps")
    with pytest.raises(ConfigError, match=re.escape(message)):
        flux.sample(positive(ref["cond"], ref["pooled"]), {"samples": latent}, seed=0, steps=2)


def test_sequence_too_short_for_the_degree(group4: WorkerGroup, checkpoints: dict[str, str]) -> None:
    flux = ParallelModel(group=group4)
    flux.load(checkpoints["dev"], layout="context", dtype="float32")
    ref = reference("dev_4steps")
    with pytest.raises(ConfigError) as err:  # 16x32 px = 1x2 image tokens for 4 devices
        flux.sample(
            positive(ref["cond"], ref["pooled"]), {"samples": torch.zeros(1, 16, 2, 4)}, seed=0, steps=2
        )
    assert str(err.value) == (
        "an image of 2 tokens is too short for ring=4 x ulysses=1 = 4 devices: each needs at least one image "
        "token; use an image of at least 4 tokens or fewer devices"
    )


def test_sample_without_a_checkpoint() -> None:
    flux = ParallelModel(["cpu", "cpu"])
    with pytest.raises(ConfigError, match=r"no checkpoint is loaded; call load\(checkpoint\) first"):
        flux.sample([], {"samples": torch.zeros(1, 16, 8, 8)}, seed=0, steps=1)
    assert not flux.started  # validation needed no worker


@pytest.mark.slow
def test_a_killed_worker_fails_the_job_and_the_next_job_recovers(checkpoints: dict[str, str]) -> None:
    """Own group: a worker is SIGKILLed mid-job; the caller hears which rank, the next job just works."""
    import os
    import signal
    import threading

    from rocm_parallel.backend.runtime.client import WorkerError

    with ParallelModel(["cpu", "cpu"], threads=1) as flux:
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
        assert f"worker rank 1 (cpu, pid {victim}) exited with code -9 (SIGKILL) while running" in str(
            err.value
        )
        assert not flux.started
        out = run_case(flux, "dev_4steps")  # a fresh group, the checkpoint loaded again
        assert (out - ref["output"]).abs().max().item() <= 1e-4
        assert victim not in flux.group.pids


def test_cancel_mid_sampling_keeps_the_model_resident(
    group2: WorkerGroup, checkpoints: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancel raised from `progress` after step 3 ends the loop there: every rank ran exactly three
    forwards, each to the end (a step is one forward, so no rank is left mid-step), and the model stays.
    Mutation tried: `euler` catching the callback's exception and going on → 300 forwards ran."""

    class Interrupted(Exception):
        pass

    flux = ParallelModel(group=group2)
    flux.load(checkpoints["dev"], layout="context", dtype="float32")
    steps: list[int] = []
    forwards: list[dict] = []
    call_all = group2.call_all

    def spy(method: str, *args, **kwargs):
        try:
            return call_all(method, *args, **kwargs)
        finally:
            if method == "model_call":
                forwards.append(dict(group2.last_replies))

    monkeypatch.setattr(group2, "call_all", spy)

    def cancel_at_three(step: int, total: int) -> None:
        steps.append(step)
        if step == 3:
            raise Interrupted

    ref = reference("dev_4steps")
    with pytest.raises(Interrupted):
        flux.sample(positive(ref["cond"], ref["pooled"]), {"samples": ref["latent"]}, seed=0, steps=300,
                    progress=cancel_at_three)  # fmt: skip
    assert steps == [1, 2, 3]
    # what the ranks did: three forwards, each answered by every rank, nothing after the cancel
    assert len(forwards) == 3 and all(r.ok for replies in forwards for r in replies.values())
    assert all(len(replies) == 2 for replies in forwards)
    monkeypatch.undo()
    assert all(r.loaded is not None for r in flux.status())
    out = run_case(flux, "dev_4steps")
    assert (out - ref["output"]).abs().max().item() <= 1e-4


def test_timeout_bounds_the_whole_job_and_keeps_the_group(
    group2: WorkerGroup, checkpoints: dict[str, str]
) -> None:
    """`timeout=` is the job's, not one step's: 300 steps of tens of milliseconds stop at 1 s, between two
    steps or in one, with the message the worker job gave. Mutation tried: each forward given `timeout`
    itself (no deadline for the job) ran all 300 steps."""
    from rocm_parallel.backend.runtime.client import JobTimeout

    flux = ParallelModel(group=group2)
    flux.load(checkpoints["dev"], layout="tp", dtype="float32")
    ref = reference("dev_4steps")
    started = time.monotonic()
    with pytest.raises(JobTimeout, match=r"^'sample' ran past its time limit of 1 s and was cancelled$"):
        flux.sample(
            positive(ref["cond"], ref["pooled"]), {"samples": ref["latent"]}, seed=0, steps=300, timeout=1.0
        )
    assert time.monotonic() - started < 5
    assert group2.alive
    assert (run_case(flux, "dev_4steps") - ref["output"]).abs().max().item() <= 1e-4


# --- FLUX.2: ComfyUI's template (Flux2Scheduler, euler) through the workers --------------------------


@pytest.mark.slow
@pytest.mark.parametrize("groups", [2, 4], indirect=True)
def test_flux2_sample_matches_one_process_and_comfyui(
    groups: WorkerGroup, flux2_checkpoints: dict[str, str]
) -> None:
    """Every layout: the same latent as the same loop in one process around the same transformer, and as
    ComfyUI's own FLUX.2 template (tests/test_sampling.py checks the one-process loop against it)."""
    flux = ParallelModel(group=groups)
    for name, case in sorted(FLUX2_CASES.items()):
        job = flux2_job(name)
        plan = ParallelModel.check_sample(
            job["positive"], job["latent"], checkpoint=flux2_checkpoints[case["variant"]], seed=job["seed"],
            steps=job["steps"],
        )  # fmt: skip
        fn = flux2_model_fn(flux2_model(case["variant"]))
        one_process = euler(lambda x, t, inputs, fn=fn: flux2_call(fn, x, t, **inputs), plan)
        for layout in LAYOUTS[groups.world_size]:
            flux.load(flux2_checkpoints[case["variant"]], layout=layout, dtype="float32")
            seen: list[tuple[int, int]] = []
            out = flux.sample(
                job["positive"], job["latent"], seed=job["seed"], steps=job["steps"],
                progress=lambda s, t, seen=seen: seen.append((s, t)),
            )["samples"]  # fmt: skip
            assert (out - one_process).abs().max().item() <= 1e-5, f"{layout} {name} vs one process"
            assert (out - reference(name)["output"]).abs().max().item() <= 1e-4, f"{layout} {name} vs ComfyUI"
            assert seen == [(i, case["steps"]) for i in range(1, case["steps"] + 1)]
    flux.unload()
