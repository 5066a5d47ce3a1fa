"""One rank of a patch-parallel VAE decode (or encode) on the meta device: the engine's own band code
(backend/vae/bands.py) under torch's `fake` process group, its peak of live tensors measured by torch's
MemTracker (weights excluded). Sizes no CPU here could decode (a 4096 px FLUX.1 decode on one rank needs
tens of GB) are measured this way; `bench vae` checks it against real CPU workers where those fit.

Lives outside the shipped package (the wheel has no `testing/`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..backend.vae.bands import BandParallel, Bands
from ..backend.vae.images import decoded_image
from ..backend.vae.kind import VaeKind
from ..backend.vae.load import build_vae
from .fake import fake_process_group
from .meta import flash_attention_on_meta


def measure_vae_on_meta(
    kind: VaeKind,
    config: dict[str, Any],
    width: int,
    height: int,
    *,
    ranks: int,
    rank: int = 0,
    batch: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    encode: bool = False,
) -> dict[str, float]:
    """Peak live activation bytes of `rank`'s band (and, on rank 0, the gathered image) for one decode of a
    `width` x `height` px image (`encode`: one encode), weights excluded; and the rank's band rows."""
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.set_flush_denormal(True)
    rows = height // kind.downscale
    bands = Bands.even(rows, ranks)
    with fake_process_group(ranks, rank=rank):
        model = build_vae(kind, config, "meta", dtype)
        for p in model.parameters():
            p.requires_grad_(True)  # MemTracker tracks parameters by their gradients' hooks
        if encode:
            x = torch.empty(batch, 3, height, width, device="meta", dtype=dtype)
        else:
            x = torch.empty(batch, kind.latent_channels(config), rows, width // kind.downscale, device="meta",
                            dtype=dtype)  # fmt: skip
        if kind.frames:
            x = x.unsqueeze(2)
        tracker = MemTracker()
        tracker.track_external(model)
        with flash_attention_on_meta(), tracker, torch.no_grad():
            if not encode:
                x = kind.to_model(model, x)
            band = bands.take(x, rank, x.shape[-2] // rows).contiguous()
            del x
            with BandParallel(bands) as mode:
                out = kind.encode(model, band) if encode else kind.decode(model, band)
            if encode:
                out = kind.from_model(model, out)
            whole = mode.gather(out)
            del out
            if whole is not None and not encode:
                whole = decoded_image(whole)
            del whole
        peak = tracker.get_tracker_snapshot("peak")[torch.device("meta")]
    activations = sum(v for k, v in peak.items() if "ACT" in str(k) or "TEMP" in str(k))
    return {"activations": float(activations), "rows": float(bands.height(rank))}


__all__ = ["measure_vae_on_meta"]
