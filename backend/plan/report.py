"""The planner's report: the Markdown table of `python -m rocm_parallel plan` and memory as people say it."""

from __future__ import annotations

from ..family import get_family
from ..text import GB, markdown_table
from .cost import Estimate, by_dimension, count_by_kind
from .setup import Setup


def gb(n: float) -> str:
    return f"{n / GB:.1f}"


def capacity(gb: float) -> str:
    """A device's memory as people say it: 16, 192, 12.6 (measured sizes are not round)."""
    if gb == round(gb) or gb >= 100:
        return f"{gb:.0f}"
    return f"{gb:.1f}"


def collectives_text(e: Estimate) -> str:
    """'tp: 76 all_reduce, 1 all_gather; cp: 1 all_gather': one forward's collectives per mesh dimension."""
    dims = by_dimension(e.collectives)
    parts = []
    for dim in dims:
        kinds = count_by_kind([c for c in e.collectives if c.dim == dim])
        parts.append(f"{dim}: " + ", ".join(f"{n} {kind}" for kind, n in kinds.items()))
    return "; ".join(parts) or "-"


def _row(e: Estimate) -> list[str]:
    gb_cells = (e.weights, e.activations, e.buffers, e.per_gpu)
    counts = collectives_text(e)
    return [e.name, *(f"{b / GB:.2f}" for b in gb_cells), "yes" if e.fits else "no", counts,
            f"{e.sent_per_gpu / GB:.2f}", f"{e.compute_s:.2f}", f"{e.comm_s:.3f}", f"{e.step_s:.2f}"]  # fmt: skip


def _tokens(setup: Setup) -> str:
    """'8448 tokens' of one call's sequence, naming the reference images' share when there is one."""
    refs = f", {setup.reference_tokens} of them reference images'" if setup.reference_tokens else ""
    return f"{setup.tokens} tokens{refs}"


def _weights(setup: Setup) -> str:
    held = (
        sorted({setup.dtype if h == "compute" else h for _, h in setup.file_weights.held})
        if setup.file_weights is not None
        else []
    )
    if len(held) > 1:  # a checkpoint mixing types: each weight priced as the file holds it
        return f" ({' / '.join(held)} weights, tensor by tensor)"
    return "" if setup.weight_dtype == "compute" else f" ({setup.weight_dtype} weights)"


def describe_links(setup: Setup) -> str:
    """'PCIe 4.0 x16 24 GB/s assumed', and over several hosts what joins them: '...; 2 hosts x 4 devices,
    100 Gb/s between hosts 12 GB/s assumed'."""
    if setup.hosts == 1:
        return setup.link.describe()
    net = setup.between_hosts
    return (
        f"{setup.link.describe()}; {setup.hosts} hosts x {setup.host_devices} devices, {net.gbps * 8:.3g} Gb/s and "
        f"{net.latency_us:.0f} µs per collective between hosts {'measured' if net.measured else 'assumed'}"
    )


SHORT_HEADER = ["layout", "per GPU (GB)", "fits", "step (s)"]
SHORT_NOTE = "(--full: weights, activations, collectives and bytes sent per layout)"


def format_table(setup: Setup, estimates: list[Estimate], full: bool = True) -> str:
    """The plan's heading and table: every column when `full`, else what a user asks first (does it fit,
    how fast), the layouts that fit first."""
    head = (
        f"{get_family(setup.family).planner.table_name} ({setup.dims.heads} heads x "
        f"{setup.dims.head_dim}, {setup.dims.blocks_text()}), "
        f"{setup.dtype}{_weights(setup)}, {setup.width}x{setup.height}, call batch {setup.batch} "
        f"({_tokens(setup)}), {setup.devices} device(s) x {capacity(setup.memory_gb)} GB, "
        f"{describe_links(setup)}, {setup.tflops:g} TFLOPS per device"
    )
    header = ["layout", "weights (GB)", "activations (GB)", "of which buffers (GB)", "per GPU (GB)", "fits",
              "collectives / step (per mesh dimension)", "sent per GPU (GB)", "compute (s)", "comm (s)", "step (s)"]  # fmt: skip
    if not full:
        ordered = [e for e in estimates if e.fits] + [e for e in estimates if not e.fits]
        rows = [[e.name, gb(e.per_gpu), "yes" if e.fits else "no", f"{e.step_s:.2f}"] for e in ordered]
        return f"{head}\n\n{markdown_table(SHORT_HEADER, rows, ['---', '---:', '---', '---:'])}\n{SHORT_NOTE}"
    rows = [_row(e) for e in estimates]
    align = ["---", *["---:"] * 4, "---", "---", *["---:"] * 4]
    return head + "\n\n" + markdown_table(header, rows, align)
