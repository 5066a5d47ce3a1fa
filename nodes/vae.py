"""The ROCm Parallel VAE Decode / Encode nodes' plain side: the loader's worker group decodes a LATENT (or
encodes an IMAGE) in horizontal bands, one per rank, equal to ComfyUI's untiled VAE Decode / Encode
(backend/vae/). The VAE is named from models/vae/ rather than taken as ComfyUI's VAE object: every rank reads
the file itself (as ComfyUI's VAELoader reads it), so no weights cross a process boundary, and ComfyUI's
VAE object carries no file path to hand the ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..backend.config import ConfigError
from .inputs import ParallelHandle
from .registry import Registry

if TYPE_CHECKING:
    import torch

    from ..backend.vae.api import ParallelVae


def parallel_vae(registry: Registry, handle: ParallelHandle, vae_path: str) -> ParallelVae:
    """The VAE at `vae_path` on the group serving the handle's devices, in the loader's compute dtype
    (float32 on CPU workers, as ComfyUI's VAE there). The file is checked before any worker starts."""
    from ..backend.vae.api import ParallelVae

    if not isinstance(handle, ParallelHandle):
        raise ConfigError(
            f"parallel_model must come from a ROCm Parallel Loader; got {type(handle).__name__}: connect the "
            "loader's output"
        )
    group = registry.group_for(handle.devices)
    return ParallelVae(group, vae_path, dtype=handle.dtype)


def decode(registry: Registry, handle: ParallelHandle, vae_path: str, latent: Any) -> torch.Tensor:
    """VAE Decode of ComfyUI's LATENT `latent` on the handle's ranks: ComfyUI's IMAGE [B, H, W, 3]."""
    samples = _samples(latent)
    vae = parallel_vae(registry, handle, vae_path)
    vae.check_decode(samples)  # refused here, before a worker starts or a GPU is taken from ComfyUI
    _give_gpus(handle)
    with registry.phase("decoding"):
        image = vae.decode(samples)
    registry.record_ranks(vae.group.reports)
    return image


def encode(registry: Registry, handle: ParallelHandle, vae_path: str, pixels: Any) -> dict[str, Any]:
    """VAE Encode of ComfyUI's IMAGE `pixels` on the handle's ranks: ComfyUI's LATENT."""
    vae = parallel_vae(registry, handle, vae_path)
    vae.check_encode(pixels)
    _give_gpus(handle)
    with registry.phase("encoding"):
        samples = vae.encode(pixels)
    registry.record_ranks(vae.group.reports)
    return {"samples": samples}


def _samples(latent: Any) -> Any:
    if not isinstance(latent, dict) or "samples" not in latent:
        raise ConfigError(f"samples must be a LATENT (a dict with 'samples'); got {type(latent).__name__}")
    return latent["samples"]


def _give_gpus(handle: ParallelHandle) -> None:
    from .loading import needs_gpu_memory

    if needs_gpu_memory(handle.devices):
        from . import comfy_model

        comfy_model.free_comfy_models(handle.devices)


__all__ = ["decode", "encode", "parallel_vae"]
