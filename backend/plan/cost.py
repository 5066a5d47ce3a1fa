"""The cost model: collectives, activations and compute of one forward per layout, and the ranked estimates.

`ring_attention` is the classic ring-attention calculator (chunk = S/N, N steps, K/V passed around);
the ring layout's attention numbers reduce to it (see `attention_ring`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from ..config import ConfigError, ModelDims, ParallelLayout, _one_of
from ..family import families, get_family
from ..text import GB
from .setup import Link, Setup
from .shapes import model_facts, split_inside_block, weight_bytes

# --------------------------------------------------------------------------------------------------
# Collectives per forward


@dataclass(frozen=True)
class Collective:
    """`count` collectives of one kind per forward over groups of `group` devices of mesh dimension `dim`
    (tp, ring, ulysses, batch, or cp: ring x ulysses flattened), `payload` bytes each.

    Payload as `CountCollectives` counts it: the input of an all-reduce or all-to-all, the gathered
    output of an all-gather.
    """

    kind: str
    count: int
    payload: int
    group: int
    what: str
    dim: str = ""

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


def by_dimension(comms: list[Collective]) -> dict[str, dict[str, float]]:
    """Per mesh dimension: collectives, payload bytes and bytes sent per GPU of one forward."""
    out: dict[str, dict[str, float]] = {}
    for c in comms:
        row = out.setdefault(c.dim, {"count": 0, "payload_bytes": 0, "sent_per_gpu": 0.0})
        row["count"] += c.count
        row["payload_bytes"] += c.count * c.payload
        row["sent_per_gpu"] += c.sent_per_gpu
    return out


def payload_by_kind(comms: list[Collective]) -> dict[str, int]:
    """Payload bytes per kind over all collectives of that kind (what CountCollectives reports)."""
    payload: dict[str, int] = {}
    for c in comms:
        payload[c.kind] = payload.get(c.kind, 0) + c.count * c.payload
    return payload


def modulation_width(dims: ModelDims, family: str | None = None) -> int:
    """Features of all AdaLN modulation vectors of one forward (the TP plan's single all-gather): the out
    features of the family's Gathered layers. FLUX.1: 12 x hidden per double block, 3 per single block and
    2 for the final layer; FLUX.2 shares its modulation: 6 + 6 + 3 + 2 x hidden, whatever the block counts.
    `family`: the first registered one when None.
    """
    return model_facts(family or families()[0].name, dims).modulation_width


def cp_local_tokens(setup: Setup, degree: int) -> tuple[int, bool]:
    """Tokens one rank holds under context parallelism, and whether padding was needed.

    The engine pads text and image separately to multiples of the degree (context.py `local_padding`)
    and then carries a validity channel in Q/K/V: head_dim + 1.
    """
    text_tokens = setup.text_tokens if setup.joint_text else 0  # cross-attended text is not split
    text = math.ceil(text_tokens / degree)
    image = math.ceil(setup.image_tokens / degree)
    padded = text_tokens % degree != 0 or setup.image_tokens % degree != 0
    return text + image, padded


def local_batch(setup: Setup, layout: ParallelLayout) -> int:
    """Entries of the call's batch the busiest group of the batch dimension computes (mesh.BatchSplit)."""
    return math.ceil(setup.batch / layout.batch)


def rank_tokens(setup: Setup, layout: ParallelLayout) -> tuple[int, bool]:
    """Tokens one rank's layers see (its CP slice, padded; all of them without CP), and whether padded."""
    return cp_local_tokens(setup, layout.cp) if layout.cp > 1 else (setup.tokens, False)


def collectives(setup: Setup, layout: ParallelLayout) -> list[Collective]:
    """Every collective one forward issues on one rank of the busiest batch group, by mesh dimension.

    Composition changes each dimension's payload: TP reduces only the rank's CP slice of the tokens and
    only its batch share; Ulysses and the ring move only the heads TP left the rank (heads / tp).
    """
    if layout.world_size == 1:
        return []
    dims, b = setup.dims, setup.bytes
    facts = model_facts(setup.family, dims)
    attentions = facts.attentions
    batch = local_batch(setup, layout)
    local, padded = rank_tokens(setup, layout)
    tp, r, u, cp = layout.tp, layout.ring, layout.ulysses, layout.cp
    out: list[Collective] = []
    if tp > 1:
        what = "row-parallel outputs (image and text streams fused)"
        out.append(
            Collective("all_reduce", facts.tp_all_reduces, batch * local * dims.hidden * b, tp, what, "tp")
        )
        if facts.norm_all_reduces:  # a sum of squares per token (float32) for each norm across heads
            payload = batch * local * 4
            out.append(Collective("all_reduce", facts.norm_all_reduces, payload, tp, "norm statistics", "tp"))
        if facts.modulation_width:
            payload = batch * facts.modulation_width * b
            out.append(Collective("all_gather", 1, payload, tp, "AdaLN modulation vectors", "tp"))
    heads = dims.heads // tp
    head_dim = dims.head_dim + int(padded)  # the validity channel of padded sequences
    if u > 1:
        payload = batch * local * heads * head_dim * b
        out.append(
            Collective("all_to_all", 4 * attentions, payload, u, "Ulysses Q, K, V and output", "ulysses")
        )
    if r > 1:
        # After Ulysses each rank has u x local tokens of heads/u; the ring gathers K and V of r of them.
        gathered = 2 * batch * (local * u) * (heads // u) * head_dim * b * r
        out.append(Collective("all_gather", attentions, gathered, r, "ring K/V", "ring"))
    if cp > 1:
        image = math.ceil(setup.image_tokens / cp) * cp
        payload = batch * image * dims.token_channels * b
        out.append(Collective("all_gather", 1, payload, cp, "output latent", "cp"))
    if layout.batch > 1:
        payload = layout.batch * batch * setup.latent_tokens * dims.token_channels * b
        out.append(Collective("all_gather", 1, payload, layout.batch, "output latent (batch)", "batch"))
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

    After Ulysses' all-to-all a rank holds S/ring tokens of hidden/(tp x ulysses) features (TP keeps
    heads/tp on a rank), and the ring runs over `ring` devices: the calculator with seq = padded S,
    d = hidden/(tp x ulysses), N = ring. diffusers
    gathers all K/V chunks at once (one all-gather) instead of passing them step by step: the same bytes
    (an all-gather sends N-1 chunks per device), but all of K and V are alive at once (`kv_buffer_bytes`).
    """
    local, padded = cp_local_tokens(setup, layout.cp)
    seq = local * layout.cp
    d = setup.dims.heads // layout.tp * (setup.dims.head_dim + int(padded)) // layout.ulysses
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
# * a sequence that does not divide by the context-parallel degree is padded, and Q, K and V then travel
#   with one more channel (context.py): copies of them live next to the originals, about 4 units of the
#   rank's tokens at the heads TP leaves it (calibrated with MemTracker on odd FLUX.1 and FLUX.2 sizes
#   under ring, Ulysses and TP x ring / Ulysses: within 10 %, where leaving it out was 12-21 % low).
PADDED_EXTRA = 4.0


def activation_bytes(setup: Setup, layout: ParallelLayout) -> float:
    """Peak live activation bytes on one rank during one forward (weights and kernel workspaces excluded),
    for the busiest group's share of the batch."""
    unit = local_batch(setup, layout) * setup.bytes * setup.dims.hidden
    tokens, padded = rank_tokens(setup, layout)
    units = get_family(setup.family).planner
    peak_attention = (units.attention_full + units.attention_sharded / layout.tp) * tokens
    if padded:
        peak_attention += PADDED_EXTRA * tokens / layout.tp
    peak = max(peak_attention, units.block_full * tokens) * unit
    if layout.ring > 1:
        sequence = attention_ring(setup, layout).seq
        peak += buffer_bytes(setup, layout) + RING_EXTRA_FULL_SEQUENCE * sequence * unit / layout.tp
    return peak


def buffer_bytes(setup: Setup, layout: ParallelLayout) -> float:
    """Collective outputs alive at the peak: the ring's gathered K/V (all chunks at once, see above)."""
    if layout.ring == 1:
        return 0.0
    ring = attention_ring(setup, layout)
    return local_batch(setup, layout) * 2 * ring.seq * ring.d * setup.bytes


# --------------------------------------------------------------------------------------------------
# Compute


def forward_flops(setup: Setup) -> float:
    """Dense FLOPs of one forward (all devices together): 2 x MACs of per-token linears + attention.

    The per-token MACs of every linear layer, by the tokens it reads (image, text or both), come from the
    family's meta model (shapes.model_facts); attention is QK^T and PV over the self-attended sequence (joint
    or image tokens), and over the text from the image tokens for a cross-attention.
    """
    facts = model_facts(setup.family, setup.dims)
    s, text, image = setup.tokens, setup.text_tokens, setup.image_tokens
    macs = image * facts.image_macs + text * facts.text_macs + (image + text) * facts.joint_macs
    attention_macs = (
        (facts.attentions * s * s + facts.cross_attentions * image * text) * 2 * setup.dims.hidden
    )
    return 2 * setup.batch * (macs + attention_macs)


# --------------------------------------------------------------------------------------------------
# Estimates


@dataclass(frozen=True)
class Estimate:
    """One layout priced for one setup: per-GPU bytes, the collectives of one forward, the step time."""

    layout: ParallelLayout
    weights: int
    activations: float
    buffers: float  # included in activations: the part that is collective outputs
    collectives: list[Collective] = field(default_factory=list)
    compute_s: float = 0.0
    comm_s: float = 0.0
    usable: float = 0.0
    batch: int = 1  # the model call's batch it was priced for

    @property
    def name(self) -> str:
        return str(self.layout)

    @property
    def local_batch(self) -> int:
        """Entries the busiest batch group computes per call."""
        return math.ceil(self.batch / self.layout.batch)

    @property
    def idle_groups(self) -> int:
        """Groups of the batch dimension with nothing to compute in such a call (the planner never picks
        a layout that has any)."""
        return max(0, self.layout.batch - self.batch)

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
            **self.layout.degrees,
            "devices": self.layout.world_size,
            "call_batch": self.batch,
            "local_batch": self.local_batch,
            "weights_gb": self.weights / GB,
            "activations_gb": self.activations / GB,
            "buffers_gb": self.buffers / GB,
            "per_gpu_gb": self.per_gpu / GB,
            "fits": self.fits,
            "collectives": [
                {
                    "dim": c.dim,
                    "kind": c.kind,
                    "count": c.count,
                    "payload_bytes": c.payload,
                    "group": c.group,
                    "what": c.what,
                }
                for c in self.collectives
            ],
            "per_dimension": {
                dim: {
                    "count": int(row["count"]),
                    "payload_bytes": int(row["payload_bytes"]),
                    "sent_per_gpu_gb": row["sent_per_gpu"] / GB,
                }
                for dim, row in by_dimension(self.collectives).items()
            },
            "sent_per_gpu_gb": self.sent_per_gpu / GB,
            "compute_s": self.compute_s,
            "comm_s": self.comm_s,
            "step_s": self.step_s,
        }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(
    dims: ModelDims, devices: int, batch: int | None = None, hosts: int = 1
) -> list[ParallelLayout]:
    """Every composition batch x tp x ring x ulysses of `devices` devices that ParallelLayout.validate
    accepts for these dims; with the call's `batch`, only batch degrees up to it (a larger one leaves
    groups idle in every call: never a plan); over several `hosts`, only those whose TP stays inside a host
    (`ParallelLayout.check_hosts`). Ordered by batch degree, then TP degree (largest first), then ring
    before Ulysses."""
    sizes = (devices // hosts,) * hosts
    found: list[ParallelLayout] = []
    for b in _divisors(devices):
        if batch is not None and b > batch:
            continue
        for tp in reversed(_divisors(devices // b)):
            cp = devices // (b * tp)
            for u in _divisors(cp):
                layout = ParallelLayout(batch=b, tp=tp, ring=cp // u, ulysses=u)
                try:
                    layout.validate(dims, devices=devices)
                    layout.check_hosts(sizes)
                except ConfigError:
                    continue
                found.append(layout)
    return found


# --------------------------------------------------------------------------------------------------
# Quantization blocks: a GGUF weight's rows are split only at whole blocks (checkpoint/gguf.py)


def block_split(setup: Setup, tp: int) -> tuple[str, int, int] | None:
    """Where TP of degree `tp` would cut a quantization block of the setup's weights (shapes.py
    `split_inside_block`), or None: every rank holds whole blocks."""
    if tp == 1:
        return None
    facts = model_facts(setup.family, setup.dims)
    blocks = setup.quantized_blocks({name: shape for name, shape, _, _ in facts.parameters})
    return split_inside_block(setup.dims, tp, setup.family, blocks)


def check_blocks(setup: Setup, layout: ParallelLayout) -> None:
    """ConfigError when `layout`'s TP degree would split a quantization block, naming the weight, where, and
    the TP degrees these devices can use instead (those of some layout of them that keep blocks whole)."""
    found = block_split(setup, layout.tp)
    if found is None:
        return
    name, edge, block = found
    usable = sorted(
        {
            c.tp
            for c in candidate_layouts(setup.dims, setup.devices, hosts=setup.hosts)
            if c.tp > 1 and block_split(setup, c.tp) is None
        }
    )
    use = (
        f"use tp {_one_of(usable)} on these {setup.devices} devices (with batch, ring or Ulysses for the rest: "
        f"e.g. '{_example(setup, usable[-1])}')"
        if usable
        else f"no tensor-parallel degree of these {setup.devices} devices keeps its blocks whole: use context "
        "parallelism (ring / Ulysses)"
    )
    raise ConfigError(
        f"layout {layout}: tp {layout.tp} would split the rows of '{name}' (stored in quantization blocks of "
        f"{block} values) at value {edge}, inside a block; each rank must hold whole blocks: {use}, or a file "
        "with smaller blocks (Q8_0, Q4_0: 32 values)"
    )


def _example(setup: Setup, tp: int) -> str:
    """A layout of the setup's devices with TP degree `tp` (the largest batch degree the call uses first)."""
    found = [c for c in candidate_layouts(setup.dims, setup.devices, setup.batch, setup.hosts) if c.tp == tp]
    return str(found[0] if found else ParallelLayout(tp=tp))


def link_for(setup: Setup, layout: ParallelLayout, dim: str) -> Link:
    """The link a collective of mesh dimension `dim` travels: the devices' own inside a host, the network
    between hosts when its groups span them. A host's network is shared by its ranks that send across it at
    once: one per group of the dimension on the host (the stride of its ranks), each ring crossing a host's
    boundary once each way. A simple model: it prices the bytes that stay inside a host at the network's
    speed too."""
    host = setup.host_devices
    if setup.hosts == 1 or not layout.crosses_hosts(dim, host):
        return setup.link
    network = setup.between_hosts
    degree = layout.cp if dim == "cp" else getattr(layout, dim)
    sharing = min(host, layout.extent(dim) // degree)
    return replace(network, gbps=network.gbps / sharing)


def estimate(setup: Setup, layout: ParallelLayout) -> Estimate:
    """Memory, bytes and step time of one layout on `setup`'s machine, for the setup's call batch.

    Each group of the batch dimension computes its share (the busiest: ceil(batch / degree) entries) on
    tp x ring x ulysses devices; every collective pays the link's latency and its bytes at its bandwidth.
    """
    layout.validate(setup.dims, devices=setup.devices)
    layout.check_hosts((setup.host_devices,) * setup.hosts)
    check_blocks(setup, layout)
    comms = collectives(setup, layout)
    comm_s = 0.0
    for c in comms:
        link = link_for(setup, layout, c.dim)
        comm_s += c.count * link.latency_us * 1e-6 + c.sent_per_gpu / (link.gbps * GB)
    share = local_batch(setup, layout) / setup.batch
    return Estimate(
        layout=layout,
        weights=weight_bytes(
            setup.dims,
            layout,
            setup.bytes,
            family=setup.family,
            linear_bytes=setup.linear_bytes,
            linear_bytes_of=setup.linear_bytes_of(),
        ),
        activations=activation_bytes(setup, layout),
        buffers=buffer_bytes(setup, layout),
        collectives=comms,
        compute_s=forward_flops(setup) * share / (layout.tp * layout.cp) / (setup.tflops * 1e12),
        comm_s=comm_s,
        usable=setup.usable_bytes,
        batch=setup.batch,
    )


def plan(setup: Setup, idle: bool = False) -> list[Estimate]:
    """Every composition the engine accepts for the setup, fastest predicted first (those that fit before
    those that don't); no batch degree above the call's batch unless `idle` (a caller that fixed one)."""
    candidates = candidate_layouts(setup.dims, setup.devices, None if idle else setup.batch, setup.hosts)
    # a GGUF file's TP degrees that would cut its quantization blocks are no plan (the loader refuses them)
    found = [estimate(setup, layout) for layout in candidates if block_split(setup, layout.tp) is None]
    return sorted(found, key=lambda e: (not e.fits, e.step_s))
