"""`inspect_lora`: what a LoRA file patches in one checkpoint, from its header (and scalar alphas) alone.

Runs in the caller before any worker starts (check_loras) and on each worker before it applies the file.
Every refusal names the file, the key, what was found and what this checkpoint needs.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from ...family import families
from ...runtime.redact import quoted
from ..files import listing, special_kind, starts_like_safetensors, truncation_detail
from ..info import CheckpointInfo
from .kinds import APPLIED, CONV_ONLY, KINDS, REFUSED, WEIGHT_KINDS
from .names import LOOKED_FOR, TEXT_ENCODER_PREFIXES, Slot, slot_table, split_key
from .other import other_model, plainly_foreign
from .records import LoraError, LoraInfo, LoraModule, Parsed


def _check_file(path: Path) -> None:
    if not path.exists():
        parent = path.parent
        where = (
            f"{quoted(parent)} has: {listing(parent)}. Pick one of those, or put the LoRA into that folder"
            if parent.is_dir()
            else "nor does its folder; check the path"
        )
        raise LoraError(f"LoRA {quoted(path)} does not exist; {where}")
    if path.is_dir():
        raise LoraError(f"LoRA {quoted(path)} is a folder; pass the LoRA's .safetensors file")
    kind = special_kind(path)
    if kind is not None:
        raise LoraError(
            f"LoRA {quoted(path)} is {kind}, not a file of weights; pass the LoRA's .safetensors file"
        )
    with open(path, "rb") as f:
        head = f.read(9)
    if not starts_like_safetensors(head, path.stat().st_size):
        raise LoraError(
            f"LoRA {quoted(path)} is not a safetensors file ({truncation_detail(path)}); LoRAs are read from "
            ".safetensors files only. Download it again, or convert it with safetensors.torch.save_file"
        )


def read_header(path: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, Any]]:
    """(key -> shape, alpha key -> tensor) of a LoRA file; LoraError when it is unreadable."""
    try:
        with safe_open(str(path), "pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            alphas = {k: f.get_tensor(k) for k in shapes if k.endswith(".alpha")}
    except SafetensorError as err:
        raise LoraError(
            f"LoRA {quoted(path)} is truncated or corrupt: {truncation_detail(path)}. Download or copy it again"
        ) from err
    return shapes, alphas


def inspect_lora(path: str | os.PathLike[str], info: CheckpointInfo) -> LoraInfo:
    """Which parameters of checkpoint `info` the LoRA at `path` patches, from its header and alphas only.

    Raises LoraError (a ConfigError) naming the file, the key, the shape found and the one expected.
    """
    path = Path(path).expanduser()
    _check_file(path)
    shapes, alphas = read_header(path)
    for family in families():  # a kind of LoRA a family knows by its keys and the pack cannot apply
        for markers, (what, remedy) in family.lora_refusals.items():
            if all(k in shapes for k in markers):
                raise LoraError(
                    f"LoRA {quoted(path)} is {what}; ROCm Parallel applies {APPLIED} only. {remedy}"
                )
    skipped = tuple(sorted(k for k in shapes if k.startswith(TEXT_ENCODER_PREFIXES)))
    table = slot_table(info)
    found: dict[str, dict[tuple[str, str], str]] = {}  # module -> {(kind, role): tensor key}
    unknown: list[str] = []
    for key in sorted(shapes):
        if key in skipped:
            continue
        split = split_key(key)
        if split is None or split[1] in ("conv", "refused") or split[0] not in table:
            unknown.append(key)
            continue
        module, kind, role = split
        if (kind, role) in found.setdefault(module, {}):
            _twice(path, module, found[module][kind, role], key)
        found[module][kind, role] = key
    if not found:  # a refused kind on this model's modules says so; anything else is not for FLUX
        for key in unknown:
            split = split_key(key)
            if split is not None and split[1] in ("conv", "refused") and split[0] in table:
                _unknown_key(path, key, info)
        _no_model_keys(path, shapes, skipped)
    for key in unknown:
        _unknown_key(path, key, info)
    modules: list[LoraModule] = []
    formats = set()
    for module, parts in found.items():
        modules += _modules(path, module, parts, table[module], shapes, alphas)
        formats.add(table[module].format)
    return LoraInfo(str(path), "+".join(sorted(formats)), tuple(modules), skipped)


def _twice(path: Path, module: str, first: str, second: str) -> None:
    raise LoraError(
        f"LoRA {quoted(path)}: '{first}' and '{second}' are the same tensor of '{module}' in two spellings; "
        "ComfyUI would use one and ignore the other. The file is malformed"
    )


def _modules(
    path: Path,
    module: str,
    parts: Mapping[tuple[str, str], str],
    slot: Slot,
    shapes: Mapping[str, tuple[int, ...]],
    alphas: Mapping[str, Any],
) -> list[LoraModule]:
    """The modules one key holds: at most one weight adapter (LoRA, LoHa, LoKr or .diff), optionally with
    alpha and dora_scale, and a bias difference (.diff_b)."""
    kinds = sorted({kind for kind, _ in parts if kind in WEIGHT_KINDS}, key=WEIGHT_KINDS.index)
    shared = {role: key for (kind, role), key in parts.items() if kind == ""}
    if len(kinds) > 1:
        names = " and ".join(KINDS[k].name for k in kinds)
        raise LoraError(
            f"LoRA {quoted(path)}: '{module}' has both {names} tensors; ComfyUI would apply only the last it "
            "recognises and ignore the rest. The file is malformed"
        )
    if shared and not kinds:
        key = next(iter(shared.values()))
        raise LoraError(
            f"LoRA {quoted(path)}: '{key}' has no LoRA, LoHa, LoKr or .diff tensors beside it for '{module}'; "
            "the file is incomplete. Download it again"
        )
    out = []
    if kinds:
        alpha = _alpha(path, shared.get("alpha"), alphas)
        roles = {role: key for (kind, role), key in parts.items() if kind == kinds[0]}
        out.append(_module(path, module, kinds[0], roles, slot, shapes, alpha, shared.get("dora_scale")))
    if ("diff_b", "diff_b") in parts:
        key = parts["diff_b", "diff_b"]
        if not slot.bias:
            _no_bias(path, module, key, slot)
        bias = replace(slot, shape=(slot.shape[0],), targets=slot.bias, bias=None)  # same rows, 1-D
        out.append(_module(path, module, "diff_b", {"diff_b": key}, bias, shapes, None, None))
    return out


def _no_bias(path: Path, module: str, key: str, slot: Slot) -> None:
    if slot.bias is None:
        raise LoraError(
            f"LoRA {quoted(path)}: '{key}' is a bias difference on '{module}', a part of a fused BFL tensor, for "
            "which ComfyUI maps no bias and drops the patch. Key the bias by its BFL module "
            "('diffusion_model.<module>.diff_b') instead"
        )
    raise LoraError(
        f"LoRA {quoted(path)}: '{key}' is a bias difference, but this checkpoint's '{module}' has no bias; the "
        "LoRA was made for a different model"
    )


def _alpha(path: Path, key: str | None, alphas: Mapping[str, Any]) -> float | None:
    """ComfyUI's `lora[alpha].item()`: one finite number."""
    if key is None:
        return None
    tensor = alphas[key]
    if tensor.numel() != 1:
        raise LoraError(f"LoRA {quoted(path)}: '{key}' holds {tensor.numel()} values; an alpha is one number")
    alpha = float(tensor.float().reshape(()))
    if not math.isfinite(alpha):
        raise LoraError(f"LoRA {quoted(path)}: '{key}' is {alpha}, not a finite number")
    return alpha


