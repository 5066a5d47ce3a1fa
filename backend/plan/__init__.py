"""Memory and communication planner: what each layout costs per GPU, and the `auto` choice.

For a model of a registered family (its name + ModelDims + dtype), an image size, a model call's batch
(`call_batch`: cond + uncond at cfg != 1), a device count and the memory of one device, every composition
batch x tp x ring x ulysses the engine accepts (`ParallelLayout.validate`) is priced, except batch
degrees above the call's batch (they would leave groups idle in every call):

* **weights** per GPU, exactly what the engine holds: the parameter shapes of the family's own diffusers
  model (built once on the meta device), sharded with the family's TP plan and the engine's
  `shard_pieces` over the tp degree; batch and context parallelism keep a full copy per group;
* **collectives** per transformer forward (= one sampling step), per mesh dimension, exactly what the
  engine issues: on tp the TP plan's all-reduces (counted from its data) + one modulation all-gather, on
  the rank's CP slice of the tokens; on ulysses the all-to-alls and on ring the K/V all-gathers of the
  heads TP left; on cp (ring x ulysses) diffusers' output gather; on batch the gather of the call's
  output; each with payloads and bytes sent per GPU (ring algorithms), for the busiest batch group;
* **activations** per GPU: the peak of live tensors in one forward, a model of what is live in a block
  with the family's measured units (see `activation_bytes`), checked against torch's MemTracker;
* **communication buffers**: the collective outputs alive at the peak (the gathered K/V of the ring);
* **step time** from a deliberately simple cost model: compute of the group's batch share / (tp x ring x
  ulysses) + bytes sent / link bandwidth + latency x collectives. Nothing overlaps: neither our
  all-reduces nor diffusers' collectives do. One link for every dimension (the mesh puts tp on
  neighbouring ranks, which this model does not credit).

`ring_attention` is the classic ring-attention calculator (chunk = S/N, N steps, K/V passed around);
the ring layout's attention numbers reduce to it (see `attention_ring`).

All sizes are bytes; "GB" in text is 1e9 bytes. Nothing needs a device: the model facts come from the
meta device (stored for the released models in facts.json, so `plan` never imports diffusers for them), so
the client plans before any worker starts.

The planner is a package split by job: `setup` (inputs), `shapes` (what the meta model says), `facts`
(the released models' facts as data), `cost` (collectives, activations, compute, the ranked estimates),
`choice` (`auto`), `report` (table).
The names below are its public surface: `from .plan import choose, Setup, Link` keeps working.
"""

from __future__ import annotations

from ..text import GB
from .choice import Choice, choose
from .cost import (
    RING_EXTRA_FULL_SEQUENCE,
    Collective,
    Estimate,
    RingAttention,
    activation_bytes,
    attention_ring,
    buffer_bytes,
    by_dimension,
    candidate_layouts,
    collectives,
    count_by_kind,
    cp_local_tokens,
    estimate,
    forward_flops,
    local_batch,
    modulation_width,
    payload_by_kind,
    plan,
    ring_attention,
)
from .report import format_table
from .setup import MARGIN, PCIE4, XGMI, Link, Setup, call_batch
from .shapes import ModelFacts, meta_model_facts, model_facts, weight_bytes

__all__ = [
    "GB",
    "MARGIN",
    "PCIE4",
    "RING_EXTRA_FULL_SEQUENCE",
    "XGMI",
    "Choice",
    "Collective",
    "Estimate",
    "Link",
    "ModelFacts",
    "RingAttention",
    "Setup",
    "activation_bytes",
    "attention_ring",
    "buffer_bytes",
    "by_dimension",
    "call_batch",
    "candidate_layouts",
    "choose",
    "collectives",
    "count_by_kind",
    "cp_local_tokens",
    "estimate",
    "format_table",
    "forward_flops",
    "local_batch",
    "meta_model_facts",
    "model_facts",
    "modulation_width",
    "payload_by_kind",
    "plan",
    "ring_attention",
    "weight_bytes",
]
