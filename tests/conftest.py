"""Shared fixtures: one CPU/gloo worker group per size, reused by every test of the session."""

from __future__ import annotations

import importlib
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

from rocm_parallel.backend.checkpoint import save_checkpoint
from rocm_parallel.backend.runtime.client import WorkerGroup

TESTS_DIR = str(Path(__file__).resolve().parent)
# Test-only worker methods, imported by the workers from tests/ (see WorkerGroup(methods=...)).
TEST_METHODS = (
    "worker_jobs",
    "model_methods",
    "cp_checks",
    "load_checks",
    "flux2_methods",
    "mesh_methods",
    "norm_methods",
    "lse_kernels",
    "engine_toy",
)
# The suite runs several worker processes on a 2-core machine: one thread each keeps them from
# fighting over cores (and keeps float results reproducible).
torch.set_num_threads(1)
# Started as a background job of a non-interactive shell (`.ci/run &`, nohup), Python inherits SIGINT ignored
# and installs no KeyboardInterrupt handler: the Ctrl+C tests (test_interrupts.py, test_reliability.py) would
# send Ctrl+C to a process that cannot get one (a CI run started that way failed 4 of them). ComfyUI in a
# terminal has Python's handler: give the suite the same.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _start(world_size: int) -> WorkerGroup:
    # Their request and reply records travel by name: this process must know them too (a session group's
    # status can name a test's resident record whichever test file asks). Imported here, when the first
    # shared group starts, not at collection: a run that needs no group (most single files) skips them.
    for module in TEST_METHODS:
        importlib.import_module(module)
    return WorkerGroup(["cpu"] * world_size, threads=1, extra_sys_path=[TESTS_DIR], methods=TEST_METHODS)


def _assert_gone(pids: list[int]) -> None:
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"worker processes left running: {alive}"


@pytest.fixture(scope="session")
def group2() -> Iterator[WorkerGroup]:
    group = _start(2)
    yield group
    group.close()
    _assert_gone(group.pids)


@pytest.fixture(scope="session")
def group4() -> Iterator[WorkerGroup]:
    group = _start(4)
    yield group
    group.close()
    _assert_gone(group.pids)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from test_sampling import flux_model  # the models the ComfyUI references were made with

    """The reference models (dev, schnell, fill) as BFL single files, the way users keep FLUX in
    models/diffusion_models/."""
    folder = tmp_path_factory.mktemp("diffusion_models")
    paths = {}
    for variant in ("dev", "schnell", "fill"):
        path = folder / f"tiny-flux-{variant}.safetensors"
        save_checkpoint(flux_model(variant), path)
        paths[variant] = str(path)
    return paths


@pytest.fixture(scope="session")
def flux2_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The FLUX.2 reference models (tests/data/comfy_references.safetensors) as ComfyUI single files:
    `ParallelModel.sample` plans from a checkpoint's header."""
    from test_sampling import FLUX2_MODELS, flux2_model

    from rocm_parallel.backend.checkpoint import save_checkpoint

    folder = tmp_path_factory.mktemp("flux2")
    return {
        v: save_checkpoint(flux2_model(v), folder / f"tiny-{v}.safetensors", prefix=True)
        for v in FLUX2_MODELS
    }


@pytest.fixture(scope="session")
def built_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pack's wheel, built once per session from a copy of this checkout (pip writes build/ and
    *.egg-info next to the sources), with the machine's pip configuration but no PYTHONPATH."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "src"
    shutil.copytree(
        Path(TESTS_DIR).parent,
        source,
        ignore=shutil.ignore_patterns(
            ".git", "build", "dist", "*.egg-info", "__pycache__", ".*cache", ".venv*"
        ),
        symlinks=True,  # a link in a developer's checkout (e.g. to the checkout itself) is copied as a link
    )
    env = {**os.environ, "PIP_CONSTRAINT": "/dev/null", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("PYTHONPATH", None)
    pip_wheel = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        str(tmp),
    ]
    built = subprocess.run([*pip_wheel, str(source)], capture_output=True, text=True, check=False, env=env)
    if built.returncode and "No module named pip" in built.stderr:
        pytest.skip("pip is not available")
    assert built.returncode == 0, built.stderr[-3000:]
    (path,) = tmp.glob("rocm_parallel-*.whl")
    return path


@pytest.fixture
def groups(request: pytest.FixtureRequest) -> WorkerGroup:
    """Parametrize with indirect=True and a world size (2 or 4) to get that session group."""
    return request.getfixturevalue(f"group{request.param}")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """A run that selects by one marker (`-m torch_api`, `-m comfy_quick`: CI's torch range and quick tier)
    does not import the test modules whose text never names it: they hold no test carrying it (markers are
    written in the module, by decorator or `pytestmark`), and importing every module (diffusers,
    transformers, the models) costs each such run some 15 s of a 2-core machine."""
    marker = config.getoption("markexpr")
    if not (marker and re.fullmatch(r"\w+", marker)):
        return None
    if not (collection_path.name.startswith("test_") and collection_path.suffix == ".py"):
        return None
    return True if marker not in collection_path.read_text() else None


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Nothing the suite spawned may outlive it.
    me = psutil.Process(os.getpid())
    children = [c for c in me.children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE]
    if children:
        for c in children:
            c.kill()
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print(f"\nERROR: the test session left processes behind: {[c.pid for c in children]}")
