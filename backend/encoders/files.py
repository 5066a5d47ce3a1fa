"""A text encoder file as the caller reads it, header only: which kind, its config, where each parameter is.

Everything here runs in the caller's process before any worker starts, so every file a user can pick wrongly
is refused with a message naming the file, what it is and what to pick instead: a diffusion model or a LoRA
in models/text_encoders/, FLUX.1's CLIP-L where T5-XXL belongs, an encoder of another model family for the
loader's `type`, a file missing tensors the encoder needs.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..checkpoint.files import COMFY_PREFIX, CheckpointError, StoredTensor, missing_checkpoint
from ..checkpoint.headers import read_header
from ..checkpoint.quant import split_scales
from ..runtime.transport import record
from .kind import EncoderKind, detect_encoder, encoder_kinds, get_encoder_kind, kinds_for_clip_type


@record
@dataclass(frozen=True)
class EncoderInfo:
    """A text encoder file's header as the pack reads it: its kind (`kind.py`), ComfyUI's config for it and
    each parameter's stored tensor (by the workers' parameter names: the file's keys without the kind's
    prefix). Carried to the workers, which do not read the header again."""

    path: str
    kind: str
    config: dict[str, Any] = field(hash=False)
    tensors: dict[str, StoredTensor] = field(hash=False, repr=False)
    # ComfyUI's scaled fp8 (`scale_weight`) or quantized (`weight_scale` + `comfy_quant`) linear weights: the
    # per-tensor scale of each, by parameter name (checkpoint/quant.py reads both forms); how they were declared
    scales: dict[str, StoredTensor] = field(default_factory=dict, hash=False, repr=False)
    quantization: str = ""

    @property
    def encoder(self) -> EncoderKind:
        return get_encoder_kind(self.kind)

    @property
    def name(self) -> str:
        return os.path.basename(self.path)


def _what_else(keys: Collection[str]) -> str | None:
    """What a header that is no text encoder of the pack's holds, for the message; None when unknown."""
    for kind in encoder_kinds():
        for companion, matches in kind.companions.items():
            if matches(keys):
                return (
                    f"{companion}, which stays in ComfyUI's process: give it as the second file beside "
                    f"{kind.title}"
                )
    if any(k.startswith(("lora_", "lora_unet_", "lora_te")) or ".lora_" in k or ".lora." in k for k in keys):
        return "a LoRA (put it in models/loras and use a LoRA loader)"
    from ..family import detect_bfl, detect_diffusers

    bare = {k.removeprefix(COMFY_PREFIX) for k in keys}
    try:
        family = detect_bfl(bare) or detect_diffusers(bare)
    except Exception:  # two families claim it: still a diffusion model
        family = None
    if family is not None:
        return f"a {family.title} diffusion model (load it with the ROCm Parallel Loader from models/diffusion_models)"
    if any(k.startswith(("decoder.", "encoder.down.", "first_stage_model.")) for k in keys):
        return "a VAE (load it with ComfyUI's VAELoader)"
    return None


def _names(kinds: list[EncoderKind]) -> str:
    return ", ".join(f"{k.title}" for k in kinds)


def inspect_encoder(path: str | os.PathLike[str]) -> EncoderInfo:
    """The text encoder in `path` (a safetensors file as ComfyUI's CLIPLoader reads it); CheckpointError
    naming the file, what it holds and what to use when it is none the pack runs."""
    file = Path(path)
    if not file.is_file():
        raise missing_checkpoint(file)
    header, metadata = read_header(file)
    kind = detect_encoder(set(header))
    if kind is None:
        what = _what_else(set(header))
        runs = _names(encoder_kinds())
        raise CheckpointError(
            f"text encoder '{file}' is {what or 'no text encoder the pack knows'}; the ROCm Parallel Text "
            f"Encoder Loader runs {runs} from models/text_encoders"
        )
    # the scale tensors and markers leave the header here: the rest is the model's parameters
    header, scales, quantization = split_scales(str(file), header, metadata, fix=_FIX)
    keys = set(header)
    tensors = {}
    for key, stored in header.items():
        if key.startswith(kind.prefix):
            tensors[key.removeprefix(kind.prefix)] = stored
    config = kind.config_from_shapes({k: v.shape for k, v in header.items()})
    _check_complete(file, kind, config, tensors, keys)
    by_name = {k.removeprefix(kind.prefix): s for k, s in scales.items()}
    _check_scaled(file, kind, config, by_name)
    return EncoderInfo(str(file), kind.name, config, tensors, by_name, quantization)


