"""The engine a load runs on, checked in the caller before any worker starts (torch-free).

`engine='diffusers'` (the default) is each family's diffusers re-implementation (backend/<family>/);
`engine='comfy'` is ComfyUI's own model class sharded by a plan (this package). The comfy engine needs a
ComfyUI: the one the pack runs in (the nodes pass it), `comfyui=` of the Python API, or COMFYUI_PATH.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import ConfigError
from ..runtime.redact import quoted

if TYPE_CHECKING:
    from ..checkpoint.info import CheckpointInfo

ENGINES = ("diffusers", "comfy")
COMFYUI_ENV = "COMFYUI_PATH"


def check_engine(engine: str) -> str:
    if engine not in ENGINES:
        raise ConfigError(f"engine={engine!r} is not an engine; use {' or '.join(map(repr, ENGINES))}")
    return engine


def running_comfyui() -> str | None:
    """The root of the ComfyUI this process runs in (its `comfy` package imported), if any."""
    module = sys.modules.get("comfy.model_detection")
    return str(Path(module.__file__).resolve().parents[1]) if module is not None and module.__file__ else None


def resolve_comfyui(given: str | os.PathLike[str] | None) -> str:
    """The ComfyUI checkout the comfy engine imports on the workers: `given`, else COMFYUI_PATH, else the
    ComfyUI this process runs in; ConfigError naming the three when there is none or it is no checkout."""
    path = given or os.environ.get(COMFYUI_ENV) or running_comfyui()
    if not path:
        raise ConfigError(
            f"engine='comfy' builds ComfyUI's own model on the workers and needs a ComfyUI: pass comfyui=<the "
            f"ComfyUI folder>, set {COMFYUI_ENV}, or run inside ComfyUI"
        )
    root = Path(path).expanduser().resolve()
    if not (root / "comfy" / "model_detection.py").is_file():
        raise ConfigError(
            f"comfyui={str(path)!r} is not a ComfyUI checkout (no comfy/model_detection.py in it); give the "
            "folder that holds ComfyUI's main.py and comfy/"
        )
    return str(root)


def detection_text(detection: Mapping[str, Any] | str | None) -> str:
    """Detection overrides as the request carries them: canonical JSON of an object ('' for none)."""
    if detection is None or detection == "" or detection == {}:
        return ""
    value = json.loads(detection) if isinstance(detection, str) else dict(detection)
    if not isinstance(value, dict):
        raise ConfigError(f"detection={detection!r} must be a mapping of ComfyUI unet_config keys to values")
    return json.dumps(value, sort_keys=True)


def check_engine_file(info: CheckpointInfo) -> None:
    """What the comfy engine reads so far: one safetensors file in ComfyUI's (BFL) layout, weights plain or
    fp8 (no per-tensor scales, no GGUF). Anything else is refused by name before a worker starts."""
    reason = None
    if info.format != "bfl" or len(info.files) != 1:
        reason = "a diffusers folder (its tensors are converted at load)"
    elif Path(info.files[0]).suffix.lower() == ".gguf" or info.files[0].lower().endswith(".gguf"):
        reason = "a GGUF file"
    elif info.scales or info.quantization:
        reason = f"a ComfyUI quantized file ({info.quantization or 'scaled fp8'})"
    if reason is not None:
        raise ConfigError(
            f"{quoted(info.path)} is {reason}, which engine='comfy' does not read yet; load it with "
            "engine='diffusers' (the default)"
        )


__all__ = ["COMFYUI_ENV", "ENGINES", "check_engine", "check_engine_file", "detection_text", "resolve_comfyui"]
