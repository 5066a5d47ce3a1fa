"""The pack inside a real ComfyUI server (opt-in: COMFYUI_PATH=/path/to/ComfyUI; see comfy_server.py).

The prompts use both samplers on 2 CPU workers (one thread each) and must equal ComfyUI's own KSampler
(the running version's tests/data/comfy_references*.safetensors); a long run is cancelled through /interrupt.

    COMFYUI_PATH=<ComfyUI checkout> PYTHONPATH=<pack parent>:<comfy shims>:<comfy deps> \\
        python -m pytest -q -m comfy tests/comfy
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from comfy_server import (
    COMFYUI_VERSION,
    FLUX2_CASES,
    MODELS,
    PACK_DIR_NAME,
    PACK_ROOT,
    Comfy,
    absolute_paths,
    flux2_prompt,
    loader_node,
    model_prompt,
    reference,
    rejected_checkpoint,
    sampling_prompt,
    status_prompt,
)
from safetensors.torch import load_file
from workflow_check import check_api, check_ui, core_object_info, core_versions, input_kind

pytestmark = [pytest.mark.comfy, pytest.mark.timeout(1200)]


def test_pack_loads_with_nodes_route_js_and_templates(comfy: Comfy) -> None:
    info = comfy.get("/object_info")
    for node_id in (
        "RocmParallelLoader",
        "RocmParallelLoRA",
        "RocmParallelModel",
        "RocmParallelTPSampler",
        "RocmParallelRingSampler",
        "RocmParallelStatus",
        "RocmParallelVAEDecode",
        "RocmParallelVAEEncode",
    ):
        assert info[node_id]["category"] == "ROCm Parallel"
    files = ["tiny-flux-dev.safetensors"] + (["tiny-flux2.safetensors"] if FLUX2_CASES else [])
    assert info["RocmParallelLoader"]["input"]["required"]["checkpoint"][0] == files
    assert info["RocmParallelLoader"]["display_name"] == "ROCm Parallel Loader"
    # The panel's route answers the registry's snapshot (whatever ran before in this session).
    state = comfy.get("/rocm_parallel/status")
    assert {"devices", "checkpoint", "layout", "phase", "ranks"} <= set(state)
    assert state["phase"] in ("stopped", "idle")
    assert b"registerExtension" in comfy.get(f"/extensions/{PACK_DIR_NAME}/rocm_parallel.js")
    templates = comfy.get("/api/workflow_templates")
    assert sorted(templates[PACK_DIR_NAME]) == [
        "flux1_dev_ksampler_parallel_model",
        "flux1_dev_lora_dpmpp2m_beta",
        "flux1_dev_ring2",
        "flux1_dev_ring2_ulysses2",
        "flux1_dev_text_encoder_parallel_model",
        "flux1_dev_tp4",
        "flux1_dev_tp4_parallel_vae",
        "flux1_kontext_dev_ksampler_parallel_model",
        "flux1_schnell_tp2",
        "flux2_dev_gguf_parallel_model_tp2",
        "flux2_dev_parallel_model_tp2_ulysses2",
        "flux2_dev_parallel_model_tp4",
        "flux2_dev_text_encoder_parallel_model_tp4",
        "qwen_image_parallel_model_batch2_tp2",
        "qwen_image_text_encoder_parallel_model_batch2_tp2",
        "wan2_1_t2v_14b_parallel_model_batch2_ulysses2",
        "wan2_2_i2v_a14b_parallel_model_batch2_tp2",
    ]
    assert comfy.get(f"/api/workflow_templates/{PACK_DIR_NAME}/flux1_dev_tp4.json")["nodes"]
    # The samplers offer all of ComfyUI's own samplers and schedulers.
    ksampler = info["KSampler"]["input"]["required"]
    for node_id in ("RocmParallelTPSampler", "RocmParallelRingSampler"):
        required = info[node_id]["input"]["required"]
        assert required["sampler_name"][0] == ksampler["sampler_name"][0]
        assert required["scheduler"][0] == ksampler["scheduler"][0]


def test_workflows_against_the_live_object_info(comfy: Comfy) -> None:
    info = comfy.get("/object_info")
    for path in sorted((PACK_ROOT / "workflows").glob("*.json")):
        assert check_ui(json.loads(path.read_text()), info) == [], path.name
        assert check_api(json.loads((path.parent / "api" / path.name).read_text()), info) == [], path.name
    # The CI tier's core specs of this ComfyUI version are what it reports (model file lists aside): each
    # version is checked against its own (tests/data/comfy_core_nodes*.json, tests/tools/dump_core_nodes.py).
    assert COMFYUI_VERSION in core_versions(), (
        f"no core node specs of ComfyUI {COMFYUI_VERSION}: run tests/tools/dump_core_nodes.py with it"
    )
    for class_type, spec in core_object_info(COMFYUI_VERSION).items():
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
    # ComfyUI picks the order of the two output branches; the last sampler's layout stays resident.
    assert state["layout"] in ("ring 2", "tp 2")
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
    # A Cancel is the user's choice, not a failure: the panel says so and shows no error.
    assert state["last"] == "sampling cancelled by the user" and state["error"] is None
    assert not list((comfy.base / "output").glob("cancelled*"))
    # The same workers run the next job.
    reply = comfy.post("/prompt", {"prompt": sampling_prompt(prefix="after_cancel"), "client_id": "rp-test"})
    assert comfy.wait_done(reply["prompt_id"])["status"]["status_str"] == "success"
    assert sorted(c.pid for c in psutil.Process(comfy.proc.pid).children(recursive=True)) == pids_before


def test_a_rejected_checkpoint_is_never_named_as_the_model_nor_its_path_shown(comfy: Comfy) -> None:
    """The status route is readable by anyone who reaches ComfyUI's port: no absolute paths in `error`."""
    first = comfy.post("/prompt", {"prompt": status_prompt("report", loader_node(devices="cpu*2"))})
    assert comfy.wait_done(first["prompt_id"])["status"]["status_str"] == "success"
    resident = comfy.get("/rocm_parallel/status")
    assert resident["checkpoint"] == "tiny-flux-dev.safetensors" and resident["error"] is None
    with rejected_checkpoint(comfy) as name:
        reply = comfy.post("/prompt", {"prompt": status_prompt("report", loader_node(name, devices="cpu*2"))})
        entry = comfy.wait_done(reply["prompt_id"])
    assert entry["status"]["status_str"] == "error"
    failed = next(m for m in entry["status"]["messages"] if m[0] == "execution_error")[1]
    assert failed["node_type"] == "RocmParallelLoader"
    state = comfy.get("/rocm_parallel/status")
    assert state["phase"] == "idle" and state["loading"] is None
    # The workers still hold the earlier checkpoint, and the panel names that one.
    assert (state["checkpoint"], state["layout"]) == (resident["checkpoint"], resident["layout"])
    assert name in state["error"], state["error"]
    assert absolute_paths(state["error"]) == [] and str(comfy.base) not in state["error"], state["error"]
    # The Status node's text says the same.
    after = comfy.post("/prompt", {"prompt": status_prompt("report")})
    text = comfy.wait_done(after["prompt_id"])["outputs"]["2"]["text"][0]
    assert text.split("\n")[1].startswith("model: tiny-flux-dev.safetensors, ")
    assert f"last error: {state['error']}" in text.split("\n")


