"""What the platform allows, decided before any worker starts: 'all' without GPUs, Windows, no NCCL,
the AOTriton flag per GPU architecture, several workers on one GPU."""

from __future__ import annotations

import pytest
import torch

from rocm_parallel.backend import platforms
from rocm_parallel.backend.config import ConfigError
from rocm_parallel.backend.diffusion import api
from rocm_parallel.backend.runtime.client import WorkerGroup, validate_devices

pytestmark = pytest.mark.torch_api


def test_api_default_devices_without_gpus_names_the_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platforms, "visible_gpus", lambda: 0)
    monkeypatch.setattr(platforms, "build_kind", lambda: "cpu")
    with pytest.raises(ConfigError) as err:
        api.ParallelModel()
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


def test_gpus_without_nccl_go_to_gloo_and_only_an_explicit_nccl_is_refused() -> None:
    """Strix Halo, custom builds: no NCCL/RCCL. The group starts on gloo (preflight.py, which says what it
    costs: tests/test_startup_health.py); only backend='nccl', which cannot be honoured, is refused."""
    for backend in (None, "gloo"):
        platforms.check_platform(("cuda:0", "cuda:1"), backend, system="linux", nccl_available=False)
    with pytest.raises(ConfigError) as err:
        platforms.check_platform(("cuda:0", "cuda:1"), "nccl", system="linux", nccl_available=False)
    assert str(err.value) == (
        f"backend='nccl' but {platforms.torch_build()} has no NCCL/RCCL for collectives between "
        "devices=['cuda:0', 'cuda:1'] (AMD's Windows wheels and some custom builds lack it). Install the Linux "
        "ROCm or CUDA build of torch (README, 'Platforms'), or leave the backend to the pack: it then runs "
        "collectives through gloo (slower)"
    )
    platforms.check_platform(("cuda:0", "cuda:1"), None, system="linux", nccl_available=True)
    platforms.check_platform(("cpu", "cpu"), None, system="linux", nccl_available=False)


def test_bad_backend_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^backend='mpi' is not supported; use 'nccl' \(GPUs\), 'gloo'"):
        validate_devices(["cpu", "cpu"], backend="mpi")
    with pytest.raises(ConfigError, match=r"^backend='nccl' needs GPU devices, not \['cpu', 'cpu'\]"):
        WorkerGroup(["cpu", "cpu"], backend="nccl")


def test_one_gpu_twice_needs_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr("rocm_parallel.backend.platforms.check_platform", lambda *a, **k: None)
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
    from rocm_parallel.backend.runtime import launch

    monkeypatch.delenv(platforms.AOTRITON_FLAG, raising=False)
    devices = ("cuda:0", "cuda:1")  # the env only; no processes
    archs = {"cuda:0": "gfx1100", "cuda:1": "gfx942"}
    monkeypatch.setattr(launch, "gpu_arch", archs.get)
    assert launch.worker_env(devices, 0, "sock", "/tmp")[platforms.AOTRITON_FLAG] == "1"
    assert platforms.AOTRITON_FLAG not in launch.worker_env(devices, 1, "sock", "/tmp")
    monkeypatch.setenv(platforms.AOTRITON_FLAG, "0")  # a user's value wins
    assert launch.worker_env(devices, 0, "sock", "/tmp")[platforms.AOTRITON_FLAG] == "0"


def test_worker_env_turns_the_flight_recorder_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.9 records no collectives unless given a buffer: the liveness rules need the record (a rank
    hung in a collective must not read as 'computing'; test_startup_health's hang tests on 2.9.1)."""
    from rocm_parallel.backend.runtime import launch

    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    assert launch.worker_env(("cpu", "cpu"), 0, "sock", "/tmp")["TORCH_FR_BUFFER_SIZE"] == "256"
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "64")  # a user's value wins
    assert launch.worker_env(("cpu", "cpu"), 0, "sock", "/tmp")["TORCH_FR_BUFFER_SIZE"] == "64"


