"""What both the tests and the benchmarks need, written once: the small FLUX configs they share, a random
BFL checkpoint, a ComfyUI-shaped sampling job, device sync, timing with one statistic (the median), a
Markdown table and CPU burners (a machine busier than its cores). The rest of testing/: models.py (tiny configs, random inputs), writers.py (fp8 "mixed"
checkpoints, LoRAs), fake.py (the `fake` process group), meta.py (the meta-device tracer).

Lives outside the shipped package (the wheel has no `testing/`); import it from a checkout as
`rocm_parallel.testing.helpers`.
"""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..backend.checkpoint import save_checkpoint
from ..backend.flux.demo import DEMO_CONFIG
from ..backend.flux.dims import FluxDims
from ..backend.flux.model import build_flux
from ..backend.runtime.worker import synchronize
from ..backend.text import markdown_row, markdown_table
from .models import tiny_flux_config

# The tests' parallel FLUX: 8 heads (TP and Ulysses 2, 4, 8 divide it) x 16, 2 double + 3 single blocks.
TEST_CONFIG = tiny_flux_config(heads=8, head_dim=16, double_blocks=2, single_blocks=3)
# The smallest FLUX the group benchmarks time (their figures are the group's own cost, not compute).
TINY_CONFIG = tiny_flux_config(heads=4, head_dim=16, text_dim=32, pooled_dim=24)

__all__ = [
    "DEMO_CONFIG",
    "TEST_CONFIG",
    "TINY_CONFIG",
    "markdown_row",
    "markdown_table",
    "median_seconds",
    "sampling_job",
    "synchronize",
    "write_random_checkpoint",
]


def write_random_checkpoint(path: str | Path, config: dict[str, Any], seed: int = 0) -> str:
    """A FLUX with random weights drawn from `seed`, saved as a BFL/ComfyUI single file; returns the path."""
    return save_checkpoint(build_flux(config, seed=seed), path)


def sampling_job(config: dict[str, Any], size: int, steps: int, seed: int) -> dict[str, Any]:
    """A ComfyUI-shaped job for `ParallelModel.sample`: random conditioning (16 tokens) and an empty latent."""
    dims = FluxDims.from_diffusers_config(config)
    g = torch.Generator().manual_seed(0)
    positive = [
        [torch.randn(1, 16, dims.text_dim, generator=g), {"pooled_output": torch.randn(1, dims.pooled_dim)}]
    ]
    return {
        "positive": positive,
        "latent": {"samples": torch.zeros(1, 16, size // 8, size // 8)},
        "seed": seed,
        "steps": steps,
    }


def median_seconds(
    fn: Callable[[], Any], repeats: int, device: torch.device | None = None, warmup: int = 1
) -> float:
    """The median wall time of `repeats` calls of `fn` after `warmup` calls, the device synced around each."""
    device = device or torch.device("cpu")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


@contextlib.contextmanager
def burning(count: int) -> Iterator[None]:
    """`count` processes that keep a core busy each, for the block (killed and reaped after it)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()
