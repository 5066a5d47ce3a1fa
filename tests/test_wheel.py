"""The installed package is the product only: no benchmark, test helper or test-only worker method.

Lists the wheel built from a copy of this checkout (conftest's `built_wheel`, shared with
test_packaging) and runs the CLI from the unpacked wheel: `bench` there says how to get the benchmarks.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from rocm_parallel.backend import cli

ROOT = Path(__file__).resolve().parents[1]
NOT_SHIPPED = ("benchmarks/", "testing/", "tests/", "scripts/")
TEST_ONLY_NAMES = ("model_methods", "worker_jobs", "cp_checks", "load_checks", "bench")

NO_BENCHMARKS = (
    "error: the benchmarks are not installed with the package; run them from a checkout of the repository: "
    "git clone https://github.com/rocm-parallel/rocm-parallel && cd rocm-parallel && "
    "python -m pip install -e . && python -m rocm_parallel bench <name>\n"
)


@pytest.fixture
def wheel(built_wheel: Path) -> Path:
    return built_wheel


def test_wheel_holds_the_product_and_nothing_else(wheel: Path) -> None:
    names = [n for n in zipfile.ZipFile(wheel).namelist() if not n.startswith("rocm_parallel-")]
    package = [n.removeprefix("rocm_parallel/") for n in names]
    assert all(n.startswith("rocm_parallel/") for n in names), names
    leaked = [n for n in package if n.startswith(NOT_SHIPPED) or Path(n).stem in TEST_ONLY_NAMES]
    assert not leaked, f"benchmark or test-only code in the wheel: {leaked}"
    # Every product module is there (a package missing from pyproject would drop silently).
    product = sorted(
        str(p.relative_to(ROOT))
        for p in ROOT.rglob("*.py")
        if p.relative_to(ROOT).parts[0] in ("__init__.py", "__main__.py", "backend", "nodes")
    )
    assert [n for n in product if n not in package] == []
    assert "backend/flux/demo.py" in package  # the README's main job ships
    assert "backend/plan/facts.json" in package  # without it `plan` would import diffusers (40-68 s)


def test_bench_from_the_installed_wheel_says_how_to_get_it(wheel: Path, tmp_path: Path) -> None:
    zipfile.ZipFile(wheel).extractall(tmp_path)
    run = subprocess.run(
        [sys.executable, "-m", "rocm_parallel", "bench", "tp", "--degrees", "1"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)},
        check=False,
    )
    assert (run.returncode, run.stderr) == (2, NO_BENCHMARKS)


def test_bench_message_when_the_folder_is_absent(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "BENCHMARKS_DIR", tmp_path / "benchmarks")
    assert cli.main(["bench", "planner"]) == 2
    assert capsys.readouterr().err == NO_BENCHMARKS
