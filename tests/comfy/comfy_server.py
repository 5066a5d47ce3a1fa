"""A real ComfyUI server for the comfy tier, with every writable folder in a temporary base directory.

ComfyUI runs from COMFYUI_PATH with --base-directory / --output-directory in a temporary folder and an
in-memory database, so nothing is written into the checkout (checked before and after), and with this
checkout symlinked into its custom_nodes/. The model is a tiny random FLUX.1-dev in BFL format (the
weights the committed ComfyUI references were made with). The references are the running version's own
(`REFERENCES`, `reference`). No real CLIP/VAE exists here, so prompts take
their CONDITIONING from a test-only node (a reference prompt embedding from tests/data) through ComfyUI's
own FluxGuidance, and save the LATENT with ComfyUI's core SaveLatent.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_sampling import flux_model

from rocm_parallel.backend.checkpoint import diffusers_to_bfl

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
# ComfyUI-GGUF's checkout (its repository, never committed here): linked into the server's custom_nodes when
# set, for tests/comfy/test_comfy_gguf.py, which skips without it.
COMFYUI_GGUF_PATH = os.environ.get("COMFYUI_GGUF_PATH")
FLUX2_CHECKPOINT = "tiny-flux2.safetensors"
PACK_ROOT = Path(__file__).resolve().parents[2]
TESTS_DIR = PACK_ROOT / "tests"
PACK_DIR_NAME = "rocm_parallel_pack"  # any folder name must work
START_TIMEOUT = 300.0
if str(TESTS_DIR / "tools") not in sys.path:
    sys.path.insert(0, str(TESTS_DIR / "tools"))
from make_comfy_references import comfy_version, reference_file  # noqa: E402

# The running ComfyUI's version and the references its own models made (tests/tools/make_comfy_references.py
# run with that version): every comparison in the tier reads these, so each version is checked against itself
# (ComfyUI's CPU ancestral noise changed in 0.7.0, its RMSNorm / RoPE rounding in 0.14).
COMFYUI_VERSION = comfy_version(COMFYUI_PATH) if COMFYUI_PATH else None
REFERENCES = reference_file(COMFYUI_VERSION) if COMFYUI_VERSION else reference_file("0.3.75")


def _metadata() -> dict[str, str]:
    if not REFERENCES.is_file():
        return {}
    with safe_open(str(REFERENCES), "pt") as f:
        return dict(f.metadata())


META = _metadata()
ALL_CASES: dict[str, Any] = json.loads(META.get("cases", "{}"))
MODELS: dict[str, Any] = json.loads(META.get("models", "{}"))
FLUX2_CASES: dict[str, Any] = json.loads(META.get("flux2_cases", "{}"))  # made by ComfyUI >= 0.3.75


def reference(name: str) -> dict[str, torch.Tensor]:
    """Reference case `name` as the running ComfyUI version recorded it (its tensors, without the prefix)."""
    assert REFERENCES.is_file(), (
        f"no references made by ComfyUI {COMFYUI_VERSION}: run tests/tools/make_comfy_references.py with it "
        f"(it writes {REFERENCES})"
    )
    assert META["comfyui_version"] == COMFYUI_VERSION, (REFERENCES, META["comfyui_version"], COMFYUI_VERSION)
    with safe_open(str(REFERENCES), "pt") as f:
        found = {k.split(".", 1)[1]: f.get_tensor(k) for k in f.keys() if k.startswith(name + ".")}
    assert found, f"{REFERENCES} has no case {name!r}"
    return found


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
        prefix = case[: -len(":neg")] + ".neg_" if case.endswith(":neg") else case + "."
        # FLUX.2 cases have no pooled vector: its text encoder gives pooled_output None, as here
        return ([[ref[prefix + "cond"], {{"pooled_output": ref.get(prefix + "pooled")}}]],)


class RPTestReferenceLatent:
    # A reference case's Kontext reference latent (<case>.ref<index>) as a LATENT.
    CATEGORY = "_for_testing"
    RETURN_TYPES = ("LATENT",)
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {{"required": {{"case": ("STRING", {{"default": "kontext_2steps"}}), "index": ("INT", {{"default": 0}})}}}}

    def load(self, case, index):
        return ({{"samples": load_file(REFERENCES)[f"{{case}}.ref{{index}}"]}},)


class RPTestTinyUNETLoader:
    # ComfyUI's own loader (comfy.sd.load_diffusion_model, float32) for the tests' small models: its
    # detection hard-codes the full models' head count and RoPE axes, so it is told those two, as
    # tests/tools/make_comfy_references.py tells it; everything else is ComfyUI's own reading.
    CATEGORY = "_for_testing"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {{"required": {{"unet_name": ("STRING", {{"default": ""}}), "num_heads": ("INT", {{"default": 4}}),
                              "axes_dim": ("STRING", {{"default": "[4, 6, 6]"}})}}}}

    def load(self, unet_name, num_heads, axes_dim):
        import json

        import comfy.model_detection as detection
        import comfy.sd
        import folder_paths
        import torch

        original = detection.detect_unet_config

        def detect(state_dict, key_prefix, metadata=None):
            config = original(state_dict, key_prefix, metadata=metadata)
            return {{**config, "num_heads": num_heads, "axes_dim": json.loads(axes_dim)}}

        detection.detect_unet_config = detect
        try:
            path = folder_paths.get_full_path_or_raise("diffusion_models", unet_name)
            return (comfy.sd.load_diffusion_model(path, model_options={{"dtype": torch.float32}}),)
        finally:
            detection.detect_unet_config = original


class RPTestTinyUnetLoaderGGUF:
    # ComfyUI-GGUF's own "Unet Loader (GGUF)" (its UnetLoaderGGUF.load_unet: its GGUF reader, GGMLOps and
    # GGUFModelPatcher) for the tests' small models, ComfyUI's detection told what it hard-codes for the
    # released ones (`overrides`, JSON: e.g. the head count and RoPE axes), as RPTestTinyUNETLoader does.
    # Needs ComfyUI-GGUF in custom_nodes (COMFYUI_GGUF_PATH).
    CATEGORY = "_for_testing"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {{"required": {{"unet_name": ("STRING", {{"default": ""}}), "overrides": ("STRING", {{"default": "{{}}"}})}}}}

    def load(self, unet_name, overrides):
        import json

        import comfy.model_detection as detection
        import nodes

        original = detection.detect_unet_config

        def detect(state_dict, key_prefix, metadata=None):
            config = original(state_dict, key_prefix, metadata=metadata)
            return None if config is None else {{**config, **json.loads(overrides)}}

        detection.detect_unet_config = detect
        try:
            return nodes.NODE_CLASS_MAPPINGS["UnetLoaderGGUF"]().load_unet(unet_name)
        finally:
            detection.detect_unet_config = original


class RPTestSeededConditioning:
    # A seeded random text conditioning [1, tokens, width] (no pooled vector): for models the reference
    # file has no case of (the GGUF tier's Qwen-Image).
    CATEGORY = "_for_testing"
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {{"required": {{"seed": ("INT", {{"default": 0}}), "tokens": ("INT", {{"default": 7}}),
                              "width": ("INT", {{"default": 32}})}}}}

    def load(self, seed, tokens, width):
        import torch

        g = torch.Generator().manual_seed(seed)
        return ([[torch.randn(1, tokens, width, generator=g), {{}}]],)


class RPTestTinyCLIPLoader:
    # ComfyUI's own CLIPLoader (comfy.sd.load_clip with its type) for the tests' small text encoders: ComfyUI
    # builds a released encoder's config, so it is told the file's (`options`, JSON: its model_options, e.g.
    # {{"qwen25_7b_model_config": {{...}}}}); tokenizer, templates and weights are ComfyUI's own reading.
    # `clip_name` may name two files, comma-separated: ComfyUI's DualCLIPLoader (T5-XXL and CLIP-L).
    CATEGORY = "_for_testing"
    RETURN_TYPES = ("CLIP",)
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {{"required": {{"clip_name": ("STRING", {{"default": ""}}), "type": ("STRING", {{"default": "qwen_image"}}),
                              "options": ("STRING", {{"default": "{{}}"}})}}}}

    def load(self, clip_name, type, options):
        import json

        import comfy.sd
        import folder_paths

        return (comfy.sd.load_clip(
            ckpt_paths=[folder_paths.get_full_path_or_raise("text_encoders", n) for n in clip_name.split(",")],
            embedding_directory=folder_paths.get_folder_paths("embeddings"),
            clip_type=getattr(comfy.sd.CLIPType, type.upper(), comfy.sd.CLIPType.STABLE_DIFFUSION),  # as CLIPLoader
            model_options=json.loads(options),
        ),)


def _save_tensors(tensors, filename_prefix):
    # <output>/<filename_prefix>.safetensors, for a comparison outside the server
    import os

    import folder_paths
    from safetensors.torch import save_file

    os.makedirs(folder_paths.get_output_directory(), exist_ok=True)
    path = os.path.join(folder_paths.get_output_directory(), filename_prefix + ".safetensors")
    save_file({{k: v.contiguous() for k, v in tensors.items()}}, path)


class _RPTestSaver:
    CATEGORY = "_for_testing"
    RETURN_TYPES = ()
    OUTPUT_NODE = True
    FUNCTION = "save"


class RPTestSaveConditioning(_RPTestSaver):
    # A CONDITIONING's first entry: its tensor (`cond`) and the tensors beside it (pooled_output,
    # attention_mask, ...).
    @classmethod
    def INPUT_TYPES(cls):
        return {{"required": {{"conditioning": ("CONDITIONING",), "filename_prefix": ("STRING", {{"default": "cond"}})}}}}

    def save(self, conditioning, filename_prefix):
        import torch

        cond, extra = conditioning[0]
        _save_tensors({{"cond": cond, **{{k: v for k, v in extra.items() if isinstance(v, torch.Tensor)}}}}, filename_prefix)
        return {{}}


class RPTestSaveImageTensor(_RPTestSaver):
    # An IMAGE (`image`, float32 as the node got it): SaveImage's 8-bit PNG would hide differences below 1/255.
    @classmethod
    def INPUT_TYPES(cls):
        return {{"required": {{"images": ("IMAGE",), "filename_prefix": ("STRING", {{"default": "image"}})}}}}

    def save(self, images, filename_prefix):
        _save_tensors({{"image": images.float()}}, filename_prefix)
        return {{}}


class RPTestComfyEngine:
    # The ROCm Parallel loader's handle on the model engine (engine 'comfy': ComfyUI's own model class on the
    # workers), its detection told `detection` (JSON), as RPTestTinyUNETLoader tells ComfyUI's own loader.
    CATEGORY = "_for_testing"
    RETURN_TYPES = ("PARALLEL_FLUX",)
    FUNCTION = "engine"

    @classmethod
    def INPUT_TYPES(cls):
        return {{"required": {{"parallel_flux": ("PARALLEL_FLUX",), "detection": ("STRING", {{"default": "{{}}"}})}}}}

    def engine(self, parallel_flux, detection):
        import dataclasses

        return (dataclasses.replace(parallel_flux, engine="comfy", detection=detection),)


NODE_CLASS_MAPPINGS = {{
    "RPTestComfyEngine": RPTestComfyEngine,
    "RPTestSaveImageTensor": RPTestSaveImageTensor,
    "RPTestTinyUnetLoaderGGUF": RPTestTinyUnetLoaderGGUF,
    "RPTestTinyCLIPLoader": RPTestTinyCLIPLoader,
    "RPTestSaveConditioning": RPTestSaveConditioning,
    "RPTestSeededConditioning": RPTestSeededConditioning,
    "RPTestReferenceConditioning": RPTestReferenceConditioning,
    "RPTestReferenceLatent": RPTestReferenceLatent,
    "RPTestTinyUNETLoader": RPTestTinyUNETLoader,
}}
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


@contextmanager
def running_comfy(base: Path, env: dict[str, str] | None = None) -> Iterator[Comfy]:
    """Start ComfyUI on a free loopback port (`env`: more of its environment); on exit stop it and check nothing
    is left behind."""
    (base / "custom_nodes").mkdir()
    (base / "custom_nodes" / PACK_DIR_NAME).symlink_to(PACK_ROOT, target_is_directory=True)
    (base / "custom_nodes" / "rp_test_nodes.py").write_text(REFERENCE_NODE.format(references=str(REFERENCES)))
    if COMFYUI_GGUF_PATH:
        (base / "custom_nodes" / "ComfyUI-GGUF").symlink_to(Path(COMFYUI_GGUF_PATH), target_is_directory=True)
    # the Wan graphs' stand-ins for umt5, CLIP-H and the Wan VAE (test_comfy_wan.py)
    shutil.copy(TESTS_DIR / "comfy" / "rp_wan_test_nodes.py", base / "custom_nodes" / "rp_wan_test_nodes.py")
    models = base / "models" / "diffusion_models"
    models.mkdir(parents=True)
    save_file(diffusers_to_bfl(flux_model("dev").state_dict()), str(models / "tiny-flux-dev.safetensors"))
    if FLUX2_CASES:  # the reference tool's random FLUX.2, in the BFL single-file layout
        from make_comfy_references import flux2_model

        from rocm_parallel.backend.checkpoint import save_checkpoint

        save_checkpoint(flux2_model("flux2"), models / FLUX2_CHECKPOINT)
    before = _tree_state(COMFYUI_PATH)

    port = _free_port()
    env = {
        **os.environ,
        "ROCM_PARALLEL_THREADS": "1",  # one thread per worker: the machine's cores are shared
        "OMP_NUM_THREADS": "1",
        "PYTHONDONTWRITEBYTECODE": "1",  # nothing written into the ComfyUI checkout
        **(env or {}),
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
            # TimeoutError: the connection accepted but not yet answered (a loaded machine)
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                assert time.monotonic() < deadline, f"ComfyUI did not start:\n{log.read_text()[-3000:]}"
                time.sleep(1.0)
        yield server
    finally:
        try:
            family = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:  # ComfyUI exited already (the assertion above says how)
            family = [proc.pid]
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


def run_prompt(comfy: Comfy, prompt: dict[str, Any], client_id: str, timeout: float = 600.0) -> str:
    """Queue `prompt`, wait for it to succeed, and return what ComfyUI logged meanwhile."""
    start = comfy.log.stat().st_size
    entry = comfy.wait_done(
        comfy.post("/prompt", {"prompt": prompt, "client_id": client_id})["prompt_id"], timeout
    )
    assert entry["status"]["status_str"] == "success", _failure(entry["status"])
    with open(comfy.log, "rb") as f:
        f.seek(start)
        return f.read().decode(errors="replace")


def _failure(status: dict[str, Any]) -> str:
    """A failed prompt's error first (the node, its exception and message), then the status's tail: the
    status also echoes the node's inputs, tensors included, which would push the error out of view."""
    errors = [data for kind, data in status.get("messages", []) if kind == "execution_error"]
    head = [f"{e.get('node_type')}: {e.get('exception_type')}: {e.get('exception_message')}" for e in errors]
    return "\n".join([*head, json.dumps(status)[-2000:]])


