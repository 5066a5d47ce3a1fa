"""`check_loras`: LoRAs checked in the caller's process, before any worker starts, headers *and* values.

Beyond `inspect_lora`'s header checks, every tensor a LoRA applies is read once and refused when it holds
NaN or inf (a diverged training run or a corrupt file: ComfyUI would silently make the model output NaN),
and each module's largest possible change at the requested strength is bounded from the tensors' largest
|values|; a strength that could push a weight beyond `LIMIT` is refused, naming the file, the key and the
strength that would fit. The scan is remembered per file (path, size, modification time), so the node's
check and the load's check read a file once.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from ...runtime.redact import quoted
from ..info import CheckpointInfo
from .kinds import KINDS
from .parse import inspect_lora, refuse_foreign_lora
from .records import LoraError, LoraInfo, Stats

# The largest change a LoRA may make to one weight entry: the square root of float32's largest value.
# Attention multiplies two patched projections (q and k), so a weight beyond it makes q.k overflow to inf
# and the output NaN, whatever dtype the model computes in; no real adapter comes near it (their deltas
# are well below 1).
LIMIT = math.sqrt(torch.finfo(torch.float32).max)
MAX_STRENGTH = 100.0  # ComfyUI's LoraLoader allows -100 to 100
_KEPT = 32  # files whose scan is remembered
_SCANS: OrderedDict[tuple[str, int, int], dict[str, Stats]] = OrderedDict()


def _finite(path: str, key: str, tensor: torch.Tensor) -> None:
    bad = ~torch.isfinite(tensor)
    if not bad.any():
        return
    where = [int(i) for i in bad.nonzero()[0]]
    value = tensor[tuple(where)].item()
    raise LoraError(
        f"LoRA {quoted(path)}: '{key}' holds {value} at {where} ({int(bad.sum())} of {tensor.numel()} values are "
        "not finite); applied, it would make the model's output NaN. The file is corrupt or was saved from "
        "a diverged training run: use another file"
    )


def scan_values(lora: LoraInfo) -> dict[str, Stats]:
    """Tensor key -> its largest |value| and shape, for every tensor `lora` applies; LoraError naming the
    first tensor with a NaN or inf. Reads each tensor once (one at a time); remembered per file version."""
    stat = os.stat(lora.path)
    version = (str(Path(lora.path).resolve()), stat.st_size, stat.st_mtime_ns)
    if version in _SCANS:
        _SCANS.move_to_end(version)
        return _SCANS[version]
    keys = sorted({key for module in lora.modules for _, key in module.tensors})
    stats: dict[str, Stats] = {}
    with safe_open(lora.path, "pt") as f:
        for key in keys:
            tensor = f.get_tensor(key)
            if tensor.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
                tensor = tensor.to(torch.float32)  # fp8 and integer tensors have no abs/isfinite kernels
            _finite(lora.path, key, tensor)
            peak = float(tensor.abs().amax()) if tensor.numel() else 0.0
            stats[key] = Stats(peak, tuple(tensor.shape))
    _SCANS[version] = stats
    while len(_SCANS) > _KEPT:
        _SCANS.popitem(last=False)
    return stats


def check_overflow(lora: LoraInfo, strength: float, stats: Mapping[str, Stats]) -> None:
    """LoraError when some module of `lora` at `strength` could change a weight entry by more than LIMIT."""
    for module in lora.modules:
        unscaled = abs(module.scale) * KINDS[module.kind].bound(module, stats)
        peak = abs(strength) * unscaled
        if peak <= LIMIT:
            continue
        fits = LIMIT / unscaled if unscaled > 0 else math.inf
        raise LoraError(
            f"LoRA {quoted(lora.path)} at strength {strength:g}: '{module.key}' can change a weight by up to "
            f"{peak:.3g}, beyond {LIMIT:.3g} (the square root of float32's largest value: attention multiplies "
            "two patched projections, which would overflow to inf and make the output NaN). Use a strength "
            f"of at most {fits:.3g} in magnitude"
        )


def check_loras(
    loras: Iterable[tuple[str | os.PathLike[str], float]], info: CheckpointInfo
) -> tuple[tuple[str, float], ...]:
    """Validate (path, strength) pairs against checkpoint `info`; returns them as (str, float) pairs.

    Runs in the caller's process: every file's header is read and every tensor it applies is scanned for
    NaN/inf and overflow at its strength; nothing is applied.
    """
    out = []
    for i, item in enumerate(loras):
        try:
            path, strength = item
        except (TypeError, ValueError):
            raise LoraError(f"loras[{i}] is {item!r}; pass (path, strength) pairs") from None
        if isinstance(strength, bool) or not isinstance(strength, int | float) or not math.isfinite(strength):
            raise LoraError(
                f"LoRA {quoted(path)}: strength {strength!r} is not a finite number; use e.g. 1.0 "
                "(0 disables it, negative values invert it)"
            )
        if abs(strength) > MAX_STRENGTH:
            raise LoraError(
                f"LoRA {quoted(path)}: strength {strength!r} is beyond +-{MAX_STRENGTH:g} (ComfyUI's LoraLoader "
                "range; far beyond it the patched weights overflow to inf); use e.g. 1.0"
            )
        lora = inspect_lora(path, info)
        if strength != 0:  # a LoRA at strength 0 is not applied (ComfyUI's loader skips it too)
            check_overflow(lora, float(strength), scan_values(lora))
        # absolute: the workers run in a folder of their own, where a relative path would miss
        out.append((str(Path(path).expanduser().absolute()), float(strength)))
    return tuple(out)


def refuse_foreign_loras(loras: Iterable[tuple[str | os.PathLike[str], float]]) -> None:
    """`refuse_foreign_lora` on each (path, strength) pair: an SDXL / SD 1.5 LoRA or a model checkpoint given
    as a LoRA is named from its key names before the base checkpoint is read (that builds the family's
    parts: torch, seconds). Malformed pairs are left to `check_loras`, which names them."""
    for item in loras:
        if isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str | os.PathLike):
            refuse_foreign_lora(item[0])


__all__ = ["LIMIT", "MAX_STRENGTH", "check_loras", "check_overflow", "refuse_foreign_loras", "scan_values"]
