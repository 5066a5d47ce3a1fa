"""Inputs at their edges: each bounded and typed before use, each refusal one line naming the input, the
value, the limit and the fix (a black-box probe of 1f600cb found these raw, blocking or crashing).

Before: a layout of "tp" and ten thousand digits was a ValueError (Python's int digit limit), `cpu x` and 40
digits an OverflowError, /proc/self/mem as checkpoint an OSError, a FIFO blocked the caller forever,
threads=10**9 was accepted and ended in std::bad_alloc on the worker, a real MemoryError on a rank read
"MemoryError: ", a NaN noise_mask was reported as "x contains NaN", and a million sigmas passed the
10,000-step bound.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from test_sampling import flux_model, positive, reference
from worker_jobs import OnRank

from rocm_parallel.backend import platforms
from rocm_parallel.backend.checkpoint import diffusers_to_bfl
from rocm_parallel.backend.config import ConfigError, ParallelLayout
from rocm_parallel.backend.diffusion.api import ParallelFlux
from rocm_parallel.backend.runtime.client import WorkerError, WorkerGroup
from rocm_parallel.nodes.inputs import model_layout

SYNTAX = "degrees such as 'batch 2 x tp 2' or 'tp2xring2' (batch, tp, ring, ulysses; each at most once)"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("models") / "tiny-flux-dev.safetensors"
    save_file(diffusers_to_bfl(flux_model("dev").state_dict()), str(path))
    return str(path)


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine of 16 cores with 7.5 GB of host memory available (the bounds' numbers are this one's)."""
    monkeypatch.setattr(platforms.psutil, "virtual_memory", lambda: SimpleNamespace(available=7.5e9))
    monkeypatch.setattr(platforms.os, "cpu_count", lambda: 16)


def _refusal(call, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as err:
        call(*args, **kwargs)
    return str(err.value)


# ------------------------------------------------------------------------------ numbers past any machine


def test_a_layout_with_ten_thousand_digits() -> None:
    text = "tp" + "9" * 10_000
    message = (
        "layout='tp" + "9" * 53 + "...' (10002 characters): tp has a 10000-digit degree, more than 4096; a "
        f"degree is a number of devices: use {SYNTAX}"
    )
    assert _refusal(ParallelLayout.parse, text) == message
    assert _refusal(model_layout, text, 0, 0, 2) == message  # the ROCm Parallel Model node's field
    assert _refusal(ParallelLayout.parse, "ring 2 x tp 99999") == (
        "tp_degree=99999 is more than 4096; a degree is a number of devices: use one that divides yours "
        "(e.g. 2), or 1 to turn it off"
    )


@pytest.mark.usefixtures("machine")
def test_cpu_workers_beyond_the_machine_are_refused_before_any_list_is_built() -> None:
    forty = "cpu x" + "9" * 40
    assert _refusal(platforms.parse_devices, forty) == (
        "devices='cpu x" + "9" * 40 + "' asks for a 40-digit number of CPU workers; 7.5 GB of host "
        "memory are available, enough for at most 7 (1 GB each, measured on a worker that has loaded a model); "
        "this machine has 16 core(s), so use 'cpu x7' (CPU workers are for testing)"
    )
    assert _refusal(platforms.parse_devices, "cpu x20000000") == (
        "devices='cpu x20000000' asks for 20000000 CPU workers, which need at least 20000000 GB of host memory "
        "(1 GB each, measured on a worker that has loaded a model, besides the model itself) but 7.5 GB are "
        "available; this machine has 16 core(s), so use 'cpu x7' (CPU workers are for testing)"
    )
    assert _refusal(platforms.parse_devices, "cuda:" + "9" * 25) == (
        "devices='cuda:"
        + "9" * 25
        + "': GPU index 999999999999... (25 digits) is beyond any machine's; GPUs "
        "are numbered 0, 1, ... as rocm-smi / nvidia-smi list them (or use 'all')"
    )
    assert _refusal(platforms.parse_devices, "²") == (
        "devices='²': '²' is not a device; use 'all', GPU indices like '0,1,2,3', 'cuda:0,cuda:1' or CPU "
        "workers like 'cpu x2'"
    )


@pytest.mark.usefixtures("machine")
def test_threads_are_bounded_by_the_machines_cores() -> None:
    message = (
        "threads=1000000000 is more than this machine's 16 cores; use 1 to 16 torch threads per worker, or "
        "None for the default (CPU workers: the cores shared out; GPUs: torch's own)"
    )
    assert _refusal(ParallelFlux, ["cpu", "cpu"], threads=10**9) == message
    assert _refusal(WorkerGroup, ["cpu", "cpu"], threads=10**9) == message  # before any process starts
    assert _refusal(ParallelFlux, ["cpu"], threads=10**5000).startswith(
        "threads=a number of about 5000 digits "
    )


# ------------------------------------------------------------------------------ files that are no files


def test_special_files_are_refused_by_type_before_anything_opens_them(
    checkpoint: str, tmp_path: Path
) -> None:
    fix = "pass a .safetensors checkpoint (or a diffusers folder) from models/diffusion_models"
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)  # opened for reading, it blocked the caller forever
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "listening.safetensors"))
    cases = {
        "/proc/self/mem": "a file of /proc, the kernel's own data",
        "/dev/zero": "a character device",
        str(fifo): "a named pipe (FIFO): reading it waits for a writer",
        str(tmp_path / "listening.safetensors"): "a socket",
    }
    try:
        for path, kind in cases.items():
            flux = ParallelFlux(["cpu", "cpu"])
            assert (
                _refusal(flux.check_load, path)
                == f"checkpoint {path!r} is {kind}, not a file of weights; {fix}"
            )
            assert _refusal(flux.check_load, checkpoint, loras=[(path, 1.0)]) == (
                f"LoRA {path!r} is {kind}, not a file of weights; pass the LoRA's .safetensors file"
            )
    finally:
        sock.close()


