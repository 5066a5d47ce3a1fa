"""The worker methods of a resident VAE: load it into its slot, decode a latent, encode an image (every rank
its band of rows, bands.py; rank 0 returns the whole result).

The VAE is a resident module like a diffusion model (worker.py `Resident`, one slot): `status`, `unload` and
`unload_slot` (jobs.py) see it, and the caller's `ResidentGroup` evicts it by the same rule.
"""

from __future__ import annotations

import contextlib
import time

import torch

from ..resident.jobs import status
from ..resident.messages import LoadReport
from ..runtime.worker import WorkerContext, handler
from .bands import BandParallel, Bands
from .images import decoded_image
from .kind import VaeKind, get_vae_kind
from .load import load_vae
from .messages import VaeLoadRequest, VaeReply, VaeRequest
from .peak import LiveBytes, ResidentHighWater


def _free(ctx: WorkerContext) -> None:
    import gc

    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()


@handler("vae_load", VaeLoadRequest)
def load(ctx: WorkerContext, request: VaeLoadRequest) -> LoadReport:
    """Make the request's VAE resident in its slot (a no-op when it already is)."""
    resident = ctx.model(request.slot)
    if resident.key == request:
        return LoadReport(**vars(status(ctx)), reused=True)
    resident.clear()
    _free(ctx)
    started = time.perf_counter()
    model = load_vae(request, ctx.device, progress=ctx.load_progress)
    ctx.synchronize()
    resident.set(model, request)
    return LoadReport(**vars(status(ctx)), reused=False, seconds=time.perf_counter() - started)


def _resident(ctx: WorkerContext, request: VaeRequest) -> tuple[torch.nn.Module, VaeLoadRequest]:
    resident = ctx.model(request.slot)
    model = resident.require()
    if not isinstance(resident.key, VaeLoadRequest):
        raise TypeError(f"slot {request.slot!r} holds no VAE on rank {ctx.rank}")
    return model, resident.key


def _run(ctx: WorkerContext, request: VaeRequest, decode: bool) -> VaeReply:
    model, loaded = _resident(ctx, request)
    kind = get_vae_kind(loaded.kind)
    cpu = ctx.device.type == "cpu"
    if not cpu:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    started = time.perf_counter()
    # On CPU no allocator counts a peak: count the job's tensor storages and the resident set (peak.py).
    with ResidentHighWater() as rss, LiveBytes() if cpu else contextlib.nullcontext() as live:
        whole = _compute(ctx, model, kind, request, decode)
    ctx.synchronize()
    peak = live.peak if live is not None else torch.cuda.max_memory_allocated(ctx.device)
    return VaeReply(rank=ctx.rank, out=whole, seconds=time.perf_counter() - started, peak_bytes=peak,
                    rss_rise_bytes=rss.rise if cpu else 0)  # fmt: skip


def _compute(
    ctx: WorkerContext, model: torch.nn.Module, kind: VaeKind, request: VaeRequest, decode: bool
) -> torch.Tensor | None:
    """This rank's band of the decode (encode); rank 0 returns the whole result on the CPU."""
    dtype = next(model.parameters()).dtype
    bands = Bands(tuple(request.starts))
    with torch.inference_mode():
        x = request.x.to(ctx.device, dtype)
        if decode:
            x = kind.to_model(model, x)
        band = bands.take(x, ctx.rank, x.shape[-2] // bands.rows).contiguous()
        del x
        with BandParallel(bands) as mode:
            out = kind.decode(model, band) if decode else kind.encode(model, band)
        if not decode:
            out = kind.from_model(model, out)
        whole = mode.gather(out)
        del out
        if whole is not None:
            whole = decoded_image(whole) if decode else whole.to(torch.float32)
            whole = whole.cpu()
    return whole


@handler("vae_decode", VaeRequest)
def decode(ctx: WorkerContext, request: VaeRequest) -> VaeReply:
    """ComfyUI's VAE Decode of the request's latent: rank 0 returns the IMAGE ([B, (T,) H, W, C], 0..1)."""
    return _run(ctx, request, decode=True)


@handler("vae_encode", VaeRequest)
def encode(ctx: WorkerContext, request: VaeRequest) -> VaeReply:
    """ComfyUI's VAE Encode of the request's image (cropped, channels first, -1..1): rank 0 returns the
    LATENT's samples (float32)."""
    return _run(ctx, request, decode=False)


__all__ = ["decode", "encode", "load"]