def saved_latent(comfy: Comfy, prefix: str) -> torch.Tensor:
    """The one latent SaveLatent wrote under `prefix`."""
    files = sorted((comfy.base / "output").glob(f"{prefix}_*.latent"))
    assert len(files) == 1, files
    return load_file(str(files[0]))["latent_tensor"]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def sampling_prompt(
    steps: int = 4, prefix: str = "rp", seed: int = 42, samplers: tuple[str, ...] = ("tp", "ring")
) -> dict[str, Any]:
    """Reference case dev_4steps (seed 42) through the samplers named ('tp', 'ring'), each saved with
    SaveLatent. Another seed makes ComfyUI run the samplers again instead of using its cache."""
    shared = {
        "seed": seed, "steps": steps, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0
    }  # fmt: skip
    links = {"parallel_flux": ["4", 0], "positive": ["2", 0], "latent_image": ["3", 0]}
    prompt = {
        "1": {"class_type": "RPTestReferenceConditioning", "inputs": {"case": "dev_4steps"}},
        "2": {"class_type": "FluxGuidance", "inputs": {"conditioning": ["1", 0], "guidance": 3.5}},
        "3": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "4": loader_node(),
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
    for name, ids in (("tp", ("5", "6")), ("ring", ("7", "8"))):
        if name not in samplers:
            for node_id in ids:
                del prompt[node_id]
    return prompt


def model_prompt(case: str, seed_offset: int = 0) -> dict[str, Any]:
    """Reference `case` (zeros latent) with ComfyUI's own KSampler on the ROCm Parallel Model (node '6'),
    saved with SaveLatent under 'model/<case>'."""
    c = ALL_CASES[case]
    guidance = c.get("guidance", 3.5)
    prompt: dict[str, Any] = {
        "1": {"class_type": "RPTestReferenceConditioning", "inputs": {"case": case}},
        "2": {"class_type": "FluxGuidance", "inputs": {"conditioning": ["1", 0], "guidance": guidance}},
        "3": {"class_type": "EmptySD3LatentImage", "inputs": {"width": c["width"], "height": c["height"], "batch_size": 1}},
        "4": {**loader_node(), "inputs": {**loader_node()["inputs"], "preload": "none"}},
        "5": {"class_type": "RocmParallelModel", "inputs": {"parallel_flux": ["4", 0], "layout": "tp", "ring_degree": 0, "ulysses_degree": 0}},
        "6": {
            "class_type": "KSampler",
            "inputs": {
                "model": ["5", 0], "positive": ["2", 0], "negative": ["2", 0], "latent_image": ["3", 0],
                "seed": c["seed"] + seed_offset, "steps": c["steps"], "cfg": c.get("cfg", 1.0),
                "sampler_name": c.get("sampler", "euler"), "scheduler": c.get("scheduler", "simple"), "denoise": 1.0,
            },
        },
        "7": {"class_type": "SaveLatent", "inputs": {"samples": ["6", 0], "filename_prefix": f"model/{case}"}},
    }  # fmt: skip
    if c.get("negative"):
        prompt["8"] = {"class_type": "RPTestReferenceConditioning", "inputs": {"case": f"{case}:neg"}}
        prompt["9"] = {
            "class_type": "FluxGuidance",
            "inputs": {"conditioning": ["8", 0], "guidance": guidance},
        }
        prompt["6"]["inputs"]["negative"] = ["9", 0]
    return prompt


def flux2_prompt(
    case: str, layout: str = "tp", seed_offset: int = 0, devices: str = "cpu x2"
) -> dict[str, Any]:
    """ComfyUI's FLUX.2 template graph for reference `case` on the ROCm Parallel Model (`layout` on `devices`),
    the text features from the reference file, saved with SaveLatent under 'flux2/<case>_<layout>' (the
    layout without spaces)."""
    c = FLUX2_CASES[case]
    size = {"width": c["width"], "height": c["height"]}
    loader = loader_node(FLUX2_CHECKPOINT, devices)
    loader["inputs"]["preload"] = "none"
    prompt: dict[str, Any] = {
        "1": {"class_type": "RPTestReferenceConditioning", "inputs": {"case": case}},
        "2": {"class_type": "FluxGuidance", "inputs": {"conditioning": ["1", 0], "guidance": c["guidance"]}},
        "3": loader,
        "4": {"class_type": "RocmParallelModel",
              "inputs": {"parallel_flux": ["3", 0], "layout": layout, "ring_degree": 0, "ulysses_degree": 0}},
        "5": {"class_type": "BasicGuider", "inputs": {"model": ["4", 0], "conditioning": ["2", 0]}},
        "6": {"class_type": "RandomNoise", "inputs": {"noise_seed": c["seed"] + seed_offset}},
        "7": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}},
        "8": {"class_type": "Flux2Scheduler", "inputs": {"steps": c["steps"], **size}},
        "9": {"class_type": "EmptyFlux2LatentImage", "inputs": {**size, "batch_size": 1}},
        "10": {"class_type": "SamplerCustomAdvanced",
               "inputs": {"noise": ["6", 0], "guider": ["5", 0], "sampler": ["7", 0], "sigmas": ["8", 0],
                          "latent_image": ["9", 0]}},
        "11": {"class_type": "SaveLatent",
               "inputs": {"samples": ["10", 0], "filename_prefix": f"flux2/{case}_{layout.replace(' ', '')}"}},
    }  # fmt: skip
    return prompt


