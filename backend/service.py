"""The sharded-model service: one transformer forward per call, the way ComfyUI's samplers call a model.

Where a ComfyUI-driven step runs: ComfyUI's sampler calls the proxy MODEL's diffusion model
(`nodes/comfy_model.py`), which calls `ParallelFlux.forward` (backend/api.py); that sends one `forward`
request to every rank, each rank runs `flux.forward.flux_call` on its shard in the resident layout (TP,
ring, Ulysses or both) and rank 0 returns the full output.

Conditioning (T5 tokens and CLIP pooled, and Kontext's reference latents) is the same for every step
of a job, often megabytes: the client sends it once under a key and every rank keeps it on its device,
so a step moves only the latent. The client finds a key by content (tensor equality), because ComfyUI builds new tensors with
the same values for each step. Both sides keep the same least-recently-used set of keys (they see the
same sequence of uses), and a rank that lacks a key says so and gets the tensors again.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .client import DEFAULT_WATCHDOG, Watchdog
from .family import family_of
from .worker import WorkerContext, handler

CONDITIONING_SLOTS = 4  # prompts kept per rank: a CFG batch, a second sampler, a refiner pass
# A forward has no step boundary to report from: its watchdog limit follows the slowest forward seen
# so far (a first one that compiles kernels gets the default), never below the step watchdog's floor.
PACE_FACTOR = 5.0


class ConditioningMissing(KeyError):
    """A rank does not hold the conditioning the client named (evicted, or the worker restarted)."""


class ConditioningSlots:
    """Least recently used key -> value, `CONDITIONING_SLOTS` long. The client and every rank make the
    same uses in the same order, so they evict the same keys."""

    def __init__(self, capacity: int = CONDITIONING_SLOTS) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[int, Any] = OrderedDict()

    def get(self, key: int) -> Any:
        value = self.entries.get(key)
        if value is not None:
            self.entries.move_to_end(key)
        return value

    def put(self, key: int, value: Any) -> None:
        self.entries[key] = value
        self.entries.move_to_end(key)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def forget(self, key: int) -> None:
        self.entries.pop(key, None)


_keys = itertools.count(1)


@dataclass
class ConditioningSender:
    """The client's side: which conditioning the ranks hold, found by content."""

    slots: ConditioningSlots = field(default_factory=ConditioningSlots)
    sent_bytes: int = 0  # conditioning bytes sent to the ranks so far (the benchmark and tests read it)

    def key_for(
        self, context: torch.Tensor, pooled: torch.Tensor, refs: Sequence[torch.Tensor] = ()
    ) -> tuple[int, bool]:
        """(key, whether the ranks hold it) for a prompt and its reference latents (Kontext). A new key
        records a copy of the tensors: equality with it is what makes a later step's freshly built
        tensors the same conditioning."""
        wanted = (context, pooled, *refs)
        for key, held in list(self.slots.entries.items()):
            if len(held) == len(wanted) and all(_same(h, t) for h, t in zip(held, wanted, strict=True)):
                self.slots.get(key)
                return key, True
        key = next(_keys)
        self.slots.put(key, tuple(t.detach().cpu().clone() for t in wanted))
        self.sent_bytes += sum(_nbytes(t) for t in wanted)
        return key, False

    def forget(self, key: int) -> None:
        self.slots.forget(key)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality: compared as 8-byte words, several times faster than a float comparison
    (and NaN equals itself, which a cache wants)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(_words(a), _words(b.detach().cpu().contiguous()))


def _words(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1).view(torch.uint8)
    return flat.view(torch.int64) if flat.numel() % 8 == 0 else flat


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class ForwardPace:
    """The longest forward so far, for the next forward's watchdog."""

    longest: float | None = None

    def watchdog(self) -> Watchdog:
        if self.longest is None:
            return DEFAULT_WATCHDOG
        return Watchdog(first=max(DEFAULT_WATCHDOG.floor, PACE_FACTOR * self.longest))

    def record(self, seconds: float) -> None:
        self.longest = max(self.longest or 0.0, seconds)


# --------------------------------------------------------------------------------------------------
# Worker side


def _slots(ctx: WorkerContext) -> ConditioningSlots:
    return ctx.resident.caches.setdefault("conditioning", ConditioningSlots())


@handler("flux_forward")
def forward(
    ctx: WorkerContext,
    x: torch.Tensor,
    timestep: torch.Tensor,
    cond_key: int,
    guidance: torch.Tensor | None = None,
    cond: dict[str, Any] | None = None,
    ref_method: str = "offset",
) -> dict[str, Any]:
    """One model call on the resident model: ComfyUI's Flux.forward(x, timestep, context, y, guidance,
    ref_latents, ref_latents_method=ref_method), run by the resident model's family (backend/family.py).

    `cond` carries the conditioning ({"context", "y", "ref_latents": [...]}) the first time `cond_key` is
    used; later calls name the key only. Rank 0 returns the output [B, C, H, W] in the model's dtype; the
    others return None.
    """
    model = ctx.resident.require()
    family = family_of(model)
    dtype = next(model.parameters()).dtype
    slots = _slots(ctx)
    if cond is not None:
        held = (cond["context"], cond["y"], *cond.get("ref_latents", ()))
        slots.put(cond_key, tuple(t.to(ctx.device, dtype) for t in held))
    conditioning = slots.get(cond_key)
    if conditioning is None:
        raise ConditioningMissing(f"conditioning {cond_key} is not held on rank {ctx.rank}")
    context, pooled, *refs = conditioning
    started = time.perf_counter()
    with torch.inference_mode():
        out = family.call(
            family.model_fn(model),
            x.to(ctx.device, dtype),
            timestep.to(ctx.device),
            context,
            pooled,
            guidance.to(ctx.device, dtype) if guidance is not None else None,
            ref_latents=refs,
            ref_method=ref_method,
        )
        out = out.cpu() if ctx.rank == 0 else None
    return {"rank": ctx.rank, "out": out, "seconds": time.perf_counter() - started}
