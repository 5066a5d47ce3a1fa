"""Memory and communication planner: what each layout costs per GPU, and the `auto` choice.

For a FLUX model (FluxDims + dtype), an image size, a batch, a device count and the memory of one
device, every layout the engine accepts (`ParallelLayout.validate`) is priced:

* **weights** per GPU, exactly what the engine holds: parameter shapes of diffusers'
  FluxTransformer2DModel computed from the dims, sharded with the engine's own TP plan
  (`FLUX_TP_PLAN` + `shard_pieces`); context parallelism keeps a full copy;
* **collectives** per transformer forward (= one sampling step), exactly what the engine issues: our
  TP plan's fused all-reduces + one modulation all-gather, diffusers' K/V all-gathers (ring),
  all-to-alls (Ulysses) and output gather, with payloads and bytes sent per GPU (ring algorithms);
* **activations** per GPU: the peak of live tensors in one forward, a model of what is live in a
  single-stream block (see `activation_bytes`), checked against torch's MemTracker on the meta device;
* **communication buffers**: the collective outputs alive at the peak (the gathered K/V of the ring);
* **step time** from a deliberately simple cost model: compute / N + bytes sent / link bandwidth +
  latency x collectives. Nothing overlaps: neither our all-reduces nor diffusers' collectives do.

`ring_attention` is the classic ring-attention calculator (chunk = S/N, N steps, K/V passed around);
the ring layout's attention numbers reduce to it (see `attention_ring`).

All sizes are bytes; "GB" in text is 1e9 bytes. Pure arithmetic: no model is built, nothing is imported
that needs a device, so the client can plan before any worker starts.

The planner is a package split by job: `setup` (inputs), `shapes` (model shapes and weight bytes),
`cost` (collectives, activations, compute, the ranked estimates), `choice` (`auto`), `report` (table).
The names below are its public surface: `from .plan import choose, Setup, Link` keeps working.
"""

from __future__ import annotations

from ..text import GB
from .choice import Choice, choose
from .cost import (
    ATTENTION_BLOCK_FULL,
    ATTENTION_BLOCK_SHARDED,
    DOUBLE_BLOCK_FULL,
    RING_EXTRA_FULL_SEQUENCE,
    Collective,
    Estimate,
    RingAttention,
    activation_bytes,
    attention_ring,
    buffer_bytes,
    candidate_layouts,
    collectives,
    count_by_kind,
    cp_local_tokens,
    estimate,
    forward_flops,
    modulation_width,
    payload_by_kind,
    plan,
    ring_attention,
)
from .report import format_table
from .setup import FAMILIES, MARGIN, PCIE4, XGMI, Link, Setup
from .shapes import (
    TIMESTEP_CHANNELS,
    flux2_parameter_shapes,
    flux_parameter_shapes,
    parameter_shapes,
    weight_bytes,
)

__all__ = [
    "ATTENTION_BLOCK_FULL",
    "ATTENTION_BLOCK_SHARDED",
    "DOUBLE_BLOCK_FULL",
    "FAMILIES",
    "GB",
    "MARGIN",
    "PCIE4",
    "RING_EXTRA_FULL_SEQUENCE",
    "TIMESTEP_CHANNELS",
    "XGMI",
    "Choice",
    "Collective",
    "Estimate",
    "Link",
    "RingAttention",
    "Setup",
    "activation_bytes",
    "attention_ring",
    "buffer_bytes",
    "candidate_layouts",
    "choose",
    "collectives",
    "count_by_kind",
    "cp_local_tokens",
    "estimate",
    "flux2_parameter_shapes",
    "flux_parameter_shapes",
    "format_table",
    "forward_flops",
    "modulation_width",
    "parameter_shapes",
    "payload_by_kind",
    "plan",
    "ring_attention",
    "weight_bytes",
]
