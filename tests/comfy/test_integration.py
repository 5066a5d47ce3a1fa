"""The pack inside a real ComfyUI server (opt-in: COMFYUI_PATH=/path/to/ComfyUI).

ComfyUI runs from COMFYUI_PATH but with every writable folder in a temporary base directory
(--base-directory, --output-directory, an in-memory database), with this checkout symlinked into
its custom_nodes/. The model is a tiny random FLUX.1-dev in BFL format (the weights the committed
ComfyUI references were made with). No real CLIP/VAE exists here, so the prompt gets its CONDITIONING
from a test-only node (the reference prompt embedding from tests/data) through ComfyUI's own FluxGuidance,
and its LATENT goes to ComfyUI's core SaveLatent; the saved latents must equal ComfyUI's KSampler.

    COMFYUI_PATH=/work/comfyui PYTHONPATH=<pack parent>:<comfy shims>:<comfy deps> \
        python -m pytest -q -m comfy tests/comfy/test_integration.py
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from safetensors.torch import load_file, save_file
from test_sampling import flux_model, reference
from workflow_check import check_api, check_ui, core_object_info, input_kind

from rocm_parallel.backend.flux.convert import diffusers_to_bfl

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
PACK_ROOT = Path(__file__).resolve().parents[2]
TESTS_DIR = PACK_ROOT / "tests"
PACK_DIR_NAME = "rocm_parallel_pack"  # any folder name must work
START_TIMEOUT = 300.0

pytestmark = [
    pytest.mark.comfy,
    pytest.mark.skipif(
        not COMFYUI_PATH, reason="set COMFYUI_PATH to a ComfyUI checkout to run the comfy tier"
    ),
    pytest.mark.timeout(1200),
]

# A test-only custom node: the prompt embedding of a committed reference case as CONDITIONING.
REFERENCE_NODE = """
from safetensors.torch import load_file

REFERENCES = {references!r}


class RPTestReferenceConditioning:
    CATEGORY = "_for_testing"
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {{"required": {{"case": ("STRING", {{"default": "dev_4steps"}})}}}}

    def load(self, case):
        ref = load_file(REFERENCES)
        return ([[ref[case + ".cond"], {{"pooled_output": ref[case + ".pooled"]}}]],)


