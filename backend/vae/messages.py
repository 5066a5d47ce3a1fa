"""What the caller and the workers say about a VAE (backend/vae/jobs.py serves them).

| method (backend/vae/jobs.py) | request          | reply                                  |
|------------------------------|------------------|----------------------------------------|
| vae_load                     | VaeLoadRequest   | LoadReport (resident/messages.py)      |
| vae_decode, vae_encode       | VaeRequest       | VaeReply (rank 0: the image / latent)  |

A `VaeLoadRequest` is a resident module request (resident/group.py `ResidentGroup.hold`): it names its
slot, its load method and the bytes of weights it puts on each rank, so the group keeps it beside the diffusion
models and evicts by the same rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..runtime.transport import record

VAE_SLOT = "vae"  # the group's slot for a VAE (one VAE resident at a time; loading another replaces it)


@record
@dataclass(frozen=True)
class VaeLoadRequest:
    """Make the VAE in `checkpoint` (a safetensors file as ComfyUI's VAELoader reads it) resident on every
    rank in `dtype`: each rank reads the file itself. `kind` names its `VaeKind`, `config` the diffusers
    config the caller derived from the header; `weight_bytes` is what each rank holds (all of it: the VAE
    is small, every rank keeps a whole copy)."""

    checkpoint: str
    kind: str
    config: dict[str, Any] = field(hash=False)
    dtype: str
    weight_bytes: int = 0
    slot: str = VAE_SLOT
    load_method: str = "vae_load"

    def describe(self) -> str:
        """The panel's layout column for a resident VAE."""
        return f"VAE, {self.dtype}, bands"


@record
@dataclass(frozen=True)
class VaeRequest:
    """Decode `x` (ComfyUI's LATENT samples) or encode it (ComfyUI's IMAGE, already cropped, channels first,
    in -1..1) with the VAE resident in `slot`, the latent's rows split at `starts` (one band per rank)."""

    x: torch.Tensor
    starts: tuple[int, ...]
    slot: str = VAE_SLOT


@record
@dataclass(frozen=True)
class VaeReply:
    rank: int
    out: torch.Tensor | None  # rank 0: the whole image (decode, ComfyUI's IMAGE) or latent (encode)
    seconds: float
    # GPU: torch.cuda.max_memory_allocated during the job (weights included). CPU: the peak of tensor storage
    # bytes the job created and held at once (weights and input excluded; peak.py LiveBytes)
    peak_bytes: int = 0
    rss_rise_bytes: int = 0  # CPU: the resident set's high-water mark over its start (peak.py); GPU: 0


__all__ = ["VAE_SLOT", "VaeLoadRequest", "VaeReply", "VaeRequest"]