def _module(
    path: Path,
    module: str,
    kind: str,
    roles: Mapping[str, str],
    slot: Slot,
    shapes: Mapping[str, tuple[int, ...]],
    alpha: float | None,
    dora_scale: str | None,
) -> LoraModule:
    adapter = KINDS[kind]
    for role in adapter.required:
        if role not in roles:
            have = next(iter(roles.values()))
            lack = adapter.roles[role][0]
            raise LoraError(
                f"LoRA {quoted(path)}: '{have}' has no matching '{lack}' for '{module}'; the file is incomplete. "
                "Download it again"
            )
    parsed = Parsed(str(path), module, roles, shapes, alpha, slot.shape)
    rank, scale = adapter.parse(parsed)
    tensors = tuple(sorted(roles.items()))
    axis = ""
    if dora_scale is not None:
        if not adapter.dora:
            raise LoraError(
                f"LoRA {quoted(path)}: '{dora_scale}' is a DoRA scale beside a {adapter.name}, which ComfyUI "
                "applies without it; the file is malformed"
            )
        axis = _dora_axis(path, module, dora_scale, shapes[dora_scale], slot.shape)
        tensors += (("dora_scale", dora_scale),)
    return LoraModule(module, kind, tensors, slot.shape, scale, rank, slot.targets, slot.delta_rows, axis)


