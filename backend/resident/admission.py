"""What the devices can take for a job beyond the resident weights, whatever the model (a diffusion model's
call: diffusion/admission.py; a VAE decode: vae/api.py), and the refusal when a job needs more. The caller
asks before any rank runs; the group parks a waiting module first when that makes room (group.py
`make_headroom`, against the same bound).

The limit is what the devices have: for CPU workers the host memory available now, shared by every worker;
for GPUs the free memory each rank reported after its load (weights resident).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import psutil

from ..config import ConfigError
from ..text import GB
from .messages import RankStatus

# Of the memory available, the share activations may take: the rest is the Python processes' own
# growth, the caller's outputs, kernel workspaces and the planner's error (within ~10 % on FLUX).
HOST_SHARE = 0.8
GPU_SHARE = 0.9


def memory_limit(devices: Sequence[str], reports: Sequence[RankStatus]) -> tuple[float, str] | None:
    """(bytes one rank's activations may take, what bounds it), or None when nothing is known (a GPU
    group that has not reported its memory yet)."""
    if devices[0] == "cpu":
        available = psutil.virtual_memory().available
        workers = len(devices)
        return (
            available * HOST_SHARE / workers,
            f"{available / GB:.1f} GB of host memory are available to {workers} CPU worker(s) "
            f"({HOST_SHARE:.0%} of it shared between them)",
        )
    free = [r.memory.free_gb for r in reports if r.memory is not None]
    if not free:
        return None
    least = min(free)
    return least * GB * GPU_SHARE, f"the fullest GPU has {least:.1f} GB free after loading the weights"


def refuse_unless_fits(
    need: float,
    devices: Sequence[str],
    reports: Sequence[RankStatus],
    *,
    what: str,
    fits: Callable[[float], str],
) -> None:
    """Refuse a job of another phase than a model call (a VAE decode: backend/vae/api.py) that needs `need`
    bytes on one rank beyond what is resident, when the devices do not have them. `what` names the job,
    `fits(limit)` says what would fit in `limit` bytes per rank. A GPU group that has not reported its memory
    yet is not refused (nothing is known)."""
    bound = memory_limit(devices, reports)
    if bound is None or need <= bound[0]:
        return
    limit, why = bound
    word = "CPU worker" if devices[0] == "cpu" else "GPU"
    raise ConfigError(
        f"{what} needs about {need / GB:.1f} GB per {word}, but {why}: the limit is {limit / GB:.1f} GB per "
        f"{word}. What fits: {fits(limit)}; or more devices"
    )
