"""Units and Markdown tables: how everything the pack prints (planner, demo, benchmarks) writes numbers.

Sizes are bytes. "GB" and "MB" are decimal (1e9, 1e6 bytes: device memory as vendors state it, model
sizes); host memory measured from /proc is binary and is written "MiB" (2**20 bytes).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

GB = 1e9
MB = 1e6
MiB = 1 << 20


def cli_command(arguments: str = "") -> str:
    """How a user runs the pack's command line in the install it is in: from ComfyUI's folder, `python
    custom_nodes/<folder> ...` (the pack's folder, its requirements installed but the pack itself not:
    __main__.py), else `python -m rocm_parallel ...` (pip-installed, a checkout)."""
    root = Path(__file__).resolve().parents[1]
    runner = (
        f"python custom_nodes/{root.name}"
        if root.parent.name == "custom_nodes"
        else "python -m rocm_parallel"
    )
    return f"{runner} {arguments}".rstrip()


def markdown_row(cells: Iterable[object]) -> str:
    """One row of a Markdown table: `| a | b |`."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def markdown_table(
    header: Sequence[str], rows: Iterable[Sequence[object]], align: str | Sequence[str] = "---"
) -> str:
    """A Markdown table; `align` is the separator cell for every column ("---", "---:") or one per column."""
    cells = [align] * len(header) if isinstance(align, str) else list(align)
    lines = [markdown_row(header), "|" + "|".join(cells) + "|"]
    lines += [markdown_row(row) for row in rows]
    return "\n".join(lines)