# What a refused scaled or quantized encoder file can be replaced with
_FIX = (
    "Use ComfyUI's fp8_scaled, fp8 or bf16 file of this encoder (e.g. qwen_2.5_vl_7b_fp8_scaled.safetensors, "
    "t5xxl_fp8_e4m3fn_scaled.safetensors), or load this one with ComfyUI's own CLIPLoader"
)


def _check_scaled(
    file: Path, kind: EncoderKind, config: Mapping[str, Any], scales: Mapping[str, StoredTensor]
) -> None:
    """Scales sit on linear weights only: the workers apply them where a linear layer reads its weight
    (parallel/weights.py linear_weight); ComfyUI quantizes nothing else of a text encoder either."""
    from torch import nn

    model = kind.build(config, device="meta")
    for name in sorted(scales):
        module_name, _, param = name.rpartition(".")
        if param != "weight" or not isinstance(model.get_submodule(module_name), nn.Linear):
            raise CheckpointError(
                f"text encoder '{file}': '{scales[name].key}' scales '{kind.prefix}{name}', which is not a linear "
                f"layer's weight; ComfyUI's scaled fp8 {kind.title} files scale linear weights only. {_FIX}"
            )


def _check_complete(
    file: Path, kind: EncoderKind, config: Mapping[str, Any], tensors: dict[str, StoredTensor], keys: set[str]
) -> None:
    """Every parameter of the kind's model for this config is in the file, in its shape; nothing else is
    (apart from what ComfyUI reads itself)."""
    model = kind.build(config, device="meta")
    wanted = dict(model.named_parameters())
    missing = [n for n in wanted if n not in tensors]
    if missing:
        raise CheckpointError(
            f"text encoder '{file}' looks like {kind.title} but lacks {len(missing)} of its tensors, e.g. "
            f"'{kind.prefix}{missing[0]}': the file is incomplete or another model's; download it again"
        )
    for name, param in wanted.items():
        if tuple(param.shape) != tensors[name].shape:
            raise CheckpointError(
                f"text encoder '{file}': tensor '{kind.prefix}{name}' is {list(tensors[name].shape)} but "
                f"{kind.title} with this file's other shapes needs {list(param.shape)}; the file is damaged "
                "or another model's"
            )
    unknown = sorted(k for k in keys if k.removeprefix(kind.prefix) not in wanted and not kind.extra_keys(k))
    if unknown:
        raise CheckpointError(
            f"text encoder '{file}' is {kind.title} with {len(unknown)} tensors the pack does not know, e.g. "
            f"'{unknown[0]}' (a quantized layout or another variant); load it with ComfyUI's own CLIPLoader"
        )


def check_clip_type(info: EncoderInfo, clip_type: str) -> None:
    """Refuse an encoder the loader's `type` does not take, naming what it is for and what the type takes."""
    kind = info.encoder
    if clip_type in kind.clip_types:
        return
    takes = kinds_for_clip_type(clip_type)
    serves = "; ".join(kind.clip_types.values())
    if not takes:
        raise CheckpointError(
            f"type '{clip_type}' is not one the ROCm Parallel Text Encoder Loader runs; '{info.name}' is "
            f"{kind.title}, for {serves}"
        )
    wanted = "; ".join(
        f"{k.title}: {'; '.join(v for t, v in k.clip_types.items() if t == clip_type)}" for k in takes
    )
    raise CheckpointError(
        f"'{info.name}' is {kind.title}, the text encoder of {serves}; type '{clip_type}' takes {wanted}. "
        "Pick that file, or the type that matches this one"
    )


__all__ = ["EncoderInfo", "check_clip_type", "inspect_encoder"]
