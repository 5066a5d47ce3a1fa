"""The README's commands as a user runs them, in the install the README describes: the pack copied into
ComfyUI/custom_nodes/rocm-parallel, its requirements installed with ComfyUI's Python, the pack itself NOT
installed (no `pip install` of it: `import rocm_parallel` fails there, which is why `python -m rocm_parallel
doctor` answered "No module named rocm_parallel").

That Python is a venv made here whose site-packages only point at this interpreter's (a `.pth` line adds
the directory; the `.pth` files inside it, among them an editable install of the pack, are not processed):
torch and the requirements import, the pack does not. Each README command of the install, the layouts, the
doctor and the headless sections then runs in a subprocess, in ComfyUI's folder, exactly as printed (the
clone line is done by copying, the README's "or copy it there"); the CLI commands also run from the
custom_nodes folder and from the pack's own folder with the path adjusted. The checkout's own commands
(`pip install -e .`, the demo, the tests) are .ci/run's, which runs them verbatim in fresh venvs
(tests/test_packaging.py)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import site
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACK = "custom_nodes/rocm-parallel"  # the folder the README's commands name
COPY_IGNORED = shutil.ignore_patterns(
    ".git", ".venv", "venv", "__pycache__", ".gl", ".pytest_cache", "*.egg-info"
)


def _section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end]


def _commands(title: str) -> list[str]:
    """Every command line of the section's bash blocks, trailing comments dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", _section(title), flags=re.S)
    return [line.split("  #")[0].strip() for block in blocks for line in block.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def install(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """(ComfyUI's folder with the pack copied into custom_nodes, the environment whose `python` is ComfyUI's
    Python without the pack)."""
    base = tmp_path_factory.mktemp("install")
    venv = base / "comfyui-python"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    (site_dir,) = venv.glob("lib/python*/site-packages")
    (site_dir / "host-packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    comfyui = base / "ComfyUI"
    (comfyui / "custom_nodes").mkdir(parents=True)
    shutil.copytree(ROOT, comfyui / PACK, ignore=COPY_IGNORED)  # the README's "or copy it there"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    env["ROCM_PARALLEL_THREADS"] = "1"  # the machine's cores are shared
    return comfyui, env


def _run(command: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False
    )


def test_the_install_python_lacks_the_pack(install: tuple[Path, dict[str, str]]) -> None:
    """The install as the README leaves it: the old command fails there (the bug), torch imports."""
    comfyui, env = install
    done = _run("python -m rocm_parallel doctor", comfyui, env)
    assert done.returncode == 1 and "No module named rocm_parallel" in done.stderr
    assert _run('python -c "import torch, diffusers, gguf"', comfyui, env).returncode == 0


def test_the_install_sections_commands_run_in_comfyuis_folder(install: tuple[Path, dict[str, str]]) -> None:
    """The install block, line by line: the requirements (already there: pip installs nothing, reaches no
    index) and the doctor (2 CPU workers here: no GPU)."""
    comfyui, env = install
    clone, *rest = _commands("Install in ComfyUI")
    assert clone.startswith("git clone ") and clone.endswith(f" {PACK}")
    assert rest == [f"python -m pip install -r {PACK}/requirements.txt", f"python {PACK} doctor"]
    pip = _run(rest[0], comfyui, env)
    assert pip.returncode == 0, pip.stderr
    doctor = _run(rest[1], comfyui, env)
    assert doctor.returncode == 0, doctor.stderr
    assert doctor.stdout.startswith("ROCm Parallel doctor\n")
    assert re.search(
        r"^group: +2 workers on cpu, cpu, gloo, world size 2, .*collectives correct$", doctor.stdout, re.M
    )


def test_the_doctor_and_plan_commands_run_as_printed(install: tuple[Path, dict[str, str]]) -> None:
    comfyui, env = install
    doctor = _commands("Troubleshooting: doctor")
    assert doctor == [f"python {PACK} doctor", f'python {PACK} doctor --devices "cpu x2"']
    done = _run(doctor[1], comfyui, env)
    assert done.returncode == 0 and "2 workers on cpu, cpu" in done.stdout, done.stderr
    (plan,) = _commands("Layouts")
    done = _run(plan, comfyui, env)
    assert done.returncode == 0, done.stderr
    assert "| layout |" in done.stdout and done.stdout.rstrip().splitlines()[-1].startswith("auto")


@pytest.mark.parametrize(("folder", "pack"), [("custom_nodes", "rocm-parallel"), (PACK, ".")])
def test_the_command_line_runs_from_the_other_folders_too(
    install: tuple[Path, dict[str, str]], folder: str, pack: str
) -> None:
    """The same command line from custom_nodes/ (`python rocm-parallel plan`) and from the pack's folder
    (`python . plan`): Python runs the folder's __main__.py, whatever the current folder."""
    comfyui, env = install
    done = _run(f"python {pack} plan --model flux1-dev --devices 2", comfyui / folder, env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip().splitlines()[-1].startswith("auto")


def test_the_headless_command_finds_its_files_from_comfyuis_folder(
    install: tuple[Path, dict[str, str]],
) -> None:
    """The headless line as printed, pointed at a port where no ComfyUI answers (a real one would run the
    4-GPU workflow): the script and the workflow are found from ComfyUI's folder, the seed is set, and the
    one error left is that no server answers."""
    comfyui, env = install
    (command,) = _commands("Headless")
    assert command.startswith(f"python {PACK}/scripts/headless_prompt.py {PACK}/workflows/api/")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = _run(f"{command} --server 127.0.0.1:{port}", comfyui, env)
    assert done.stdout.startswith("seed 7 set on "), (done.stdout, done.stderr)
    assert done.returncode == 1
    assert done.stderr.startswith(f"error: no ComfyUI answers at http://127.0.0.1:{port} ")
    assert shlex.split(command)[-1] == "renders/"
