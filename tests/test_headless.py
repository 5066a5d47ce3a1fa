"""scripts/headless_prompt.py without a ComfyUI: which seed inputs it sets, and its one-line errors."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "headless_prompt.py"
API_WORKFLOWS = sorted((ROOT / "workflows" / "api").glob("*.json"))


def _script(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture(scope="module")
def headless():
    import importlib.util

    spec = importlib.util.spec_from_file_location("headless_prompt", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", API_WORKFLOWS, ids=lambda p: p.stem)
def test_seed_reaches_every_shipped_workflow(headless, path: Path) -> None:
    prompt = json.loads(path.read_text())
    changed = headless.set_seed(prompt, 7)
    assert changed, f"--seed would change nothing in {path.name}"
    for item in changed:
        node_id, name = item.split(" ", 1)[0], item.rsplit(".", 1)[1]
        assert prompt[node_id]["inputs"][name] == 7


def test_flux2_seed_is_random_noise_noise_seed(headless) -> None:
    prompt = json.loads((ROOT / "workflows" / "api" / "flux2_dev_parallel_model_tp4.json").read_text())
    assert [c.split(" ", 1)[1] for c in headless.set_seed(prompt, 7)] == ["(RandomNoise).noise_seed"]


def test_a_linked_seed_is_left_alone_and_the_script_says_so(tmp_path: Path) -> None:
    workflow = tmp_path / "linked.json"
    workflow.write_text(json.dumps({"3": {"class_type": "KSampler", "inputs": {"seed": ["9", 0]}}}))
    done = _script(workflow, "--seed", "7", "--server", f"127.0.0.1:{_closed_port()}")
    assert done.stdout.splitlines()[0] == (
        "--seed 7 changed nothing: no node of linked.json has a seed or noise_seed value (a seed may come "
        "from another node's output)"
    )


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_no_server_is_one_line(tmp_path: Path) -> None:
    port = _closed_port()
    done = _script(API_WORKFLOWS[0], "--server", f"127.0.0.1:{port}")
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"error: no ComfyUI answers at http://127.0.0.1:{port} ([Errno 111] Connection refused); start it "
        "(python main.py --listen 127.0.0.1 --port 8188) or pass --server host:port"
    ]


def test_missing_file_and_ui_format_are_one_line(tmp_path: Path) -> None:
    done = _script(tmp_path / "nope.json")
    assert (done.returncode, done.stderr) == (
        1,
        f"error: {tmp_path / 'nope.json'}: no such file (the API workflows are in workflows/api/)\n",
    )
    done = _script(ROOT / "workflows" / "flux1_dev_tp4.json")
    assert done.stderr == (
        f"error: {ROOT / 'workflows' / 'flux1_dev_tp4.json'} is not in ComfyUI's API format (node id -> "
        "{class_type, inputs}); export it with Workflow -> Export (API), or use a file from workflows/api/\n"
    )
