"""Every model plan the engine knows, one module per ComfyUI model family; `plan_for` picks a model's.

Adding a model is a plan module here (see plans/flux.py, the worked example, and docs/internals.md "The
model engine"): every module of this package is read, so no line elsewhere names the model.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from typing import Any

from ..plan import ModelPlan

# Modules (relative to this package) whose `PLANS` tuple holds their plans: every module in this folder.
MODULES: tuple[str, ...] = tuple(sorted(f".{m.name}" for m in pkgutil.iter_modules(__path__)))


def plans() -> tuple[ModelPlan, ...]:
    """Every plan of every module in `MODULES`, in order."""
    return tuple(p for m in MODULES for p in importlib.import_module(m, __package__).PLANS)


def plan_for(class_name: str, unet_config: Mapping[str, Any]) -> ModelPlan | None:
    """The plan for ComfyUI's diffusion model class `class_name` (qualified: 'comfy.ldm.flux.model.Flux')
    detected with `unet_config`; None when the engine has none."""
    found = [p for p in plans() if p.matches(class_name, unet_config)]
    if len(found) > 1:
        raise RuntimeError(f"{class_name} matches several plans: {', '.join(p.name for p in found)}")
    return found[0] if found else None


__all__ = ["MODULES", "plan_for", "plans"]
