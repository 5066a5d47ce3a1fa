"""The pack installs into a ComfyUI without touching its torch: the dependency metadata, checked on the
built wheel in a real pip install, and the files ComfyUI-Manager and the Comfy Registry read."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11 (CI's)


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~ \[;]", requirement, maxsplit=1)[0].lower()


def _ci_variable(name: str) -> str:
    (value,) = re.findall(rf"^{name}=(\S+)", (ROOT / ".ci" / "run").read_text(), flags=re.M)
    return value


@pytest.mark.torch_api
def test_torch_has_a_lower_bound_only_the_lowest_ci_runs() -> None:
    """pyproject's bound, the import-time check (backend/torch_range.py) and .ci/run's lowest torch are one
    version: the oldest the whole suite passes on. The import check's tested list is what CI runs."""
    from rocm_parallel.backend import torch_range

    deps = _pyproject()["project"]["dependencies"]
    (torch_req,) = [d for d in deps if _name(d) == "torch"]
    lowest = ".".join(map(str, torch_range.LOWEST))
    assert torch_req == f"torch>={lowest}" == "torch>=2.9"
    assert _ci_variable("LOWEST_TORCH").startswith(f"{lowest}.")
    ci_torches = {
        _ci_variable(v) for v in ("LOWEST_TORCH", "GPU_MACHINE_TORCH", "README_TORCH", "NEWEST_TORCH")
    }
    assert ci_torches == set(torch_range.TESTED)


def test_requirements_txt_is_pyproject_without_torch() -> None:
    lines = [ln.strip() for ln in (ROOT / "requirements.txt").read_text().splitlines()]
    requirements = [ln for ln in lines if ln and not ln.startswith("#")]
    expected = [d for d in _pyproject()["project"]["dependencies"] if _name(d) != "torch"]
    assert requirements == expected


def test_registry_metadata_is_complete() -> None:
    comfy = _pyproject()["tool"]["comfy"]
    assert comfy["PublisherId"] and comfy["DisplayName"] == "ROCm Parallel"
    assert comfy["Icon"].startswith("https://") and comfy["Icon"].endswith("/docs/icon.svg")
    assert (ROOT / "docs" / "icon.svg").read_text().startswith("<svg")
    assert all((ROOT / folder).is_dir() for folder in comfy["includes"])


NOT_IN_REGISTRY_PACKAGE = ("tests/", "testing/", "benchmarks/", ".ci/")


def _registry_package() -> list[str]:
    """The files `comfy node pack` zips: git-tracked files not matched by .comfyignore (gitwildmatch, as
    comfy-cli's file_utils.zip_files applies it), plus [tool.comfy] includes."""
    import pathspec  # a test extra: comfy-cli's own matcher

    lines = (ROOT / ".comfyignore").read_text().splitlines()
    spec = pathspec.PathSpec.from_lines(
        "gitwildmatch", [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]
    )
    tracked = _run("git", "-C", ROOT, "ls-files").stdout.splitlines()
    includes = _pyproject()["tool"]["comfy"]["includes"]
    return [f for f in tracked if not spec.match_file(f) or any(f.startswith(i + "/") for i in includes)]


def test_registry_package_leaves_out_tests_and_benchmarks() -> None:
    package = _registry_package()
    leaked = [f for f in package if f.startswith(NOT_IN_REGISTRY_PACKAGE) or f.endswith(".png")]
    assert leaked == []
    product = ("__init__.py", "pyproject.toml", "requirements.txt", "README.md", "LICENSE", "docs/icon.svg")
    assert [f for f in product if f not in package] == []
    for folder in ("backend/", "nodes/", "js/", "workflows/"):
        shipped = [f for f in package if f.startswith(folder)]
        tracked = _run("git", "-C", ROOT, "ls-files", folder).stdout.splitlines()
        assert shipped == tracked and shipped, folder


def test_comfy_node_validate_security_check_is_silent() -> None:
    # comfy-cli's `comfy node validate` runs exactly this and prints its output as "Security warnings".
    done = _run(
        sys.executable, "-m", "ruff", "check", ROOT, "-q", "--select", "S102,S307,E702", "--exit-zero"
    )
    assert done.stdout == ""


