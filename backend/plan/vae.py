"""The VAE phase per GPU: bytes one rank needs to decode (or encode) an image of a given size split into
bands over a given number of ranks, and the largest image that fits.

Per rank, for a band of `rows` latent rows (the tallest band: `vae.bands.Bands.even`):

* **weights**: the whole VAE (every rank keeps a copy; the request's `weight_bytes`);
* **activations**: the peak of live feature maps in one band, `units` x one map at the image's
  resolution (the kind's full-resolution channels x the band's pixel rows x columns x batch x dtype bytes).
  The units are the kind's, measured with torch's MemTracker on the meta device, where the engine's own
  band code runs under the fake process group (`bench vae`, testing/vae_meta.py), per dtype; they include
  the halo rows and the edge rows a convolution recomputes. Not below the mid block's peak: the keys and
  values of the whole latent, which every rank gathers for its attention;
* **the image** on rank 0: every band gathered, joined and converted to float32 (3 channels).

Nothing needs a device: the caller plans before any rank runs (admission.py refuses what cannot fit).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..config import ConfigError

IMAGE_COPIES = 3  # rank 0: the gathered bands, the joined image, its float32 0..1 copy
KV_COPIES = 4  # the band's keys and values, and the gathered keys and values of the whole latent


@dataclass(frozen=True)
class VaeMemory:
    """Bytes on one rank (the busiest: rank 0, which also gathers the image) for one decode or encode."""

    weights: int
    activations: float
    image: float
    rows: int  # latent rows of the tallest band

    @property
    def total(self) -> float:
        return self.weights + self.activations + self.image


def band_rows(latent_rows: int, ranks: int) -> int:
    """Latent rows of the tallest band when `latent_rows` are split over `ranks` (`Bands.even`)."""
    if latent_rows < ranks:
        raise ConfigError(
            f"a latent of {latent_rows} rows cannot be split into {ranks} bands (one per rank, at least one row "
            f"each); decode it on at most {latent_rows} rank(s), or decode a taller image"
        )
    return -(-latent_rows // ranks)


def vae_memory(
    kind: Any,
    config: Mapping[str, Any],
    width: int,
    height: int,
    *,
    ranks: int,
    batch: int = 1,
    dtype_bytes: int = 2,
    weight_bytes: int = 0,
    encode: bool = False,
) -> VaeMemory:
    """Bytes per rank to decode (`encode`: encode) a `width` x `height` px image (batch `batch`) with a VAE of
    `kind` (backend/vae/kind.py) and `config`, in bands over `ranks` ranks."""
    latent_rows = height // kind.downscale
    rows = band_rows(latent_rows, ranks)
    full, attention = kind.widths(config)
    units = kind.planner.units(encode, dtype_bytes)
    band_pixels = rows * kind.downscale * width
    activations = units * full * band_pixels * batch * dtype_bytes
    # the mid block runs at 1/8 of the pixels (every kind: FLUX.2's latent is patched after it)
    tokens = (height // 8) * (width // 8)
    kv = KV_COPIES * attention * tokens * batch * dtype_bytes
    image = IMAGE_COPIES * 3 * width * height * batch * 4 if not encode else 0
    return VaeMemory(weight_bytes, max(activations, kv), image, rows)


def largest_side(fits: Any, step: int, limit: int = 1 << 12) -> int:
    """The largest square side (a multiple of `step` px) for which `fits(side)` holds; 0 when none."""
    low, high = 0, 1
    while fits(high * step) and high < limit:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle * step) else (low, middle)
    return low * step


__all__ = ["VaeMemory", "band_rows", "largest_side", "vae_memory"]