def _dora_axis(path: Path, module: str, key: str, shape: Sequence[int], weight: Sequence[int]) -> str:
    """ComfyUI's rule: the norm is per output row when dora_scale's first dimension is the weight's rows,
    per input column otherwise. Only [out, 1] and [1, in] broadcast as it means; anything else would
    scale the weight by a garbled matrix (or fail inside ComfyUI's try and leave the layer unpatched)."""
    out, in_features = weight
    if tuple(shape) == (out, 1):
        return "output"
    if tuple(shape) == (1, in_features):
        return "input"
    raise LoraError(
        f"LoRA {quoted(path)}: '{key}' has shape {list(shape)} but this checkpoint's '{module}' needs "
        f"[{out}, 1] or [1, {in_features}] (DoRA's magnitude per output row or per input column); the "
        "LoRA was made for a different model"
    )


def refuse_foreign_lora(path: str | os.PathLike[str]) -> None:
    """Refuse, from the file's key names alone, a LoRA for another model (SDXL, SD 1.5) or a checkpoint
    picked as a LoRA: before the base checkpoint is read (that imports diffusers, seconds). Anything the
    names do not settle is left to `inspect_lora`, which refuses it with the same message."""
    path = Path(path).expanduser()
    _check_file(path)
    shapes, _ = read_header(path)
    if plainly_foreign(shapes):
        _no_model_keys(path, shapes, ())


def _no_model_keys(path: Path, shapes: Mapping[str, Any], skipped: Sequence[str]) -> None:
    if skipped and len(skipped) == len(shapes):
        raise LoraError(
            f"LoRA {quoted(path)} has only text-encoder keys ({len(skipped)}, e.g. '{skipped[0]}'), which "
            "ROCm Parallel does not apply: it patches the FLUX transformer only. Apply this LoRA to the "
            "CLIP/T5 model with ComfyUI's LoraLoader"
        )
    first = ", ".join(sorted(shapes)[:4]) or "none, the file is empty"
    other = other_model(shapes)
    what = "it may be a LoRA for another model" if other is None else f"it is {other}"
    raise LoraError(
        f"{quoted(path)} has no FLUX LoRA keys (looked for {LOOKED_FOR}); {what} (first keys: {first})"
    )


def _unknown_key(path: Path, key: str, info: CheckpointInfo) -> None:
    split = split_key(key)
    if split is None:
        raise LoraError(
            f"LoRA {quoted(path)}: key '{key}' is not a LoRA tensor (expected a name ending in .lora_up.weight, "
            ".lora_down.weight, .lora_A.weight, .lora_B.weight, .hada_w1_a, .lokr_w1, .diff, .diff_b, "
            ".dora_scale or .alpha); the file is not a LoRA ComfyUI applies"
        )
    module, kind, suffix = split
    if kind == "conv":
        raise LoraError(
            f"LoRA {quoted(path)}: '{key}' is a {CONV_ONLY[suffix]} factor, which only convolutions have: FLUX's "
            "transformer has linear layers only (ComfyUI fails on it too). The LoRA was made for another model"
        )
    if kind == "refused":
        name = REFUSED[suffix]
        raise LoraError(
            f"LoRA {quoted(path)}: '{key}' is a {name} patch; ROCm Parallel applies {APPLIED} only. Use a file "
            f"without {name.split(' (')[0]} patches"
        )
    raise LoraError(
        f"LoRA {quoted(path)}: '{key}' targets '{module}', which this checkpoint ({info.model_name}, hidden "
        f"{info.dims.hidden}) does not have; the LoRA was made for a different model"
    )


__all__ = ["inspect_lora", "read_header"]