def _saved(comfy: Comfy, prefix: str) -> torch.Tensor:
    files = sorted((comfy.base / "output").glob(f"{prefix}_*.latent"))
    assert len(files) == 1, files
    return load_file(str(files[0]))["latent_tensor"]


@pytest.mark.parametrize("case", ["dpmpp_2m_beta", "cfg_negative"])
def test_comfyuis_ksampler_on_the_parallel_model_through_the_prompt_api(comfy: Comfy, case: str) -> None:
    reply = comfy.post("/prompt", {"prompt": model_prompt(case), "client_id": "rp-test"})
    entry = comfy.wait_done(reply["prompt_id"])
    assert entry["status"]["status_str"] == "success", entry["status"]
    assert (_saved(comfy, f"model/{case}") - reference(case)["output"]).abs().max().item() <= 1e-4


def test_kontext_through_the_prompt_api_matches_comfyui(comfy: Comfy) -> None:
    """ComfyUI's ReferenceLatent on the prompt, ComfyUI's KSampler on the ROCm Parallel Model (TP 2): the
    saved latent equals what ComfyUI sampled with its own model and the same reference latent."""
    case = "kontext_2steps"
    prompt = model_prompt(case)
    prompt["10"] = {"class_type": "RPTestReferenceLatent", "inputs": {"case": case, "index": 0}}
    prompt["11"] = {
        "class_type": "ReferenceLatent",
        "inputs": {"conditioning": ["1", 0], "latent": ["10", 0]},
    }
    prompt["2"]["inputs"]["conditioning"] = ["11", 0]
    entry = comfy.wait_done(comfy.post("/prompt", {"prompt": prompt, "client_id": "rp-test"})["prompt_id"])
    assert entry["status"]["status_str"] == "success", entry["status"]
    assert (_saved(comfy, f"model/{case}") - reference(case)["output"]).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    ("layout", "devices"),
    [
        ("tp", "cpu x2"),
        ("context", "cpu x2"),
        pytest.param("tp 2 x ring 2", "cpu x4", marks=pytest.mark.comfy_quick),
    ],
)
def test_flux2_template_graph_through_the_prompt_api_matches_comfyuis_own_flux2(
    comfy: Comfy, layout: str, devices: str
) -> None:
    """The shipped FLUX.2 workflow's graph (ROCm Parallel Loader -> ROCm Parallel Model -> BasicGuider,
    RandomNoise, KSamplerSelect, Flux2Scheduler, EmptyFlux2LatentImage, SamplerCustomAdvanced) with a
    FLUX.2 checkpoint, queued through /prompt, at TP and context parallelism on 2 workers and composed on 4:
    the saved latent equals ComfyUI's own Flux2's for the same weights, seed and text features
    (tests/tools/make_comfy_references.py)."""
    if not FLUX2_CASES or "EmptyFlux2LatentImage" not in comfy.get("/object_info/EmptyFlux2LatentImage"):
        pytest.skip("this ComfyUI predates FLUX.2 (0.3.75)")
    case = "flux2_4steps"
    prompt = flux2_prompt(case, layout, devices=devices)
    entry = comfy.wait_done(comfy.post("/prompt", {"prompt": prompt})["prompt_id"])
    assert entry["status"]["status_str"] == "success", entry["status"]
    tag = layout.replace(" ", "")
    diff = (_saved(comfy, f"flux2/{case}_{tag}") - reference(case)["output"]).abs().max().item()
    print(f"{case} /prompt {layout}: max |diff| {diff:.2e}")
    assert diff <= 1e-5