NODE_CLASS_MAPPINGS = {{"RPTestReferenceConditioning": RPTestReferenceConditioning}}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Comfy:
    def __init__(self, base: Path, port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.base, self.port, self.proc, self.log = base, port, proc, log
        self.server = f"127.0.0.1:{port}"

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(f"http://{self.server}{path}", timeout=30) as r:
            body = r.read()
            return json.loads(body) if r.headers.get_content_type() == "application/json" else body

    def post(self, path: str, body: dict[str, Any]) -> Any:
        request = urllib.request.Request(
            f"http://{self.server}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30) as r:
            text = r.read()
            return json.loads(text) if text else None

    def wait_done(self, prompt_id: str, timeout: float = 600.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            entry = self.get(f"/history/{prompt_id}").get(prompt_id)
            if entry and entry["status"].get("completed") is not None:
                return entry
            assert self.proc.poll() is None, f"ComfyUI exited:\n{self.log.read_text()[-3000:]}"
            time.sleep(0.5)
        raise AssertionError(f"prompt {prompt_id} did not finish within {timeout} s")


def _tree_state(path: str) -> str:
    """Every change git sees in the ComfyUI checkout, ignored files included: it must not change."""
    return subprocess.run(
        ["git", "status", "--porcelain", "--ignored", "--untracked-files=all"],
        cwd=path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout


@pytest.fixture(scope="module")
def comfy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Comfy]:
    base = tmp_path_factory.mktemp("comfy-base")
    (base / "custom_nodes").mkdir()
    (base / "custom_nodes" / PACK_DIR_NAME).symlink_to(PACK_ROOT, target_is_directory=True)
    (base / "custom_nodes" / "rp_test_nodes.py").write_text(
        REFERENCE_NODE.format(references=str(TESTS_DIR / "data" / "comfy_references.safetensors"))
    )
    models = base / "models" / "diffusion_models"
    models.mkdir(parents=True)
    save_file(diffusers_to_bfl(flux_model("dev").state_dict()), str(models / "tiny-flux-dev.safetensors"))
    before = _tree_state(COMFYUI_PATH)

    port = _free_port()
    env = {
        **os.environ,
        "ROCM_PARALLEL_THREADS": "1",  # one thread per worker: the machine's cores are shared
        "OMP_NUM_THREADS": "1",
        "PYTHONDONTWRITEBYTECODE": "1",  # nothing written into the ComfyUI checkout
    }
    log = base / "comfyui.log"
    command = [
        sys.executable,
        "main.py",
        "--cpu",
        "--listen",
        "127.0.0.1",
        "--port",
        str(port),
        "--base-directory",
        str(base),
        "--output-directory",
        str(base / "output"),
        "--database-url",
        "sqlite:///:memory:",
        "--disable-auto-launch",
        "--disable-api-nodes",
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, cwd=COMFYUI_PATH, env=env, stdout=out, stderr=subprocess.STDOUT)
    server = Comfy(base, port, proc, log)
    print(f"\nComfyUI base directory (logs, outputs, screenshots): {base}")
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            assert proc.poll() is None, f"ComfyUI exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            try:
                server.get("/system_stats")
                break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, f"ComfyUI did not start:\n{log.read_text()[-3000:]}"
                time.sleep(1.0)
        yield server
    finally:
        family = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        # The workers follow their parent through the death pipe; give them a moment.
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_alive(p) for p in family):
            time.sleep(0.2)
        left = [p for p in family if _alive(p)]
        for pid in left:
            psutil.Process(pid).kill()
        assert left == [], f"processes left behind by ComfyUI: {left}"
        assert _tree_state(COMFYUI_PATH) == before, "the ComfyUI checkout was written to"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def sampling_prompt(steps: int = 4, prefix: str = "rp") -> dict[str, Any]:
    """Reference case dev_4steps through both samplers, each saved with SaveLatent."""
    shared = {"seed": 42, "steps": steps, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}
    links = {"parallel_flux": ["4", 0], "positive": ["2", 0], "latent_image": ["3", 0]}
    return {
        "1": {"class_type": "RPTestReferenceConditioning", "inputs": {"case": "dev_4steps"}},
        "2": {"class_type": "FluxGuidance", "inputs": {"conditioning": ["1", 0], "guidance": 3.5}},
        "3": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "4": {
            "class_type": "RocmParallelLoader",
            "inputs": {
                "checkpoint": "tiny-flux-dev.safetensors",
                "devices": "cpu x2",
                "dtype": "float32",
                "preload": "tp",
            },
        },
        "5": {"class_type": "RocmParallelTPSampler", "inputs": {**links, **shared}},
        "6": {"class_type": "SaveLatent", "inputs": {"samples": ["5", 0], "filename_prefix": f"{prefix}/tp"}},
        "7": {
            "class_type": "RocmParallelRingSampler",
            "inputs": {**links, **shared, "ring_degree": 0, "ulysses_degree": 0},
        },
        "8": {
            "class_type": "SaveLatent",
            "inputs": {"samples": ["7", 0], "filename_prefix": f"{prefix}/ring"},
        },
    }


def test_pack_loads_with_nodes_route_js_and_templates(comfy: Comfy) -> None:
    info = comfy.get("/object_info")
    for node_id in (
        "RocmParallelLoader",
        "RocmParallelTPSampler",
        "RocmParallelRingSampler",
        "RocmParallelStatus",
    ):
        assert info[node_id]["category"] == "ROCm Parallel"
    assert info["RocmParallelLoader"]["input"]["required"]["checkpoint"][0] == ["tiny-flux-dev.safetensors"]
    assert info["RocmParallelLoader"]["display_name"] == "ROCm Parallel Loader"
    # Nothing has run yet: the panel's route answers the registry's idle snapshot.
    assert comfy.get("/rocm_parallel/status") == {
        "devices": [],
        "checkpoint": None,
        "layout": None,
        "phase": "stopped",
        "ranks": [],
    }
    assert b"registerExtension" in comfy.get(f"/extensions/{PACK_DIR_NAME}/rocm_parallel.js")
    templates = comfy.get("/api/workflow_templates")
    assert sorted(templates[PACK_DIR_NAME]) == [
        "flux1_dev_ring2",
        "flux1_dev_ring2_ulysses2",
        "flux1_dev_tp4",
        "flux1_schnell_tp2",
    ]
    assert comfy.get(f"/api/workflow_templates/{PACK_DIR_NAME}/flux1_dev_tp4.json")["nodes"]


def test_workflows_against_the_live_object_info(comfy: Comfy) -> None:
    info = comfy.get("/object_info")
    for path in sorted((PACK_ROOT / "workflows").glob("*.json")):
        assert check_ui(json.loads(path.read_text()), info) == [], path.name
        assert check_api(json.loads((path.parent / "api" / path.name).read_text()), info) == [], path.name
    # The hard-coded core specs of the CI tier are what this ComfyUI reports (model file lists aside).
    for class_type, spec in core_object_info().items():
        live = info[class_type]
        assert live["output"] == spec["output"], class_type
        for section, inputs in spec["input"].items():
            assert list(live["input"][section]) == list(inputs), (class_type, section)
            for name, value in inputs.items():
                kind, options = input_kind(live["input"][section][name])
                want_kind, want_options = input_kind(value)
                assert kind == want_kind, (class_type, name)
                if kind == "COMBO" and want_options["options"]:
                    assert options["options"] == want_options["options"], (class_type, name)
                for key in ("min", "max", "default"):
                    assert options.get(key) == want_options.get(key), (class_type, name, key)


def test_both_samplers_match_comfyui_through_the_prompt_api(comfy: Comfy) -> None:
    reply = comfy.post("/prompt", {"prompt": sampling_prompt(), "client_id": "rp-test"})
    entry = comfy.wait_done(reply["prompt_id"])
    assert entry["status"]["status_str"] == "success", entry["status"]
    expected = reference("dev_4steps")["output"]
    for name in ("tp", "ring"):
        files = sorted((comfy.base / "output" / "rp").glob(f"{name}_*.latent"))
        assert len(files) == 1, files
        saved = load_file(str(files[0]))["latent_tensor"]
        assert (saved - expected).abs().max().item() <= 1e-4, name
    state = comfy.get("/rocm_parallel/status")
    assert state["devices"] == ["cpu", "cpu"] and state["phase"] == "idle"
    assert state["layout"] == "context parallel ring=2 x ulysses=1"
    assert [r["device"] for r in state["ranks"]] == ["cpu", "cpu"]


def test_headless_script_runs_a_prompt_and_downloads_its_output(comfy: Comfy, tmp_path: Path) -> None:
    workflow = tmp_path / "prompt.json"
    workflow.write_text(json.dumps(sampling_prompt(prefix="headless")))
    out = subprocess.run(
        [sys.executable, str(PACK_ROOT / "scripts" / "headless_prompt.py"), str(workflow), "--server",
         comfy.server, "--out", str(tmp_path / "got"), "--timeout", "600"],
        capture_output=True, text=True, timeout=700,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    got = sorted(p.name for p in (tmp_path / "got").iterdir())
    assert [n.split("_")[0] for n in got] == ["ring", "tp"], got
    for path in (tmp_path / "got").iterdir():
        saved = load_file(str(path))["latent_tensor"]
        assert (saved - reference("dev_4steps")["output"]).abs().max().item() <= 1e-4


def test_interrupt_cancels_the_job_and_the_workers_stay(comfy: Comfy) -> None:
    prompt = sampling_prompt(steps=5000, prefix="cancelled")
    prompt_id = comfy.post("/prompt", {"prompt": prompt, "client_id": "rp-test"})["prompt_id"]
    deadline = time.monotonic() + 300
    while True:  # wait until the workers are past a few steps
        state = comfy.get("/rocm_parallel/status")
        if state["phase"] == "sampling" and state.get("step", 0) >= 3:
            break
        assert time.monotonic() < deadline, f"sampling never started: {state}"
        time.sleep(0.2)
    pids_before = sorted(c.pid for c in psutil.Process(comfy.proc.pid).children(recursive=True))
    comfy.post("/interrupt", {"prompt_id": prompt_id})
    entry = comfy.wait_done(prompt_id, timeout=120)
    assert entry["status"]["status_str"] == "error"
    assert [m[0] for m in entry["status"]["messages"]][-1] == "execution_interrupted"
    state = comfy.get("/rocm_parallel/status")
    assert state["phase"] == "idle" and state["step"] < 5000
    assert "InterruptProcessingException" in state["error"]
    assert not list((comfy.base / "output").glob("cancelled*"))
    # The same workers run the next job.
    reply = comfy.post("/prompt", {"prompt": sampling_prompt(prefix="after_cancel"), "client_id": "rp-test"})
    assert comfy.wait_done(reply["prompt_id"])["status"]["status_str"] == "success"
    assert sorted(c.pid for c in psutil.Process(comfy.proc.pid).children(recursive=True)) == pids_before
