"""The meta-device tracer for FLUX.2: one rank of a layout, one forward, weights / activations / collectives.

FLUX.2's counterpart of `helpers.measure_on_meta` (which builds FLUX.1); the same method: the fake process
group, torch's MemTracker, and the CPU flash kernel standing in for the GPUs' (no score matrix).
"""

from __future__ import annotations

from typing import Any

import torch

from ..backend.config import FluxDims, ParallelLayout
from ..backend.flux2.model import build_flux2, random_flux2_inputs
from ..backend.parallel.comm import CountCollectives
from ..backend.parallel.context import apply_context_parallel
from ..backend.parallel.fake import fake_process_group
from ..backend.parallel.tensor import apply_tensor_parallel
from .helpers import flash_attention_on_meta, local_parameter_bytes


def measure_flux2_on_meta(
    config: dict[str, Any],
    layout: ParallelLayout,
    width: int,
    height: int,
    batch: int = 1,
    text_tokens: int = 512,
    dtype: torch.dtype = torch.bfloat16,
    rank: int = 0,
) -> dict[str, Any]:
    """Rank `rank` of `layout` for a width x height image (one token per 16 x 16 pixels)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.set_flush_denormal(True)
    dims = FluxDims.from_diffusers_config(config)
    with fake_process_group(layout.world_size, rank=rank):
        model = build_flux2(config, device="meta", dtype=dtype)
        if layout.tp > 1:
            apply_tensor_parallel(model)
        if layout.ring * layout.ulysses > 1:
            apply_context_parallel(model, layout.ring, layout.ulysses)
        weights = local_parameter_bytes(model)
        inputs = random_flux2_inputs(dims, batch, height // 16, width // 16, text_tokens, device="meta").to(
            "meta", dtype
        )
        for p in model.parameters():
            p.requires_grad_(True)  # MemTracker hooks every parameter's gradient
        tracker = MemTracker()
        tracker.track_external(model)
        with flash_attention_on_meta(), tracker, CountCollectives() as counter, torch.no_grad():
            model(**inputs.as_kwargs(), return_dict=False)
        peak = tracker.get_tracker_snapshot("peak")[torch.device("meta")]
    return {
        "weights": weights,
        "activations": sum(v for k, v in peak.items() if "ACT" in str(k) or "TEMP" in str(k)),
        "counts": dict(counter.log.counts),
        "payload": dict(counter.log.payload_bytes),
        "image_tokens": inputs.hidden_states.shape[1],
    }
