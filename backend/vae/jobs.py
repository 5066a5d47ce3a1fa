"""The worker methods of a resident VAE: load it into its slot, decode a latent, encode an image (every rank
its band of rows, bands.py; rank 0 returns the whole result).

The VAE is a resident module like a diffusion model (runtime/worker.py `Resident`, one slot): it is loaded by
the job skeleton every resident model shares (resident/jobs.py `load_slot`), `status`, `unload` and
`unload_slot` see it, and the caller's `ResidentGroup` evicts it by the same rule.
"""

from __future__ import annotations

import contextlib
import time

import torch

from ..resident.jobs import held, load_slot
from ..resident.messages import LoadReport
from ..runtime.worker import WorkerContext, handler
from .bands import BandParallel, Bands
from .images import decoded_image
from .kind import VaeKind, get_vae_kind
from .load import load_vae
from .messages import VaeLoadRequest, VaeReply, VaeRequest
from .peak import LiveBytes, ResidentHighWater


@handler("vae_load", VaeLoadRequest)
def load(ctx: WorkerContext, request: VaeLoadRequest) -> LoadReport:
    """Make the request's VAE resident in its slot (a no-op when it already is)."""
    return load_slot(
        ctx, request.slot, request, lambda: (load_vae(request, ctx.device, progress=ctx.load_progress), {})
    )


def _run(ctx: WorkerContext, request: VaeRequest, decode: bool) -> VaeReply:
    model, loaded = held(ctx, request.slot, VaeLoadRequest, "VAE")
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
