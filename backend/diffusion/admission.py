"""Admission control: a model call whose activations cannot fit the devices is refused in the caller,
before the caller allocates anything for it (noise, tokens) and before any rank runs.

Without it a 16384 x 16384 image passed every check and, minutes later, a CPU worker was killed by the
kernel (exit -9) or a GPU ran out of memory mid-step. The estimate is the planner's own
(`plan.cost.activation_bytes`: peak live activations of one rank during one forward, calibrated against
torch's MemTracker); the limit is what the devices have (resident/admission.py `memory_limit`).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..checkpoint import CheckpointInfo
from ..config import ConfigError, ParallelLayout
from ..plan import Setup
from ..plan.cost import activation_bytes
from ..resident.admission import memory_limit
from ..resident.messages import RankStatus
from ..text import GB


def activation_estimate(
    info: CheckpointInfo,
    layout: ParallelLayout,
    shape: Sequence[int],
    *,
    dtype: str,
    text_tokens: int,
    reference_tokens: int = 0,
) -> float:
    """Peak activation bytes on one rank for one model call on a latent of `shape` ([B, C, H, W] or
    [B, C, T, H, W]: every frame counts)."""
    frames, px_height, px_width = info.model_family.planned_size(shape)
    setup = Setup(
        info.dims, width=px_width, height=px_height, batch=int(shape[0]), text_tokens=max(1, text_tokens),
        dtype=dtype, devices=layout.world_size, family=info.family, reference_tokens=reference_tokens,
        frames=frames,
    )  # fmt: skip
    return activation_bytes(setup, layout)


def admit(
    info: CheckpointInfo,
    layout: ParallelLayout,
    devices: Sequence[str],
    reports: Sequence[RankStatus],
    shape: Sequence[int],
    *,
    dtype: str,
    text_tokens: int,
    reference_tokens: int = 0,
    what: str = "latent",
    estimate: float | None = None,
) -> None:
    """Refuse a model call on a latent of `shape` whose activations cannot fit; says what would.
    `estimate`: `activation_estimate`'s answer for these arguments when the caller has it already."""
    bound = memory_limit(devices, reports)
    if bound is None:
        return
    limit, why = bound
    if estimate is None:
        estimate = activation_estimate(
            info, layout, shape, dtype=dtype, text_tokens=text_tokens, reference_tokens=reference_tokens
        )
    if estimate <= limit:
        return
    batch = int(shape[0])
    frames, px_height, px_width = info.model_family.planned_size(shape)
    size = f"{px_width}x{px_height} px" + (f" x {frames} frames" if frames > 1 else "")
    word = "CPU worker" if devices[0] == "cpu" else "GPU"
    fits = _largest_square(info, layout, batch, limit, dtype=dtype, text_tokens=text_tokens, shape=shape)
    fit = (
        f"at most {fits}x{fits} px per image in this layout"
        if fits
        else "not even the smallest image in this layout"
    )
    smaller_batch = f", or fewer than {batch} images at once" if batch > 1 else ""
    raise ConfigError(
        f"{what} of {size} (batch {batch}, shape {list(shape)}) needs about "
        f"{estimate / GB:.1f} GB of activations per {word} in layout {layout} ({dtype}), but {why}: the limit "
        f"is {limit / GB:.1f} GB per {word}. What fits: {fit}{smaller_batch}; or more devices, or a smaller "
        "image, then upscale"
    )


def _largest_square(
    info: CheckpointInfo,
    layout: ParallelLayout,
    batch: int,
    limit: float,
    *,
    dtype: str,
    text_tokens: int,
    shape: Sequence[int],
) -> int:
    """The largest square image side in pixels (a multiple of 64) whose call fits `limit` with the frames
    of `shape`; 0 when none."""
    family = info.model_family
    latent_per_64 = 64 // family.latent.downscale  # latent pixels per 64 image pixels
    frames = tuple(shape[2:3]) if len(shape) == 5 else ()

    def fits(side: int) -> bool:
        latent = side * latent_per_64
        return (
            activation_estimate(
                info, layout, (batch, 0, *frames, latent, latent), dtype=dtype, text_tokens=text_tokens
            )
            <= limit
        )

    low, high = 0, 1
    while fits(high) and high < 1 << 12:  # up to 262144 px a side
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low * 64
