"""ComfyUI's `comfy` package in a worker process: found, imported once, safely.

The pack runs inside ComfyUI, whose root is on ComfyUI's `sys.path` but not on a worker's (workers are
fresh interpreters): a load names the root (`LoadRequest.comfyui`: the nodes pass the ComfyUI they run in,
the Python API takes `comfyui=` or COMFYUI_PATH) and the worker puts it on its path before the first import.
Only the engine's model code calls this; the runtime (launch, worker, transport) never imports ComfyUI.

What importing `comfy.model_management` does, and why it is safe here (checked in ComfyUI 0.3.75 and 0.33.0):
it reads its command-line options from `comfy.cli_args.args` (argument parsing is off unless
`comfy.options.enable_args_parsing()` ran, so ComfyUI's defaults apply: nothing of the worker's argv is
read), then picks its device: with `args.cpu` the CPU, otherwise `torch.cuda.current_device()` — the worker
has set its own GPU before any job runs (worker.py `_join_group`), so each worker's ComfyUI works on its own
GPU and none touches GPU 0. A CPU worker has no CUDA: ComfyUI would fail at import asking for `--cpu`
(`torch.cuda.current_device()` on a CPU-only torch), so `args.cpu` is set first, as `main.py --cpu` does.
On a machine with GPUs a CPU worker gets it too: its ComfyUI must not compute on cuda:0.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

from ..config import ConfigError
from .options import resolve_comfyui

# The modules the engine uses; the first import of `comfy.model_management` settles ComfyUI's device.
MODULES = (
    "comfy.model_management",
    "comfy.model_detection",
    "comfy.supported_models",
    "comfy.ops",
    "comfy.utils",
)
_lock = threading.Lock()


def imported_root() -> Path | None:
    """The root of the `comfy` package this process has imported already, if any."""
    module = sys.modules.get("comfy.model_detection")
    return Path(module.__file__).resolve().parents[1] if module is not None and module.__file__ else None


def import_comfy(root: str | os.PathLike[str], device: torch.device) -> ModuleType:
    """ComfyUI's `comfy` package from the checkout at `root`, imported for a worker on `device` (see the
    module docstring); a second call returns the same package. A process holds one ComfyUI: another root
    than the one imported is refused by name."""
    wanted = Path(resolve_comfyui(root))
    with _lock:
        held = imported_root()
        if held is not None:
            if held != wanted:
                raise ConfigError(
                    f"this worker imported ComfyUI from {held} already; it cannot load a model with the one at "
                    f"{wanted}: restart the worker group (close the ParallelModel) to change ComfyUI"
                )
            return sys.modules["comfy"]
        if str(wanted) not in sys.path:
            sys.path.insert(0, str(wanted))
        import comfy.cli_args

        if device.type != "cuda":
            comfy.cli_args.args.cpu = True
        for name in MODULES:
            importlib.import_module(name)
        return sys.modules["comfy"]


def comfy_version(root: str | os.PathLike[str]) -> str:
    """The version of the ComfyUI at `root` (its comfyui_version.py), 'unknown' when it says none."""
    text = Path(resolve_comfyui(root)) / "comfyui_version.py"
    if not text.is_file():
        return "unknown"
    return text.read_text().split("__version__ =")[-1].strip().strip("\"'") or "unknown"


__all__ = ["comfy_version", "import_comfy", "imported_root"]