# ------------------------------------------------------------------------------ sampling inputs


def _checked_sample(checkpoint: str, **overrides) -> str:
    ref = reference("dev_4steps")
    args = {"latent": {"samples": ref["latent"]}, "seed": 0, "steps": 2, **overrides}
    return _refusal(
        ParallelFlux.check_sample,
        positive(ref["cond"], ref["pooled"]),
        args.pop("latent"),
        checkpoint=checkpoint,
        **args,
    )


def test_a_nan_noise_mask_is_named_as_such(checkpoint: str) -> None:
    latent = reference("dev_4steps")["latent"]
    mask = torch.ones(1, *latent.shape[-2:])
    mask[0, 1, 1] = float("nan")
    assert _checked_sample(checkpoint, latent={"samples": latent, "noise_mask": mask}) == (
        "noise_mask contains NaN values; check the node that made the mask (SetLatentNoiseMask, a mask editor)"
    )


def test_a_million_sigmas_are_refused_before_they_are_read(checkpoint: str) -> None:
    sigmas = [1.0 - i / 1_000_000 for i in range(1_000_000)]
    message = (
        "sigmas holds 1000000 values (999999 steps); at most 10001 (10000 steps, as ComfyUI's KSampler "
        "allows): use a scheduler's output, e.g. BasicScheduler with fewer steps"
    )
    assert _checked_sample(checkpoint, sigmas=sigmas) == message
    assert _checked_sample(checkpoint, sigmas=torch.tensor(sigmas)) == message


# ------------------------------------------------------------------------------ a rank out of host memory


def test_a_memory_error_on_a_rank_says_what_ran_out_and_the_fix(group2: WorkerGroup) -> None:
    """A real MemoryError (Python's allocator refusing 4 EiB) read 'MemoryError: ' and nothing else."""
    with pytest.raises(WorkerError) as err:
        group2.call("memory_error", OnRank(rank=1))
    assert re.fullmatch(
        r"rank 1 \(cpu\): out of host memory on rank 1 of 2 \(cpu\): MemoryError \(an allocation failed\); "
        r"\d+\.\d of \d+\.\d GB of host memory are available now\. To fit: close other programs, use fewer CPU "
        r"workers, lower the resolution or the batch, or keep the weights in fp8 \(weight_dtype\)",
        str(err.value),
    ), str(err.value)
    assert group2.alive and group2.call("ping").rank == 0