def test_tp_sampler_with_cfg_and_negative_through_the_prompt_api(comfy: Comfy) -> None:
    prompt = model_prompt("cfg_negative")
    ks = prompt["6"]["inputs"]
    prompt["6"] = {
        "class_type": "RocmParallelTPSampler",
        "inputs": {
            "parallel_flux": ["4", 0], "positive": ks["positive"], "negative": ks["negative"],
            "latent_image": ks["latent_image"], "seed": ks["seed"], "steps": ks["steps"], "cfg": ks["cfg"],
            "sampler_name": ks["sampler_name"], "scheduler": ks["scheduler"], "denoise": 1.0,
        },
    }  # fmt: skip
    del prompt["5"]
    prompt["7"]["inputs"]["filename_prefix"] = "tp_node/cfg_negative"
    entry = comfy.wait_done(comfy.post("/prompt", {"prompt": prompt, "client_id": "rp-test"})["prompt_id"])
    assert entry["status"]["status_str"] == "success", entry["status"]
    assert (
        _saved(comfy, "tp_node/cfg_negative") - reference("cfg_negative")["output"]
    ).abs().max().item() <= 1e-4


def test_lora_loader_model_only_on_the_parallel_model_names_the_pack_node(comfy: Comfy) -> None:
    from rocm_parallel.nodes.checks import LORA_ON_MODEL_MESSAGE
    from rocm_parallel.testing.models import tiny_flux_config
    from rocm_parallel.testing.writers import write_random_lora

    loras = comfy.base / "models" / "loras"
    loras.mkdir(parents=True, exist_ok=True)
    write_random_lora(loras / "rp-test-lora.safetensors", tiny_flux_config(**MODELS["dev"]["config"]), "bfl")
    prompt = model_prompt("dpmpp_2m_beta", seed_offset=1)
    prompt["10"] = {
        "class_type": "LoraLoaderModelOnly",
        "inputs": {"model": ["5", 0], "lora_name": "rp-test-lora.safetensors", "strength_model": 0.8},
    }
    prompt["6"]["inputs"]["model"] = ["10", 0]
    entry = comfy.wait_done(comfy.post("/prompt", {"prompt": prompt, "client_id": "rp-test"})["prompt_id"])
    assert entry["status"]["status_str"] == "error"
    failed = next(m for m in entry["status"]["messages"] if m[0] == "execution_error")[1]
    assert failed["node_type"] == "LoraLoaderModelOnly"
    assert failed["exception_message"].strip() == LORA_ON_MODEL_MESSAGE
