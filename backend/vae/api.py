"""A VAE resident on a worker group, decoding and encoding patch-parallel: the caller's side.

>>> from rocm_parallel.backend.api import ParallelModel
>>> from rocm_parallel.backend.vae.api import ParallelVae
>>> with ParallelModel(["cuda:0", "cuda:1"]) as group:
...     vae = ParallelVae(group, "models/vae/ae.safetensors")
...     image = vae.decode(latent["samples"])   # ComfyUI's IMAGE: [B, H, W, 3] in 0..1
...     latent = vae.encode(image)              # ComfyUI's LATENT samples

The VAE stays resident in its own slot of the group (`messages.VAE_SLOT`) beside the diffusion models, each
rank holding a whole copy read from the file by itself. Everything a caller can get wrong is checked here
before any rank runs: the file (kind.py), the latent's or image's shape, the split (one band of at least one
latent row per rank, bands.py) and the memory each rank needs (backend/plan/vae.py, admission.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from ..checkpoint import resolve_dtype
from ..config import ConfigError
from ..plan.vae import VaeMemory, largest_side, vae_memory
from ..resident.admission import refuse_unless_fits
from ..resident.group import ResidentGroup
from ..runtime.client import ProgressCallback
from .bands import Bands
from .images import crop_pixels, decoder_input, encoder_input
from .kind import VaeKind, get_vae_kind
from .load import inspect_vae
from .messages import VAE_SLOT, VaeLoadRequest, VaeReply, VaeRequest


@dataclass(frozen=True)
class VaeJob:
    """One decode or encode as checked: the tensor the ranks get, the split, what each rank needs."""

    x: torch.Tensor
    bands: Bands
    memory: VaeMemory


class ParallelVae:
    """The VAE at `checkpoint` on `group`'s ranks (module docstring). `dtype`: the compute dtype's name
    (None: the devices' default, float32 on CPU); the nodes pass ComfyUI's own VAE dtype."""

    def __init__(
        self,
        group: ResidentGroup,
        checkpoint: str | os.PathLike[str],
        dtype: str | None = None,
        slot: str = VAE_SLOT,
    ) -> None:
        self.group = group
        name = str(resolve_dtype(dtype, group.devices[0])).removeprefix("torch.")
        self.request: VaeLoadRequest = inspect_vae(checkpoint, name, slot)
        self.kind: VaeKind = get_vae_kind(self.request.kind)
        self.last_seconds = 0.0
        self.last_peaks: list[int] = []  # per rank, VaeReply.peak_bytes of the last job
        self.last_rss_rises: list[int] = []  # per rank, VaeReply.rss_rise_bytes (CPU workers)

    @property
    def ranks(self) -> int:
        return len(self.group.devices)

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.request.dtype)

    # ------------------------------------------------------------------ checks

    def check_decode(self, samples: Any) -> VaeJob:
        """Validate a decode of ComfyUI's LATENT `samples` before any rank runs; the job the ranks get."""
        kind, config = self.kind, self.request.config
        if not torch.is_tensor(samples) or samples.ndim not in (4, 5):
            raise ConfigError(
                f"samples must be a LATENT's tensor [B, C, H, W] (or [B, C, T, H, W]); got {_describe(samples)}"
            )
        x = decoder_input(kind, samples)
        channels = kind.latent_channels(config)
        if x.shape[1] != channels:
            raise ConfigError(
                f"the latent has {x.shape[1]} channels, {kind.title} decodes {channels}: decode it with the VAE "
                "of the model that made it"
            )
        if kind.frames and (x.ndim != 5 or x.shape[2] != 1):
            frames = x.shape[2] if x.ndim == 5 else "no"
            raise ConfigError(
                f"the latent has {frames} frames (shape {list(x.shape)}); the parallel decode takes one frame "
                "(an image, T = 1): decode a video with ComfyUI's VAE Decode"
            )
        height, width = x.shape[-2] * kind.downscale, x.shape[-1] * kind.downscale
        memory = self._admit(width, height, x.shape[0], encode=False)
        return VaeJob(x, Bands.even(x.shape[-2], self.ranks), memory)

    def check_encode(self, pixels: Any) -> VaeJob:
        """Validate an encode of ComfyUI's IMAGE `pixels` [B, H, W, C] before any rank runs."""
        kind = self.kind
        if not torch.is_tensor(pixels) or pixels.ndim != 4:
            raise ConfigError(f"pixels must be an IMAGE's tensor [B, H, W, C]; got {_describe(pixels)}")
        if kind.frames and pixels.shape[0] != 1:
            raise ConfigError(
                f"{pixels.shape[0]} images: ComfyUI's {kind.title} encodes a batch as the frames of one video; "
                "the parallel encode takes one image (batch 1): encode the images one at a time"
            )
        cropped = crop_pixels(kind, pixels)
        height, width = cropped.shape[1], cropped.shape[2]
        rows = height // kind.downscale
        if rows == 0 or width < kind.downscale:
            raise ConfigError(
                f"an image of {pixels.shape[2]}x{pixels.shape[1]} px is smaller than one latent pixel "
                f"({kind.downscale} px) of {kind.title}"
            )
        memory = self._admit(width, height, pixels.shape[0], encode=True)
        x = encoder_input(kind, cropped, self.dtype)
        return VaeJob(x, Bands.even(rows, self.ranks), memory)

    def memory(self, width: int, height: int, batch: int = 1, encode: bool = False) -> VaeMemory:
        """The planner's bytes per rank for an image of `width` x `height` px on this group."""
        return vae_memory(
            self.kind, self.request.config, width, height, ranks=self.ranks, batch=batch,
            dtype_bytes=self.dtype.itemsize, weight_bytes=self.request.weight_bytes, encode=encode,
        )  # fmt: skip

    def _admit(self, width: int, height: int, batch: int, encode: bool) -> VaeMemory:
        """Refuse a job whose bands cannot fit the ranks (admission.py), naming the largest that would."""
        memory = self.memory(width, height, batch, encode)
        held = self.group.residents.get(self.request.slot) == self.request

        def need(m: VaeMemory) -> float:
            return m.activations + m.image + (0 if held else m.weights)

        def fits(limit: float) -> str:
            def fitting(side: int) -> bool:
                try:
                    return need(self.memory(side, side, batch, encode)) <= limit
                except ConfigError:  # fewer latent rows than ranks
                    return False

            side = largest_side(fitting, self.kind.downscale * 8)
            return (
                f"at most {side}x{side} px on {self.ranks} rank(s)"
                if side
                else f"no image on {self.ranks} rank(s)"
            )

        what = f"{'encoding' if encode else 'decoding'} {width}x{height} px (batch {batch}) with {self.kind.title}"
        self.group.make_headroom(need(memory), exclude=self.request.slot)  # a parked text encoder: parking.py
        refuse_unless_fits(need(memory), self.group.devices, self.group.reports, what=what, fits=fits)
        return memory

    # ------------------------------------------------------------------ jobs

    def load(self, progress: ProgressCallback | None = None) -> None:
        """Make the VAE resident on every rank now (otherwise the first decode or encode does)."""
        self.group.hold(self.request, progress)

    def decode(self, samples: torch.Tensor, timeout: float | None = None) -> torch.Tensor:
        """ComfyUI's VAE Decode of `samples`: the IMAGE [B, H, W, 3] (a 3-D VAE's frame folded into the batch,
        as VAE Decode folds it), float32 in 0..1, equal to ComfyUI's untiled decode."""
        job = self.check_decode(samples)
        out = self._run("vae_decode", job, timeout)
        return out.reshape(-1, *out.shape[-3:]) if out.ndim == 5 else out

    def encode(self, pixels: torch.Tensor, timeout: float | None = None) -> torch.Tensor:
        """ComfyUI's VAE Encode of `pixels` (an IMAGE): the LATENT's samples, float32."""
        return self._run("vae_encode", self.check_encode(pixels), timeout)

    def _run(self, method: str, job: VaeJob, timeout: float | None) -> torch.Tensor:
        payload = VaeRequest(job.x, job.bands.starts, self.request.slot)
        replies: list[VaeReply] = self.group.call_resident(self.request, method, payload, timeout=timeout)
        self.last_seconds = max(r.seconds for r in replies)
        self.last_peaks = [r.peak_bytes for r in replies]
        self.last_rss_rises = [r.rss_rise_bytes for r in replies]
        out = replies[0].out
        assert out is not None, "rank 0 returned no result"
        return out


def _describe(value: Any) -> str:
    return f"a tensor of shape {list(value.shape)}" if torch.is_tensor(value) else type(value).__name__


__all__ = ["ParallelVae", "VaeJob"]