def loader_node(checkpoint: str = "tiny-flux-dev.safetensors", devices: str = "cpu x2") -> dict[str, Any]:
    inputs = {
        "checkpoint": checkpoint, "devices": devices, "dtype": "float32", "preload": "tp", "weight_dtype": "default"
    }  # fmt: skip
    return {"class_type": "RocmParallelLoader", "inputs": inputs}


def status_prompt(action: str = "report", loader: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Status node alone, or run after a loader (node '1'); the Status node is '2'."""
    status = {"class_type": "RocmParallelStatus", "inputs": {"action": action}}
    if loader is None:
        return {"2": status}
    status["inputs"]["parallel_flux"] = ["1", 0]
    return {"1": loader, "2": status}


REJECTED = "not-a-flux.safetensors"


@contextmanager
def rejected_checkpoint(comfy: Comfy) -> Iterator[str]:
    """A safetensors file in models/diffusion_models that is no FLUX checkpoint (removed afterwards)."""
    path = comfy.base / "models" / "diffusion_models" / REJECTED
    save_file({"weight": torch.ones(4, 4)}, str(path))
    try:
        yield REJECTED
    finally:
        path.unlink()


_ABSOLUTE = re.compile(r"(?<![\w.])/(?:[\w.+-]+/)+")


def absolute_paths(text: str | None) -> list[str]:
    """Absolute folder paths in a message (the status route must never show one)."""
    return _ABSOLUTE.findall(text or "")
