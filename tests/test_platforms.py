"""What the platform allows, decided before any worker starts: 'all' without GPUs, Windows, no NCCL,
the AOTriton flag per GPU architecture, several workers on one GPU."""

from __future__ import annotations

import pytest
import torch

from rocm_parallel.backend import api, platforms
from rocm_parallel.backend.client import WorkerGroup, validate_devices
from rocm_parallel.backend.config import ConfigError


def test_api_default_devices_without_gpus_names_the_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platforms, "visible_gpus", lambda: 0)
    monkeypatch.setattr(platforms, "build_kind", lambda: "cpu")
    with pytest.raises(ConfigError) as err:
        api.ParallelFlux()
    assert str(err.value).startswith(
        f"devices='all' but no GPU is visible: torch {torch.__version__} is a CPU-only build. Install the ROCm "
        "or CUDA build of torch"
    )
    assert str(err.value).endswith("; or use 'cpu x2' to test on CPU workers")


def test_gpu_build_without_gpus_points_at_the_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platforms, "build_kind", lambda: "rocm")
    monkeypatch.setattr(platforms, "torch_build", lambda: "torch 2.6.0+rocm6.2 (ROCm build, HIP 6.2)")
    with pytest.raises(ConfigError) as err:
        platforms.parse_devices("all", lambda: 0)
    assert str(err.value).startswith(
        "devices='all' but no GPU is visible: torch 2.6.0+rocm6.2 (ROCm build, HIP 6.2) sees no GPU. Check the "
        "driver (rocm-smi), that this user may open the device (ROCm: groups 'video' and 'render')"
    )


def test_windows_is_refused_with_the_reason_and_the_fix() -> None:
    with pytest.raises(ConfigError) as err:
        platforms.check_platform(("cuda:0", "cuda:1"), None, system="win32", nccl_available=False)
    assert str(err.value) == (
        "devices=['cuda:0', 'cuda:1']: the worker group does not run on Windows (win32): it needs Unix "
        "sockets and /dev/shm, and AMD's Windows torch wheels have no RCCL for GPU collectives. Run "
        "ComfyUI with this pack on Linux or in WSL2 with the ROCm/CUDA build of torch (README, 'Platforms')"
    )


def test_gpus_without_nccl_are_refused_unless_gloo_is_chosen() -> None:
    with pytest.raises(ConfigError) as err:
        platforms.check_platform(("cuda:0", "cuda:1"), None, system="linux", nccl_available=False)
    assert str(err.value).startswith(
        f"devices=['cuda:0', 'cuda:1'] are GPUs, but {platforms.torch_build()} has no NCCL/RCCL for collectives"
    )
    assert "pass backend='gloo'" in str(err.value)
    platforms.check_platform(("cuda:0", "cuda:1"), "gloo", system="linux", nccl_available=False)
    platforms.check_platform(("cuda:0", "cuda:1"), None, system="linux", nccl_available=True)
    platforms.check_platform(("cpu", "cpu"), None, system="linux", nccl_available=False)


def test_bad_backend_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^backend='mpi' is not supported; use 'nccl' \(GPUs\), 'gloo'"):
        validate_devices(["cpu", "cpu"], backend="mpi")
    with pytest.raises(ConfigError, match=r"^backend='nccl' needs GPU devices, not \['cpu', 'cpu'\]"):
        WorkerGroup(["cpu", "cpu"], backend="nccl")


def test_one_gpu_twice_needs_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr("rocm_parallel.backend.launch.check_platform", lambda *a, **k: None)
    with pytest.raises(
        ConfigError, match=r"names a GPU twice; each worker needs its own GPU \(backend='gloo'"
    ):
        validate_devices(["cuda:0", "cuda:0"])
    assert validate_devices(["cuda:0", "cuda:0"], backend="gloo") == ("cuda:0", "cuda:0")


@pytest.mark.parametrize(
    ("arch", "flag"),
    [("gfx1100", True), ("gfx1101", True), ("gfx1201", True), ("gfx942", False), ("gfx90a", False),
     ("sm_90", False), (None, True)],
)  # fmt: skip
def test_aotriton_flag_per_arch(arch: str | None, flag: bool) -> None:
    assert platforms.needs_aotriton_flag(arch) is flag


def test_worker_env_sets_aotriton_only_for_rdna(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one place the flag is set: launch.worker_env, per rank's GPU arch."""
    from rocm_parallel.backend import launch

    monkeypatch.delenv(platforms.AOTRITON_FLAG, raising=False)
    devices = ("cuda:0", "cuda:1")  # the env only; no processes
    archs = {"cuda:0": "gfx1100", "cuda:1": "gfx942"}
    monkeypatch.setattr(launch, "gpu_arch", archs.get)
    assert launch.worker_env(devices, 0, "sock", "/tmp")[platforms.AOTRITON_FLAG] == "1"
    assert platforms.AOTRITON_FLAG not in launch.worker_env(devices, 1, "sock", "/tmp")
    monkeypatch.setenv(platforms.AOTRITON_FLAG, "0")  # a user's value wins
    assert launch.worker_env(devices, 0, "sock", "/tmp")[platforms.AOTRITON_FLAG] == "0"