def _run(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, f"{args} failed:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.mark.torch_api
@pytest.mark.parametrize("present", ["2.99.0", "2.9.1+rocm7.1"])
def test_wheel_install_keeps_the_present_torch(tmp_path: Path, built_wheel: Path, present: str) -> None:
    """A ComfyUI whose torch is newer than anything the pack was tested with (2.99.0), or the ROCm build
    of the lowest supported release (2.9.1+rocm7.1, diffusers-rocm-parallel's stack): installing the
    built wheel must leave it alone. The venv sees the running interpreter's packages (pip, diffusers,
    ...) through a .pth file, whichever environment that is (a plain venv, the system Python; the base
    Python a venv was made from may have none of them), and a torch 2.99.0 of its own (its dist-info
    comes first on sys.path, so it shadows the real torch for pip). pip keeps the
    machine's find-links (this machine has a torch 2.13.0 wheel there), so a capped requirement makes it
    replace torch or fail. Mutation tried: with `torch>=2.6,<2.14` in pyproject.toml (and the METADATA
    assertion removed) pip printed 'Installing collected packages: torch' and this test failed."""

    env = {**os.environ, "PIP_CONSTRAINT": "/dev/null", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("PYTHONPATH", None)
    wheel = built_wheel
    with zipfile.ZipFile(wheel) as zf:
        metadata = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    assert "Requires-Dist: torch>=2.9\n" in metadata

    venv = tmp_path / "comfy-venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    site = Path(
        _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    )
    # Not --system-site-packages: that exposes the *base* Python's packages, which in a plain venv are
    # not the ones this suite runs on (a fresh venv's base Python may have no diffusers at all).
    running = [p for p in sys.path if p.endswith("-packages") and Path(p).is_dir()]
    (site / "running-environment.pth").write_text("".join(f"{p}\n" for p in running))
    fake = site / f"torch-{present}.dist-info"
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {present}\n")
    (fake / "INSTALLER").write_text("pip\n")
    (fake / "RECORD").write_text("")
    pip = (python, "-m", "pip")  # the running environment's pip (through the .pth), acting on the venv
    assert f"Version: {present}" in _run(*pip, "show", "torch", env=env).stdout

    done = _run(*pip, "install", "--no-index", wheel, env=env)
    assert "Successfully installed rocm-parallel-0.1.0" in done.stdout
    assert not re.search(
        r"(?im)^(Installing collected packages|  Attempting uninstall):.*\btorch\b", done.stdout
    )
    shown = _run(*pip, "show", "torch", env=env).stdout
    assert f"Version: {present}" in shown and f"Location: {site}" in shown
    assert fake.is_dir() and (fake / "METADATA").read_text().endswith(f"Version: {present}\n")


# ------------------------------------------------------------------ the README a newcomer follows


def _readme_section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def _code_blocks(section: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


@pytest.mark.torch_api
def test_ci_runs_the_readme_commands_verbatim() -> None:
    """Every line the README gives a newcomer (torch only when absent, the demo, the tests) is a line of
    .ci/run, which runs them in fresh venvs; the torch it installs is pyproject's lower bound."""
    lines = [
        ln
        for block in _code_blocks(_readme_section("Try it from a checkout"), "bash")
        for ln in block.splitlines()
    ]
    assert len(lines) == 3, lines
    torch_line, demo, tests = lines
    assert torch_line.startswith('python -c "import torch" 2>/dev/null || python -m pip install torch==')
    # the CPU wheel the README installs is one CI runs the suite on, inside pyproject's range
    assert f"torch=={_ci_variable('README_TORCH')} " in torch_line
    assert demo.endswith("python -m rocm_parallel demo") and tests.endswith("python -m pytest -q")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for line in lines:
        assert f"    {line}" in ci, f"{line!r} is not run by .ci/run"
    assert 'python3 -m venv "$work/first"' in ci
    assert '        python3 -m venv "$work/torch-$torch_version"' in ci  # the torch range's own venvs
    assert not any(ln.lstrip().startswith(("python3 -m pip", "pip ")) for ln in ci)  # never the system Python


def test_ci_runs_the_torch_api_tests_on_the_range_and_the_full_matrix_is_one_variable_away() -> None:
    """Issue 49: the whole suite once (the README's venv, above), then the tests marked torch_api (a marker,
    not a file list) on the newest, the lowest and the GPU machines' torch, each installed before the pack
    (the README's lines keep it); CI_FULL_MATRIX=1 runs the whole suite there instead. The quick part of the
    real-ComfyUI tier runs through the script contributors run (scripts/comfy_tier.sh). Every marker CI
    selects is declared (pytest runs with --strict-markers)."""
    ci = (ROOT / ".ci" / "run").read_text()
    range_loop = 'for torch_version in "$NEWEST_TORCH" "$LOWEST_TORCH" "$GPU_MACHINE_TORCH"; do'
    assert ci.count(range_loop) == 2, "the venvs prepared and the tests run: the same three torches"
    assert '"$work/torch-$torch_version/bin/python" -m pip install -q "torch==$torch_version"' in ci
    assert 'python -m pip install -e ".[test]" && python -m pytest -q -m torch_api' in ci
    assert 'FULL_MATRIX="${CI_FULL_MATRIX:-0}"' in ci
    assert (
        'python -m pip install -e ".[test]" && python -m pytest -q\n' in ci
    )  # the full matrix's whole suite
    assert not re.search(r"pytest[^\n#]* tests/", ci)  # no pytest run is given a file list
    assert 'scripts/comfy_tier.sh "$([ "$FULL_MATRIX" = 1 ] && echo --full || echo --quick)"' in ci
    tier = (ROOT / "scripts" / "comfy_tier.sh").read_text()
    assert "marker=comfy_quick" in tier and "marker=comfy\n" in tier
    pytest_options = _pyproject()["tool"]["pytest"]["ini_options"]
    declared = {m.split(":", 1)[0] for m in pytest_options["markers"]}
    assert {"torch_api", "comfy_quick", "comfy", "slow", "gpu"} <= declared
    assert "--strict-markers" in pytest_options["addopts"]


@pytest.mark.slow
def test_readme_python_example_runs(tmp_path: Path) -> None:
    """The README's Python example, as printed, on two CPU workers: the same latent in both layouts."""
    (example,) = _code_blocks(_readme_section("Use it from Python"), "python")
    done = subprocess.run(
        [sys.executable, "-c", example],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:4] == ["step 1/4", "step 2/4", "step 3/4", "step 4/4"]
    (diff,) = re.fullmatch(r"torch\.Size\(\[1, 16, 32, 32\]\) tensor\((\S+)\)", lines[-1]).groups()
    assert float(diff) <= 1e-4
    assert (tmp_path / "tiny-flux.safetensors").is_file()


def test_every_shipped_workflow_is_documented() -> None:
    readme = _readme_section("Shipped workflows")
    headless = (ROOT / "docs" / "headless.md").read_text()
    for ui in sorted((ROOT / "workflows").glob("*.json")):
        assert f"| `{ui.stem}` |" in readme, f"README's 'Shipped workflows' misses {ui.stem}"
    for api_file in sorted((ROOT / "workflows" / "api").glob("*.json")):
        assert f"`{api_file.name}`" in headless, f"docs/headless.md misses {api_file.name}"


DOCS = sorted([ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").glob("*.md")])


def _anchors(doc: Path) -> set[str]:
    """GitHub's anchors for a Markdown file's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", doc.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_relative_link_in_the_docs_resolves() -> None:
    """The README points users into docs/ for everything it keeps short: each such link, and each link
    between the docs, names a file that exists and, after '#', one of its headings."""
    broken = []
    for doc in DOCS:
        prose = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path) if path else doc
            if not dest.exists():
                broken.append(f"{doc.relative_to(ROOT)}: ({target}) names no file")
            elif anchor and anchor not in _anchors(dest):
                broken.append(f"{doc.relative_to(ROOT)}: ({target}) names no heading of {path or doc.name}")
    assert not broken, broken


def test_the_readme_is_a_short_read() -> None:
    """Issue 21: a README read in minutes. Reference material (every node input, every refusal, file
    formats, the failure table, the API) lives in docs/ and is linked; a README past this many words
    has taken it back."""
    assert len((ROOT / "README.md").read_text().split()) <= 2500


def test_no_placeholder_and_a_license() -> None:
    for doc in DOCS:
        text = doc.read_text()
        assert "<this repo>" not in text and "backend/plan.py" not in text, doc.name
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License\n")
    assert _pyproject()["project"]["license"] == "Apache-2.0"
    assert "one FLUX.1 image" not in _pyproject()["project"]["description"]


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def test_requires_comfyui_and_the_readme_name_exactly_the_versions_the_tier_runs() -> None:
    """The comfy tier's versions are those the import check holds records of, each written from that real
    ComfyUI (tests/data/comfy_api-<version>.json); requires-comfyui's floor is the oldest of them, and the
    README's version list, the parallel MODEL's TESTED_COMFYUI and docs/models.md's table name exactly them."""
    records = (ROOT / "tests" / "data").glob("comfy_api-*.json")
    tier = sorted(
        (p.name.removeprefix("comfy_api-").removesuffix(".json") for p in records), key=_version_key
    )
    assert len(tier) >= 2
    assert _pyproject()["tool"]["comfy"]["requires-comfyui"] == f">={tier[0]}"
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Supported models and ComfyUI versions", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"\*\*(?:ComfyUI )?(\d+\.\d+\.\d+)\*\*", section)
    assert sorted(named, key=_version_key) == tier
    tested = re.search(
        r"^TESTED_COMFYUI = \(([^)]*)\)", (ROOT / "nodes" / "comfy_model.py").read_text(), re.M
    )
    assert tested is not None and re.findall(r'"([\d.]+)"', tested.group(1)) == tier
    table = (ROOT / "docs" / "models.md").read_text().split("| ComfyUI | FLUX.1 |", 1)[1].split("\n\n", 1)[0]
    assert sorted(re.findall(r"^\| (\d+\.\d+\.\d+) \|", table, re.M), key=_version_key) == tier


@pytest.mark.torch_api
def test_a_torch_below_the_range_is_refused_at_import(tmp_path: Path) -> None:
    """torch 2.8.0+rocm6.4 installed (its metadata first on the path, as pip would leave it): `import
    rocm_parallel` stops with the supported range and the install commands, before any node or worker.
    Mutation tried: with the check_torch() call removed from __init__.py the import succeeded and this
    test failed."""
    site = tmp_path / "site"
    fake = site / "torch-2.8.0+rocm6.4.dist-info"
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.8.0+rocm6.4\n")
    (tmp_path / "pack").mkdir()
    (tmp_path / "pack" / "rocm_parallel").symlink_to(ROOT)
    env = {**os.environ, "PYTHONPATH": f"{site}:{tmp_path / 'pack'}"}
    done = subprocess.run(
        [sys.executable, "-c", "import rocm_parallel"], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "rocm_parallel.backend.torch_range.TorchVersionError: ROCm Parallel needs torch >= 2.9 (CI tests "
        "2.9.1, 2.11.0, 2.13.0, 2.15.0); this Python has torch 2.8.0+rocm6.4. Upgrade torch, keeping "
        "your build (ROCm, CUDA or CPU): install torch first, then this pack: ROCm (Linux): pip install torch "
        "--index-url https://download.pytorch.org/whl/rocmX.Y (X.Y from pytorch.org's install selector, e.g. "
        "rocm6.4); NVIDIA: pip install torch; CPU only: pip install torch --index-url "
        "https://download.pytorch.org/whl/cpu"
    )
    ok = subprocess.run(
        [sys.executable, "-c", "import rocm_parallel"], capture_output=True, text=True, timeout=120,
        env={**env, "PYTHONPATH": str(tmp_path / "pack")},
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr  # the same pack with the real torch imports


def test_the_description_and_docstring_say_what_the_pack_runs() -> None:
    """pyproject's description (the registry's and pip's one line) and the package docstring name what the
    pack computes: an image or a video of any of its families (they said "one FLUX image" after Qwen-Image and
    Wan came); test_structure.py keeps every family's name out of them, so a new family needs no edit here."""
    import rocm_parallel

    for text in (_pyproject()["project"]["description"], rocm_parallel.__doc__.split("\n\n")[0]):
        flat = " ".join(text.split())
        assert "one image or video" in flat, flat
