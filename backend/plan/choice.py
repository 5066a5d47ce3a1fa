"""`auto`: the feasible layout with the lowest predicted step time, or a message naming what would fit."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from ..config import ConfigError, ParallelLayout
from ..dtypes import FP8_DTYPES
from ..text import GB
from .cost import Estimate, check_blocks, plan
from .report import capacity, describe_links, gb
from .setup import Setup


@dataclass(frozen=True)
class Choice:
    layout: ParallelLayout
    explanation: str
    estimates: list[Estimate]


def choose(setup: Setup, fixed: Mapping[str, int] | None = None) -> Choice:
    """The feasible layout with the lowest predicted step time, with a one-line reason.

    `fixed` keeps some degrees ({"tp": 1}: the Ring Attention Sampler offers only context layouts); a
    fixed batch degree above the call's batch is the caller's choice, priced with its idle groups.
    Raises ConfigError naming what would fit when nothing does.
    """
    fixed = dict(fixed or {})
    idle = fixed.get("batch", 1) > setup.batch
    estimates = [
        e for e in plan(setup, idle=idle) if all(getattr(e.layout, k) == v for k, v in fixed.items())
    ]
    if not estimates and "tp" in fixed:
        check_blocks(setup, ParallelLayout(tp=fixed["tp"]))  # a GGUF file's blocks refuse that degree
    if not estimates:
        kept = " x ".join(f"{k} {v}" for k, v in fixed.items())
        raise ConfigError(
            f"no layout of {setup.devices} device(s) keeps {kept} for {setup.dims.heads} attention heads; "
            "set fewer degrees and let auto choose the rest"
        )
    best = estimates[0]
    if not best.fits:
        raise ConfigError(_nothing_fits(setup, estimates))
    others = [e for e in estimates[1:] if e.fits]
    versus = f" vs {others[0].name} {others[0].step_s:.2f} s" if others else ""
    idle_note = f"; {best.idle_groups} batch group(s) idle per call" if best.idle_groups else ""
    explanation = (
        f"auto: {best.name} — fits {gb(best.per_gpu)} of {capacity(setup.memory_gb)} GB per {setup.device_word}; "
        f"predicted {best.step_s:.2f} s/step{versus} ({describe_links(setup)}){idle_note}"
    )
    return Choice(best.layout, explanation, estimates)


def _nothing_fits(setup: Setup, estimates: list[Estimate]) -> str:
    smallest = min(estimates, key=lambda e: e.per_gpu)
    need = smallest.per_gpu / (1 - setup.margin)
    hints = [f"GPUs with at least {math.ceil(need / GB)} GB"]
    # bf16 weights priced: fp8 weights (the file ComfyUI's FLUX.2 template loads) may fit these devices
    fp8 = FP8_DTYPES[0].short
    lighter = (
        [e for e in plan(replace(setup, weight_dtype=fp8, file_weights=None)) if e.fits]
        if setup.weight_dtype == "compute"
        else []
    )
    if lighter:
        best = lighter[0]
        hints.insert(
            0, f"fp8 weights (weight_dtype {fp8}: {best.name}, {gb(best.per_gpu)} GB per {setup.device_word})"
        )
    for devices in (2, 4, 8):
        if devices > setup.devices and devices % setup.hosts == 0:
            more = [e for e in plan(replace(setup, devices=devices)) if e.fits]
            if more:
                hints.append(f"{devices} GPUs ({more[0].name})")
                break
    for side in (1024, 768, 512):
        if side * side < setup.width * setup.height:
            smaller = [e for e in plan(replace(setup, width=side, height=side)) if e.fits]
            if smaller:
                hints.append(f"{side}x{side} images ({smaller[0].name})")
                break
    return (
        f"no layout of {setup.devices} device(s) fits {setup.width}x{setup.height} x{setup.batch} in "
        f"{capacity(setup.memory_gb)} GB per device: the smallest, {smallest.name}, needs {gb(smallest.per_gpu)} GB "
        f"per {setup.device_word} ({gb(smallest.weights)} weights + {gb(smallest.activations)} activations) and "
        f"{gb(setup.usable_bytes)} GB are usable ({setup.margin:.0%} kept free); use " + " or ".join(hints)
    )
