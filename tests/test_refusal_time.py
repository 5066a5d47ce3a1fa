"""The refusal-time test (issue 42): a new user's mistakes are answered before anything expensive runs.

The mistakes: a layout that does not divide the device count, an NF4 / bitsandbytes file, an SDXL LoRA or a
model checkpoint given as a LoRA, and ROCm's `rocm:N` / `hip:N` device names. Each is made through the public
API (`ParallelModel`) in a fresh Python, as a script or ComfyUI makes it once torch and the pack are
imported, and each must be refused:

* with its message, exactly;
* before the expensive steps: no worker process starts, diffusers is never imported (its import was most of
  the 12-31 s the layout refusal took when the checkpoint was inspected first), and a file the answer does
  not need is never read: the base checkpoint handed over with the wrong layout or the foreign LoRA is
  garbage, which reading would refuse with another message;
* within a wall-clock bound. The bound is loose on purpose (BOUND_S): the issue asks for < 1 s where the
  answer needs no file and < 3 s otherwise, but this suite runs on shared 2-core machines at load 5-10,
  where a process can wait seconds for a core, so a tight bound would fail for the machine's sake. The
  deterministic checks above are what keep the refusals fast; the bound only catches a regression that
  brings back a heavy import or a worker start (each of which took 10 s or more on this class of machine).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from rocm_parallel.backend.checkpoint.foreign import INSTEAD
from rocm_parallel.backend.checkpoint.lora.names import LOOKED_FOR

BOUND_S = 5.0  # per refusal, after the imports; see the module docstring for why it is not 1 s

# One fresh process makes every mistake in turn; after each, what it imported and started is recorded (a
# load also asserts that its ParallelModel never started a worker group).
SCRIPT = r"""
import json, sys, time
import psutil
from rocm_parallel.backend.diffusion.api import ParallelModel
from rocm_parallel.backend.config import ConfigError

garbage, nf4, sdxl, model_as_lora = sys.argv[1:5]


def attempt(name, make):
    start = time.perf_counter()
    try:
        make()
        message = None
    except ConfigError as exc:
        message = str(exc)
    seconds = time.perf_counter() - start
    print(json.dumps({
        "mistake": name,
        "message": message,
        "seconds": seconds,
        "diffusers": any(m == "diffusers" or m.startswith("diffusers.") for m in sys.modules),
        "children": len(psutil.Process().children(recursive=True)),
    }), flush=True)


def load(devices, checkpoint, **options):
    def make():
        model = ParallelModel(devices)
        try:
            model.load(checkpoint, **options)
        finally:
            assert model._group is None, "a worker group was started"
    return make


attempt("rocm", lambda: ParallelModel("rocm:0,rocm:1"))
attempt("hip", lambda: ParallelModel(["hip:0"]))
attempt("layout", load("cpu x2", garbage, layout="tp 4"))
attempt("nf4", load("cpu x2", nf4, layout="tp"))
attempt("sdxl_lora", load("cpu x2", garbage, layout="tp", loras=[(sdxl, 1.0)]))
attempt("model_as_lora", load("cpu x2", garbage, layout="tp", loras=[(model_as_lora, 1.0)]))
"""

NO_FLUX_KEYS = "has no FLUX LoRA keys (looked for " + LOOKED_FOR + "); "


def _files(tmp_path: Path) -> tuple[Path, Path, Path, Path]:
    garbage = tmp_path / "flux1-dev.safetensors"
    garbage.write_bytes(b"not a safetensors file: reading it is refused with another message")
    weight = "double_blocks.0.img_attn.qkv.weight"
    nf4 = tmp_path / "flux1-dev-bnb-nf4.safetensors"
    save_file(
        {
            weight: torch.zeros(12, 4),
            f"{weight}.absmax": torch.ones(4),
            f"{weight}.quant_state.bitsandbytes__nf4": torch.zeros(8),
        },
        str(nf4),
    )
    sdxl = tmp_path / "sdxl_style.safetensors"
    save_file(
        {
            "lora_unet_input_blocks_4_1_proj_in.lora_down.weight": torch.zeros(4, 8),
            "lora_te2_text_model_x.lora_up.weight": torch.zeros(4, 8),
        },
        str(sdxl),
    )
    model_as_lora = tmp_path / "flux1-schnell.safetensors"
    save_file({weight: torch.zeros(4, 8)}, str(model_as_lora))
    return garbage, nf4, sdxl, model_as_lora


def test_each_mistake_is_refused_before_anything_expensive(tmp_path: Path) -> None:
    garbage, nf4, sdxl, model_as_lora = _files(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(garbage), str(nf4), str(sdxl), str(model_as_lora)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = {r["mistake"]: r for r in map(json.loads, done.stdout.splitlines())}
    rocm_fix = "ROCm (HIP) GPUs are 'cuda:N' in torch as NVIDIA ones are: use 'cuda:0' or the index 0"
    assert {name: r["message"] for name, r in results.items()} == {
        "rocm": f"devices='rocm:0,rocm:1': 'rocm:0' is not a torch device name; {rocm_fix}",
        "hip": f"devices=['hip:0']: 'hip:0' is not a torch device name; {rocm_fix}",
        "layout": (
            "the layout tp 4 needs 4 devices (batch x tp x ring x ulysses) but 2 were given; make the product 2 "
            "(e.g. tp 2)"
        ),
        "nf4": (
            f"'{nf4}' is a bitsandbytes NF4 (4-bit) file (tensor 'double_blocks.0.img_attn.qkv.weight."
            f"quant_state.bitsandbytes__nf4'); this loader does not read that quantization. {INSTEAD}"
        ),
        "sdxl_lora": (
            f"'{sdxl}' {NO_FLUX_KEYS}it is an SDXL LoRA (its keys name SDXL's UNet blocks or its second text "
            "encoder) (first keys: lora_te2_text_model_x.lora_up.weight, "
            "lora_unet_input_blocks_4_1_proj_in.lora_down.weight)"
        ),
        "model_as_lora": (
            f"'{model_as_lora}' {NO_FLUX_KEYS}it is a model checkpoint (plain weights, no LoRA tensors), not a "
            "LoRA (first keys: double_blocks.0.img_attn.qkv.weight)"
        ),
    }
    for name, result in results.items():
        # before the expensive steps: no diffusers, no worker process, no group
        assert (result["diffusers"], result["children"]) == (False, 0), name
        assert result["seconds"] < BOUND_S, (name, result["seconds"])
