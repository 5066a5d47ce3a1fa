"""The Status node: report the worker group, unload, close, or run `doctor` over it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..backend.config import ConfigError
from .inputs import STATUS_ACTIONS
from .registry import Registry, model_text, rank_line


def status_text(registry: Registry, action: str, devices: Sequence[str] | None = None) -> str:
    """The status node: report, or unload the model (workers stay), or close the worker group, or run
    `doctor` (over the resident group, else over `devices` or every GPU)."""
    if action not in STATUS_ACTIONS:
        raise ConfigError(f"action={action!r} is not offered; use one of {', '.join(STATUS_ACTIONS)}")
    if action == "doctor":
        return doctor_text(registry, devices)
    model = registry.current
    if action == "unload" and model is not None:
        model.unload()
        registry.record_resident(model)
        if model.started:
            registry.record_ranks(model.status())
    elif action == "close":
        registry.close()
    elif model is not None and model.started:
        registry.record_ranks(model.status())
    model = registry.current
    return format_state(registry.snapshot()) + "".join(
        f"\nwarning: {w}" for w in (model.warnings if model is not None else ())
    )


def doctor_text(registry: Registry, devices: Sequence[str] | None = None) -> str:
    """`python -m rocm_parallel doctor`'s report; uses the resident group when one runs (its GPUs are
    busy with it), otherwise starts a short-lived one on `devices` (default: every GPU, else 'cpu x2')."""
    from ..backend import doctor

    model = registry.current
    group = model.group if model is not None and model.started else None
    return doctor.format_report(doctor.collect(devices, group=group))


def format_state(state: dict[str, Any]) -> str:
    """Human text of a registry snapshot (the status node's STRING); ranks and sizes as the panel shows them
    (`registry.rank_line`)."""
    if not state.get("devices"):
        lines = ["ROCm Parallel: no worker group is running"]
    else:
        lines = [
            f"ROCm Parallel: {len(state['devices'])} workers on {', '.join(state['devices'])} ({state['phase']})",
            f"model: {state.get('checkpoint') or 'none loaded'}"
            + (f", {state['layout']}" if state.get("layout") else ""),
        ]
        if state.get("loading"):
            lines.append(f"loading: {state['loading']}")
        models = state.get("models") or []
        if len(models) > 1:  # a text encoder beside the model: where it waits (backend/resident/parking.py)
            lines.append("resident: " + ", ".join(model_text(m) for m in models))
        lines += [f"  {rank_line(r)}" for r in state.get("ranks", [])]
        if state.get("auto"):
            lines.append(state["auto"])
        lines += list(state.get("beside", []))
        if state.get("last"):
            lines.append(f"last job: {state['last']}")
    if state.get("error"):
        lines.append(f"last error: {state['error']}")
    return "\n".join(lines)
