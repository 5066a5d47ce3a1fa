"""ComfyUI's own diffusion model for a checkpoint, built on the meta device the way ComfyUI's loader builds it.

`build_meta` follows `comfy.sd.load_diffusion_model_state_dict` (the UNETLoader's loader) with the file's
header standing in for its weights: a state dict of meta tensors (keys, shapes and dtypes from the header)
goes through ComfyUI's own prefix detection (`unet_prefix_from_state_dict`), its model detection
(`model_detection.model_config_from_unet`, with the header's metadata: Wan reads its config there), its
`model_config` (`set_inference_dtype`, `get_model`, hence `comfy.ops.pick_operations`, the ops class ComfyUI
would pick for the dtypes) and its key renames (`model_config.process_unet_state_dict`: 0.33's FLUX reads
BFL's `*_norm.scale` as `*_norm.weight`). Every parameter of the built model is traced back to the stored
tensor it is loaded from by identity of the meta tensors through those functions, so no key rule of
ComfyUI's is repeated here. Nothing of ComfyUI is copied; nothing is allocated but the meta tensors.

`detection` overrides values of ComfyUI's detection output (`detect_unet_config`) for files it cannot
describe itself: ComfyUI hard-codes the released models' head counts and RoPE axes (FLUX: 24 heads, axes
(16, 56, 56)), so the tests' small models, built and saved by ComfyUI's own classes, tell it theirs, as
the comfy tier tells ComfyUI's own loader (tests/comfy/comfy_server.py RPTestTinyUNETLoader).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..checkpoint.files import CheckpointError, StoredTensor, read_safetensors_header
from ..dtypes import stored_dtype
from ..runtime.redact import quoted

_detection_lock = threading.Lock()


@dataclass(frozen=True, eq=False)
class MetaModel:
    """ComfyUI's model for a file, on the meta device, and where each of its parameters is stored.

    `base` is ComfyUI's `model_base` model (BaseModel) around `model`, its `diffusion_model`; `unet_config`
    the detected config (what plans match on); `sources`: parameter name -> the stored tensor it is loaded
    from; `lora_keys`: ComfyUI's LoRA key map of the whole model (`lora.model_lora_keys_unet`, taken before
    any split, so every rank reads the same)."""

    model: nn.Module
    base: Any
    model_config: Any
    unet_config: dict[str, Any]
    sources: dict[str, StoredTensor]
    metadata: dict[str, str]
    lora_keys: dict[str, Any]

    @property
    def class_name(self) -> str:
        """The diffusion model's qualified class name ('comfy.ldm.flux.model.Flux'), what plans name."""
        kind = type(self.model)
        return f"{kind.__module__}.{kind.__qualname__}"


def header_state_dict(stored: Mapping[str, StoredTensor]) -> dict[str, torch.Tensor]:
    """The header as a state dict of meta tensors (the shapes and dtypes ComfyUI's detection reads)."""
    out = {}
    for key, tensor in stored.items():
        dtype = stored_dtype(tensor.dtype)
        if dtype is None:
            raise CheckpointError(
                f"{quoted(tensor.file)}: tensor '{key}' is stored as {tensor.dtype}, a type the pack cannot read"
            )
        out[key] = torch.empty(tensor.shape, dtype=dtype.torch, device="meta")
    return out


@contextlib.contextmanager
def detection_overrides(detection: Mapping[str, Any]) -> Iterator[None]:
    """ComfyUI's `detect_unet_config` with `detection`'s values over its own, for the duration (module-level:
    `model_config_from_unet` looks the function up by name). One build at a time in a process."""
    import comfy.model_detection as md

    if not detection:
        yield
        return
    with _detection_lock:
        original = md.detect_unet_config

        def detect(state_dict: Any, key_prefix: str, metadata: Any = None) -> Any:
            config = original(state_dict, key_prefix, metadata=metadata)
            return None if config is None else {**config, **detection}

        md.detect_unet_config = detect
        try:
            yield
        finally:
            md.detect_unet_config = original


def build_meta(
    file: str,
    storage: torch.dtype,
    compute: torch.dtype,
    detection: Mapping[str, Any] | None = None,
) -> MetaModel:
    """ComfyUI's diffusion model for the safetensors `file` on the meta device (see the module docstring).

    `storage` is the dtype of its linear weights, `compute` the dtype it computes in: ComfyUI's model config
    is set to them as its loader sets `unet_dtype` and `manual_cast_dtype`, so the ops class is the one
    ComfyUI picks (`manual_cast` when they differ: fp8 weights upcast per layer)."""
    import comfy.lora
    import comfy.model_detection as md
    import comfy.utils

    stored, metadata = read_safetensors_header(file)  # type: ignore[arg-type]
    header = header_state_dict(stored)
    origin = {id(t): stored[k] for k, t in header.items()}
    prefix = md.unet_prefix_from_state_dict(header)
    sd = comfy.utils.state_dict_prefix_replace(dict(header), {prefix: ""}, filter_keys=True) or dict(header)
    with detection_overrides(detection or {}):
        model_config = md.model_config_from_unet(sd, "", metadata=metadata)
    if model_config is None:
        raise CheckpointError(
            f"{quoted(file)}: ComfyUI's model detection does not recognise this file as a diffusion model"
        )
    model_config.set_inference_dtype(storage, None if storage == compute else compute)
    base = model_config.get_model(sd, "", device=torch.device("meta"))
    model = base.diffusion_model
    named = model_config.process_unet_state_dict(dict(sd))
    sources = _sources(model, named, origin, file)
    lora_keys = comfy.lora.model_lora_keys_unet(base, {})
    return MetaModel(model, base, model_config, dict(model_config.unet_config), sources, metadata, lora_keys)


def _sources(
    model: nn.Module, named: Mapping[str, torch.Tensor], origin: Mapping[int, StoredTensor], file: str
) -> dict[str, StoredTensor]:
    """Parameter name -> the stored tensor ComfyUI's loader would fill it from."""
    out = {}
    for name, param in model.named_parameters():
        tensor = named.get(name)
        if tensor is None:
            raise CheckpointError(
                f"{quoted(file)} has no tensor for '{name}' of ComfyUI's {type(model).__name__}"
            )
        source = origin.get(id(tensor))
        if source is None:  # ComfyUI computed it (a concatenation, a split) instead of renaming a stored one
            raise CheckpointError(
                f"{quoted(file)}: ComfyUI's loader converts the stored tensors into '{name}'; the engine reads "
                "stored tensors only (convert the file with ComfyUI's ModelSave, or use engine='diffusers')"
            )
        if tuple(source.shape) != tuple(param.shape):
            raise CheckpointError(
                f"{quoted(file)}: '{source.key}' is {list(source.shape)} but ComfyUI's model holds "
                f"{list(param.shape)} for '{name}'"
            )
        out[name] = source
    return out


__all__ = ["MetaModel", "build_meta", "detection_overrides", "header_state_dict"]
