"""The planner's report: the Markdown table of `python -m rocm_parallel plan` and memory as people say it."""

from __future__ import annotations

from .cost import Collective, Estimate
from .setup import GB, Setup


def gb(n: float) -> str:
    return f"{n / GB:.1f}"


def capacity(gb: float) -> str:
    """A device's memory as people say it: 16, 192, 12.6 (measured sizes are not round)."""
    if gb == round(gb) or gb >= 100:
        return f"{gb:.0f}"
    return f"{gb:.1f}"


def _count_by_kind(comms: list[Collective]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for c in comms:
        counts[c.kind] = counts.get(c.kind, 0) + c.count
    return counts


def format_table(setup: Setup, estimates: list[Estimate]) -> str:
    head = (
        f"FLUX ({setup.dims.heads} heads x {setup.dims.head_dim}, {setup.dims.double_blocks}+"
        f"{setup.dims.single_blocks} blocks), {setup.dtype}, {setup.width}x{setup.height} x{setup.batch} "
        f"({setup.tokens} tokens), {setup.devices} device(s) x {capacity(setup.memory_gb)} GB, "
        f"{setup.link.describe()}, {setup.tflops:g} TFLOPS per device"
    )
    lines = [
        head,
        "",
        "| layout | weights (GB) | activations (GB) | of which buffers (GB) | per GPU (GB) | fits | "
        "collectives / step | sent per GPU (GB) | compute (s) | comm (s) | step (s) |",
        "|---|---:|---:|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    for e in estimates:
        counts = ", ".join(f"{n} {kind}" for kind, n in _count_by_kind(e.collectives).items()) or "-"
        lines.append(
            f"| {e.name} | {e.weights / GB:.2f} | {e.activations / GB:.2f} | {e.buffers / GB:.2f} | "
            f"{e.per_gpu / GB:.2f} | {'yes' if e.fits else 'no'} | {counts} | {e.sent_per_gpu / GB:.2f} | "
            f"{e.compute_s:.2f} | {e.comm_s:.3f} | {e.step_s:.2f} |"
        )
    return "\n".join(lines)
