"""The cost model: collectives, activations and compute of one forward per layout, and the ranked estimates.

`ring_attention` is the classic ring-attention calculator (chunk = S/N, N steps, K/V passed around);
the ring layout's attention numbers reduce to it (see `attention_ring`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..config import ConfigError, FluxDims, ParallelLayout
from ..family import get_family
from ..text import GB
from .setup import Setup
from .shapes import model_facts, weight_bytes

# --------------------------------------------------------------------------------------------------
# Collectives per forward


@dataclass(frozen=True)
class Collective:
    """`count` collectives of one kind per forward over groups of `group` devices, `payload` bytes each.

    Payload as `CountCollectives` counts it: the input of an all-reduce or all-to-all, the gathered
    output of an all-gather.
    """

    kind: str
    count: int
    payload: int
    group: int
    what: str

    @property
    def sent_per_gpu(self) -> float:
        """Bytes one device sends for all of them with ring algorithms."""
        n = self.group
        factor = 2 * (n - 1) / n if self.kind == "all_reduce" else (n - 1) / n
        return self.count * self.payload * factor


def count_by_kind(comms: list[Collective]) -> dict[str, int]:
    """Collectives per kind ('all_reduce': 76, ...), in the order the kinds first appear."""
    counts: dict[str, int] = {}
    for c in comms:
        counts[c.kind] = counts.get(c.kind, 0) + c.count
    return counts


def payload_by_kind(comms: list[Collective]) -> dict[str, int]:
    """Payload bytes per kind over all collectives of that kind (what CountCollectives reports)."""
    payload: dict[str, int] = {}
    for c in comms:
        payload[c.kind] = payload.get(c.kind, 0) + c.count * c.payload
    return payload


def modulation_width(dims: FluxDims, family: str = "flux1") -> int:
    """Features of all AdaLN modulation vectors of one forward (the TP plan's single all-gather): the out
    features of the family's Gathered layers. FLUX.1: 12 x hidden per double block, 3 per single block and
    2 for the final layer; FLUX.2 shares its modulation: 6 + 6 + 3 + 2 x hidden, whatever the block counts.
    """
    return model_facts(family, dims).modulation_width


def cp_local_tokens(setup: Setup, degree: int) -> tuple[int, bool]:
    """Tokens one rank holds under context parallelism, and whether padding was needed.

    The engine pads text and image separately to multiples of the degree (context.py `local_padding`)
    and then carries a validity channel in Q/K/V: head_dim + 1.
    """
    text = math.ceil(setup.text_tokens / degree)
    image = math.ceil(setup.image_tokens / degree)
    padded = setup.text_tokens % degree != 0 or setup.image_tokens % degree != 0
    return text + image, padded


def collectives(setup: Setup, layout: ParallelLayout) -> list[Collective]:
    """Every collective one forward issues on one rank, grouped by kind and purpose."""
    dims, b, batch = setup.dims, setup.bytes, setup.batch
    facts = model_facts(setup.family, dims)
    attentions = facts.attentions
    if layout.world_size == 1:
        return []
    if layout.tp > 1:
        activation = batch * setup.tokens * dims.hidden * b
        out = [
            Collective(
                "all_reduce",
                facts.tp_all_reduces,
                activation,
                layout.tp,
                "row-parallel outputs (image and text streams fused)",
            )
        ]
        if facts.modulation_width:
            out.append(
                Collective(
                    "all_gather",
                    1,
                    batch * facts.modulation_width * b,
                    layout.tp,
                    "AdaLN modulation vectors",
                )
            )
        return out
    n, r, u = layout.world_size, layout.ring, layout.ulysses
    local, padded = cp_local_tokens(setup, n)
    qkv_width = dims.heads * (dims.head_dim + int(padded))
    out: list[Collective] = []
    if u > 1:
        out.append(
            Collective(
                "all_to_all", 4 * attentions, batch * local * qkv_width * b, u, "Ulysses Q, K, V and output"
            )
        )
    if r > 1:
        # After Ulysses each rank has u x local tokens of heads/u; the ring gathers K and V of r of them.
        gathered = 2 * batch * (local * n) * (qkv_width // u) * b
        out.append(Collective("all_gather", attentions, gathered, r, "ring K/V"))
    image_local = math.ceil(setup.image_tokens / n)
    out.append(
        Collective("all_gather", 1, batch * image_local * n * dims.in_channels * b, n, "output latent")
    )
    return out


# --------------------------------------------------------------------------------------------------
# Ring-attention calculator (the classic one) and the ring layout's attention in its terms


@dataclass(frozen=True)
class RingAttention:
    """Classic ring attention for one attention of S tokens x d features on N devices.

    Each device keeps its Q chunk and, at any time, one K and one V chunk; N steps, passing K and V on.
    """

    seq: int
    d: int
    bytes: int
    devices: int
    chunk: float
    steps: int
    per_gpu_bytes: float
    per_step_bytes: float
    total_bytes: float
    memory_savings: float


def ring_attention(seq: int, d: int, dtype_bytes: int, devices: int) -> RingAttention:
    chunk = seq / devices
    per_gpu = chunk * d * dtype_bytes * 3  # Q, K and V chunks
    per_step = 2 * chunk * d * dtype_bytes  # a K and a V chunk to the next device
    return RingAttention(
        seq=seq,
        d=d,
        bytes=dtype_bytes,
        devices=devices,
        chunk=chunk,
        steps=devices,
        per_gpu_bytes=per_gpu,
        per_step_bytes=per_step,
        total_bytes=per_step * (devices - 1),
        memory_savings=1 - per_gpu / (3 * seq * d * dtype_bytes),
    )


def attention_ring(setup: Setup, layout: ParallelLayout) -> RingAttention:
    """One attention of `layout` in the calculator's terms (per batch entry).

    After Ulysses' all-to-all a rank holds S/ring tokens of hidden/ulysses features, and the ring runs
    over `ring` devices: the calculator with seq = padded S, d = hidden/ulysses, N = ring. diffusers
    gathers all K/V chunks at once (one all-gather) instead of passing them step by step: the same bytes
    (an all-gather sends N-1 chunks per device), but all of K and V are alive at once (`kv_buffer_bytes`).
    """
    local, padded = cp_local_tokens(setup, layout.ring * layout.ulysses)
    seq = local * layout.ring * layout.ulysses
    d = setup.dims.heads * (setup.dims.head_dim + int(padded)) // layout.ulysses
    return ring_attention(seq, d, setup.bytes, layout.ring)


# --------------------------------------------------------------------------------------------------
# Activations


# Live activations at a forward's peak, in units of (batch x tokens x hidden x bytes) per rank, where the
# tokens are the rank's own (all of them under TP). The units of a family's blocks are its own measured
# `PlannerFacts` (its folder's family.py says how they were calibrated):
#
# * peak 1, inside a single-stream block's attention: `attention_full` units TP never shards (the block
#   input, its concatenation and norm, RoPE tables) + `attention_sharded` units TP splits (q/k/v, the MLP);
# * peak 2, in the fused double-stream block when TP has shrunk peak 1: `block_full` units (row-parallel
#   partial sums, their concatenation, both residual streams), whatever the TP degree;
# * ring attention adds the gathered K and V of the whole sequence (2 x S x hidden/ulysses: diffusers
#   gathers every chunk at once) and one more full-sequence unit that MemTracker sees alive through the
#   ring loop (calibrated on FLUX.1: ring 2, 4, 8 and ring x Ulysses 2x2, 2x4, 4x2 within 10 %; on FLUX.2
#   within 4 %).
RING_EXTRA_FULL_SEQUENCE = 1.0


def activation_bytes(setup: Setup, layout: ParallelLayout) -> float:
    """Peak live activation bytes on one rank during one forward (weights and kernel workspaces excluded)."""
    unit = setup.batch * setup.bytes * setup.dims.hidden
    if layout.tp > 1 or layout.world_size == 1:
        tokens = setup.tokens
    else:
        tokens = cp_local_tokens(setup, layout.world_size)[0]
    units = get_family(setup.family).planner
    peak_attention = (units.attention_full + units.attention_sharded / layout.tp) * tokens
    peak = max(peak_attention, units.block_full * tokens) * unit
    if layout.ring > 1:
        sequence = attention_ring(setup, layout).seq
        peak += buffer_bytes(setup, layout) + RING_EXTRA_FULL_SEQUENCE * sequence * unit
    return peak


def buffer_bytes(setup: Setup, layout: ParallelLayout) -> float:
    """Collective outputs alive at the peak: the ring's gathered K/V (all chunks at once, see above)."""
    if layout.ring == 1:
        return 0.0
    ring = attention_ring(setup, layout)
    return setup.batch * 2 * ring.seq * ring.d * setup.bytes


# --------------------------------------------------------------------------------------------------
# Compute


def forward_flops(setup: Setup) -> float:
    """Dense FLOPs of one forward (all devices together): 2 x MACs of per-token linears + attention.

    The per-token MACs of every linear layer, by the tokens it reads (image, text or both), come from the
    family's meta model (shapes.model_facts); attention is QK^T and PV over the joint sequence.
    """
    facts = model_facts(setup.family, setup.dims)
    s, text, image = setup.tokens, setup.text_tokens, setup.image_tokens
    macs = image * facts.image_macs + text * facts.text_macs + s * facts.joint_macs
    attention_macs = facts.attentions * 2 * s * s * setup.dims.hidden  # QK^T and PV
    return 2 * setup.batch * (macs + attention_macs)


# --------------------------------------------------------------------------------------------------
# Estimates


@dataclass(frozen=True)
class Estimate:
    layout: ParallelLayout
    weights: int
    activations: float
    buffers: float  # included in activations: the part that is collective outputs
    collectives: list[Collective] = field(default_factory=list)
    compute_s: float = 0.0
    comm_s: float = 0.0
    usable: float = 0.0

    @property
    def name(self) -> str:
        return str(self.layout)

    @property
    def per_gpu(self) -> float:
        return self.weights + self.activations

    @property
    def fits(self) -> bool:
        return self.per_gpu <= self.usable

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def sent_per_gpu(self) -> float:
        return sum(c.sent_per_gpu for c in self.collectives)

    @property
    def collective_count(self) -> int:
        return sum(c.count for c in self.collectives)

    def as_dict(self) -> dict[str, Any]:
        return {
            "layout": self.name,
            "tp": self.layout.tp,
            "ring": self.layout.ring,
            "ulysses": self.layout.ulysses,
            "weights_gb": self.weights / GB,
            "activations_gb": self.activations / GB,
            "buffers_gb": self.buffers / GB,
            "per_gpu_gb": self.per_gpu / GB,
            "fits": self.fits,
            "collectives": [
                {
                    "kind": c.kind,
                    "count": c.count,
                    "payload_bytes": c.payload,
                    "group": c.group,
                    "what": c.what,
                }
                for c in self.collectives
            ],
            "sent_per_gpu_gb": self.sent_per_gpu / GB,
            "compute_s": self.compute_s,
            "comm_s": self.comm_s,
            "step_s": self.step_s,
        }


def candidate_layouts(dims: FluxDims, devices: int) -> list[ParallelLayout]:
    """Every layout of `devices` devices that ParallelLayout.validate accepts for these dims."""
    options = [ParallelLayout(tp=devices)] + [
        ParallelLayout(ring=devices // u, ulysses=u) for u in range(1, devices + 1) if devices % u == 0
    ]
    valid: list[ParallelLayout] = []
    for layout in options:
        try:
            layout.validate(dims, devices=devices)
        except ConfigError:
            continue
        if layout not in valid:
            valid.append(layout)
    return valid


def estimate(setup: Setup, layout: ParallelLayout) -> Estimate:
    """Memory, bytes and step time of one layout on `setup`'s machine."""
    layout.validate(setup.dims, devices=setup.devices)
    comms = collectives(setup, layout)
    link = setup.link
    comm_s = sum(c.count * link.latency_us * 1e-6 for c in comms) + sum(c.sent_per_gpu for c in comms) / (
        link.gbps * GB
    )
    return Estimate(
        layout=layout,
        weights=weight_bytes(
            setup.dims, layout, setup.bytes, family=setup.family, linear_bytes=setup.linear_bytes
        ),
        activations=activation_bytes(setup, layout),
        buffers=buffer_bytes(setup, layout),
        collectives=comms,
        compute_s=forward_flops(setup) / layout.world_size / (setup.tflops * 1e12),
        comm_s=comm_s,
        usable=setup.usable_bytes,
    )


def plan(setup: Setup) -> list[Estimate]:
    """Every valid layout for the setup, fastest predicted first (those that fit before those that don't)."""
    found = [estimate(setup, layout) for layout in candidate_layouts(setup.dims, setup.devices)]
    return sorted(found, key=lambda e: (not e.fits, e.step_s))
