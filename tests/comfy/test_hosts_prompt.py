"""Issue 55's "done when", through a real ComfyUI's /prompt: ComfyUI (the first host, 2 CPU workers) and an
agent on 127.0.0.2 with its own models folder (2 CPU workers), the loader's devices 'cpu x2, 127.0.0.2:cpu x2':

- 'tp 2 x ring 2' (TP inside each host, the ring across) under ComfyUI's KSampler equals ComfyUI's own latent;
- a file that differs on the second host is refused, naming the host, its path and what differs;
- the second agent SIGKILLed mid-step is named within 10 s, nothing is left running on either host, and the
  next job on the first host alone is exact.

Everything on loopback: ComfyUI's hub listens on 127.0.0.1 (ROCM_PARALLEL_LISTEN), the agent connects from
127.0.0.2; the group's key is the file ComfyUI's user folder holds (copied as a user would).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from comfy_server import COMFYUI_PATH, TESTS_DIR, Comfy, model_prompt, reference, running_comfy, saved_latent
from test_sampling import flux_model

from rocm_parallel.backend.checkpoint import save_checkpoint

if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))
from agents import alive, assert_gone, descendants, free_port, running_agent, write_key

pytestmark = [pytest.mark.comfy, pytest.mark.timeout(1800)]

CASE = "dev_4steps"
DEVICES = "cpu x2, 127.0.0.2:cpu x2"
OTHER = "tiny-flux-other.safetensors"


class TwoHosts:
    def __init__(self, comfy: Comfy, agent: object, there: Path) -> None:
        self.comfy, self.agent, self.there = comfy, agent, there


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoHosts]:
    if not COMFYUI_PATH:  # as the tier's own server fixture (conftest.py): this module starts its own server
        pytest.skip("set COMFYUI_PATH to a ComfyUI checkout to run the comfy tier")
    base = tmp_path_factory.mktemp("comfy-hosts")
    port = free_port()
    key = write_key(base / "user" / "rocm_parallel" / "hosts.key")  # where ComfyUI keeps the group's key
    copy = write_key(base / "agent.key")
    shutil.copy(key, copy)  # the copy the second host is given (mode 600 kept)
    there = base / "there" / "models"
    (there / "diffusion_models").mkdir(parents=True)
    with running_comfy(base, env={"ROCM_PARALLEL_LISTEN": f"127.0.0.1:{port}"}) as comfy:
        mine = base / "models" / "diffusion_models" / "tiny-flux-dev.safetensors"
        shutil.copy(mine, there / "diffusion_models" / mine.name)
        with running_agent(f"127.0.0.1:{port}", copy, "127.0.0.2", base / "agent.log", models=there) as agent:
            yield TwoHosts(comfy, agent, there)


def _prompt(
    devices: str, layout: str, prefix: str, checkpoint: str | None = None, steps: int | None = None
) -> dict:
    prompt = model_prompt(CASE)
    prompt["4"]["inputs"]["devices"] = devices
    if checkpoint is not None:
        prompt["4"]["inputs"]["checkpoint"] = checkpoint
    prompt["5"]["inputs"]["layout"] = layout
    prompt["7"]["inputs"]["filename_prefix"] = prefix
    if steps is not None:
        prompt["6"]["inputs"]["steps"] = steps
    return prompt


def _queue(comfy: Comfy, prompt: dict) -> str:
    return comfy.post("/prompt", {"prompt": prompt, "client_id": "rp-hosts"})["prompt_id"]


def _error(entry: dict) -> str:
    errors = [data for kind, data in entry["status"]["messages"] if kind == "execution_error"]
    assert errors, entry["status"]
    return errors[0]["exception_message"]


def test_tp_inside_each_host_and_the_ring_across_equals_comfyui_through_the_prompt(
    two_hosts: TwoHosts,
) -> None:
    comfy = two_hosts.comfy
    entry = comfy.wait_done(_queue(comfy, _prompt(DEVICES, "tp 2 x ring 2", "hosts/parity")))
    assert entry["status"]["status_str"] == "success", _error(entry)
    diff = (saved_latent(comfy, "hosts/parity") - reference(CASE)["output"]).abs().max().item()
    print(f"{CASE} tp 2 x ring 2 over two hosts via /prompt: max |diff| {diff:.2e}")
    assert diff <= 1e-4
    state = comfy.get("/rocm_parallel/status")
    assert state["devices"] == ["cpu", "cpu", "127.0.0.2:cpu", "127.0.0.2:cpu"]
    assert state["layout"] == "tp 2 x ring 2"
    # ranks 2 and 3 are the agent's: the second host's processes
    assert len(descendants(two_hosts.agent.pid)) == 2


def test_a_different_file_on_the_second_host_is_refused_through_the_prompt(two_hosts: TwoHosts) -> None:
    comfy = two_hosts.comfy
    save_checkpoint(flux_model("dev"), comfy.base / "models" / "diffusion_models" / OTHER)
    save_checkpoint(flux_model("schnell"), two_hosts.there / "diffusion_models" / OTHER)
    entry = comfy.wait_done(_queue(comfy, _prompt(DEVICES, "tp 2 x ring 2", "hosts/other", checkpoint=OTHER)))
    assert entry["status"]["status_str"] == "error"
    message = _error(entry)
    there = two_hosts.there / "diffusion_models" / OTHER
    mine = comfy.base / "models" / "diffusion_models" / OTHER
    assert (
        f"host 127.0.0.2 (agent pid {two_hosts.agent.pid}) does not have this host's files, so nothing was loaded: "
        f"diffusion_models/{OTHER}: {there} is not the same file: its size is {there.stat().st_size:,} bytes "
        f"there, {mine.stat().st_size:,} here."
    ) in message, message
    assert not list((comfy.base / "output").glob("hosts/other*"))


def test_the_second_agent_killed_mid_step_is_named_and_the_first_host_alone_is_exact(
    two_hosts: TwoHosts,
) -> None:
    comfy, agent = two_hosts.comfy, two_hosts.agent
    prompt_id = _queue(comfy, _prompt(DEVICES, "tp 2 x ring 2", "hosts/killed", steps=400))
    deadline = time.monotonic() + 300
    while (state := comfy.get("/rocm_parallel/status")).get("step", 0) < 2 or state["phase"] != "sampling":
        assert not comfy.get(f"/history/{prompt_id}").get(prompt_id), "the prompt ended before step 2"
        assert time.monotonic() < deadline, state
        time.sleep(0.05)
    ranks = descendants(agent.pid)
    comfy_side = descendants(comfy.proc.pid)
    assert len(ranks) == 2 and len(comfy_side) >= 2
    killed = time.time()
    os.kill(agent.pid, signal.SIGKILL)
    entry = comfy.wait_done(prompt_id, timeout=120)
    assert entry["status"]["status_str"] == "error"
    ended = (
        next(data for kind, data in entry["status"]["messages"] if kind == "execution_error")["timestamp"]
        / 1000
    )
    message = _error(entry)
    print(f"named {ended - killed:.1f} s after the SIGKILL: {message[:300]}")
    assert ended - killed <= 10.0
    assert message.startswith(
        f"host 127.0.0.2 (agent pid {agent.pid}) is gone while running 'model_call': its connection closed (the "
        "agent exited or was killed, or its host went down); its rank(s) 2, 3 (127.0.0.2:cpu, 127.0.0.2:cpu) are "
        "lost with it"
    ), message
    agent.wait(timeout=10)
    assert_gone(ranks + comfy_side, "a worker on either host")
    # the next job on the first host alone
    entry = comfy.wait_done(_queue(comfy, _prompt("cpu x2", "tp 2", "hosts/alone")))
    assert entry["status"]["status_str"] == "success", _error(entry)
    diff = (saved_latent(comfy, "hosts/alone") - reference(CASE)["output"]).abs().max().item()
    assert diff <= 1e-4
    assert not any(alive(p) for p in ranks)