# ------------------------------------------------------------------ one device vocabulary (issue 21)


@pytest.mark.parametrize(
    ("spec", "devices"),
    [
        ("cpu x2", ("cpu", "cpu")),
        ("CPU*3", ("cpu", "cpu", "cpu")),
        ("cpu, cpu", ("cpu", "cpu")),
        (["cpu", "cpu"], ("cpu", "cpu")),
        ("0,1,2,3", ("cuda:0", "cuda:1", "cuda:2", "cuda:3")),
        ("cuda:0, cuda:1", ("cuda:0", "cuda:1")),
        (["cuda:1", "0", 2], ("cuda:1", "cuda:0", "cuda:2")),
        ("all", ("cuda:0", "cuda:1")),
    ],
)
def test_one_device_vocabulary_for_every_entry_point(spec: platforms.DeviceSpec, devices: tuple) -> None:
    assert platforms.parse_devices(spec, lambda: 2) == devices


def test_the_api_takes_the_same_strings_as_the_nodes() -> None:
    """The API used to iterate a string ('cpu x2' -> ['c', 'p', 'u', ...]) although its own messages
    advise 'cpu x2'."""
    assert api.ParallelModel("cpu x2").devices == ("cpu", "cpu")
    assert validate_devices("cpu, cpu") == ("cpu", "cpu")


def test_a_gpu_on_a_cpu_only_build_names_the_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(platforms, "build_kind", lambda: "cpu")
    with pytest.raises(ConfigError) as err:
        validate_devices("cuda:9")
    assert str(err.value) == (
        f"devices='cuda:9' asks for GPU 9 but no GPU is visible: torch {torch.__version__} is a CPU-only "
        "build. Install the ROCm or CUDA build of torch (README, section 'Platforms'); or use 'cpu x2' to "
        "test on CPU workers"
    )


@pytest.mark.parametrize(
    ("visible", "advice"), [(1, "use index 0 (or 'all')"), (4, "use indices 0 to 3 (or 'all')")]
)
def test_a_missing_gpu_names_the_indices_that_exist(
    monkeypatch: pytest.MonkeyPatch, visible: int, advice: str
) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    with pytest.raises(ConfigError) as err:
        validate_devices(["cuda:0", "cuda:9"])
    assert (
        str(err.value)
        == f"devices=['cuda:0', 'cuda:9'] asks for GPU 9 but {visible} GPU(s) are visible; {advice}"
    )


def test_a_huge_spec_is_not_echoed_and_the_advice_is_bounded_by_the_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    with pytest.raises(ConfigError) as err:
        validate_devices(["cpu"] * 1000)
    text = str(err.value)
    assert text.startswith(
        "devices=['cpu', 'cpu', 'cpu', ... (1000 devices)] asks for 1000 CPU workers, which need at least "
        "1000 GB of host memory (1 GB each, measured on a worker that has loaded a model, besides the model "
        "itself) but "
    )
    assert text.endswith(
        " GB are available; this machine has 2 core(s), so use 'cpu x2' (CPU workers are for testing)"
    )
    with pytest.raises(ConfigError) as err:
        validate_devices("x" * 500)
    assert str(err.value) == (
        "devices='" + "x" * 55 + "...' (500 characters): '" + "x" * 60 + "'... is not a device; use 'all', "
        "GPU indices like '0,1,2,3', 'cuda:0,cuda:1' or CPU workers like 'cpu x2'"
    )


@pytest.mark.parametrize("name", ["rocm:1", "hip:1", "ROCm:1"])
def test_rocm_and_hip_device_names_say_torch_calls_them_cuda(name: str) -> None:
    with pytest.raises(ConfigError) as err:
        platforms.parse_devices(f"cuda:0,{name}")
    assert str(err.value) == (
        f"devices='cuda:0,{name}': {name.lower()!r} is not a torch device name; ROCm (HIP) GPUs are 'cuda:N' "
        "in torch as NVIDIA ones are: use 'cuda:1' or the index 1"
    )
