"""Write a ComfyUI version's core node specs the shipped workflows use, as that REAL ComfyUI's /object_info
reports them, to tests/data/comfy_core_nodes.json (0.3.75) or comfy_core_nodes-<version>.json (any other;
workflow_check.core_nodes_file). The CI tier checks the workflows against every version's file; the comfy
tier checks its version's file against the live /object_info again. Run it with each ComfyUI version.

    COMFYUI_PATH=/path/to/ComfyUI PYTHONPATH=<pack parent>:<comfy deps> python tests/tools/dump_core_nodes.py

It starts ComfyUI the way the comfy tier does (tests/comfy/comfy_server.py: loopback, a temporary base
directory) and keeps `input` and `output` of each node in its file; the lists of the user's model files
(workflow_check.MODEL_FILE_INPUTS) are emptied, since they depend on the installation.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS), str(TESTS / "comfy")]

from comfy_server import COMFYUI_PATH, running_comfy  # noqa: E402
from workflow_check import MODEL_FILE_INPUTS, core_nodes_file  # noqa: E402

# Every core node a shipped workflow (workflows/, workflows/api/) or a comfy-tier prompt uses.
NODES = [
    "KSampler", "DualCLIPLoader", "CLIPLoader", "CLIPTextEncode", "FluxGuidance", "EmptySD3LatentImage",
    "EmptyFlux2LatentImage", "Flux2Scheduler", "BasicGuider", "KSamplerSelect", "RandomNoise",
    "SamplerCustomAdvanced", "VAELoader", "VAEDecode", "SaveImage", "SaveLatent", "VAEEncode", "LoadImage",
    "FluxKontextImageScale", "ReferenceLatent", "ModelSamplingAuraFlow",
    # Wan (workflows/wan*, tests/comfy/test_comfy_wan.py)
    "EmptyHunyuanLatentVideo", "WanImageToVideo", "Wan22ImageToVideoLatent", "ModelSamplingSD3", "KSamplerAdvanced",
    "SaveAnimatedWEBP", "UNETLoader", "LoraLoaderModelOnly",
]  # fmt: skip


def core_specs(info: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in NODES:
        spec = {"input": json.loads(json.dumps(info[name]["input"])), "output": info[name]["output"]}
        for section in spec["input"].values():
            for input_name, value in section.items():
                if (name, input_name) in MODEL_FILE_INPUTS and isinstance(value[0], list):
                    value[0] = []
                elif (name, input_name) in MODEL_FILE_INPUTS and value[0] == "COMBO":
                    value[1]["options"] = []
        out[name] = spec
    return out


def main() -> None:
    if not COMFYUI_PATH:
        sys.exit("set COMFYUI_PATH to a ComfyUI checkout")
    version = (Path(COMFYUI_PATH) / "comfyui_version.py").read_text().split("=")[-1].strip().strip("\"'")
    commit = subprocess.run(
        ["git", "-C", COMFYUI_PATH, "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory() as base, running_comfy(Path(base)) as comfy:
        info = comfy.get("/object_info")
    data = {
        "_source": f"ComfyUI {version}, commit {commit or 'unknown'}: its live /object_info, written by "
        "tests/tools/dump_core_nodes.py; the lists of model files are empty here (they depend on the "
        "installation).",
        **core_specs(info),
    }
    out = core_nodes_file(version)
    out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {out} from ComfyUI {version} ({len(NODES)} nodes)")


if __name__ == "__main__":
    main()
