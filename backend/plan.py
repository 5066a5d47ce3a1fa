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
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from .config import ConfigError, FluxDims, ParallelLayout

GB = 1e9
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
TIMESTEP_CHANNELS = 256  # diffusers' Timesteps(num_channels=256) in FLUX's time/guidance embedders
MARGIN = 0.10  # of device memory kept free: allocator fragmentation, RCCL/NCCL buffers, runtime context


# --------------------------------------------------------------------------------------------------
# The setup


@dataclass(frozen=True)
class Link:
    """The link between devices as the cost model sees it: per-GPU bus bandwidth and per-collective latency.

    Bus bandwidth as nccl-tests defines it: an all-reduce of P bytes on N devices moves 2(N-1)/N x P per
    device, so time = latency + that / bandwidth.
    """

    gbps: float  # GB/s per device
    latency_us: float = 30.0
    measured: bool = False
    name: str = "link"

    def describe(self) -> str:
        return f"{self.name} {self.gbps:.0f} GB/s {'measured' if self.measured else 'assumed'}"


PCIE4 = Link(24.0, 30.0, name="PCIe 4.0 x16")
XGMI = Link(300.0, 10.0, name="xGMI / NVLink")


@dataclass(frozen=True)
class Setup:
    """One generation job on one machine: what the planner needs to price a layout."""

    dims: FluxDims
    width: int = 1024
    height: int = 1024
    batch: int = 1
    text_tokens: int = 256  # ComfyUI pads T5 to 256 tokens; longer prompts use more (diffusers: 512)
    dtype: str = "bfloat16"
    devices: int = 1
    memory_gb: float = 24.0  # per device
    link: Link = PCIE4
    tflops: float = 100.0  # sustained dense bf16 throughput of one device
    margin: float = MARGIN

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"dtype={self.dtype!r} is not supported; use {', '.join(DTYPE_BYTES)}")
        if self.width % 16 or self.height % 16 or self.width < 16 or self.height < 16:
            raise ConfigError(
                f"image size {self.width}x{self.height} is not a multiple of 16 pixels; use e.g. 1024x1024"
            )
        for name in ("batch", "devices", "text_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if self.memory_gb <= 0 or self.link.gbps <= 0 or self.tflops <= 0:
            raise ConfigError(
                f"memory_gb={self.memory_gb}, link {self.link.gbps} GB/s and tflops={self.tflops} "
                "must all be positive"
            )

    @property
    def bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def image_tokens(self) -> int:
        return (self.width // 16) * (self.height // 16)

    @property
    def tokens(self) -> int:
        return self.image_tokens + self.text_tokens

    @property
    def usable_bytes(self) -> float:
        return self.memory_gb * GB * (1 - self.margin)


# --------------------------------------------------------------------------------------------------
# Weights: diffusers' parameter shapes from the dims, sharded with the engine's own plan


def flux_parameter_shapes(dims: FluxDims) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of diffusers' FluxTransformer2DModel with these dims.

    Written out instead of building the model so the client can plan without diffusers; the test checks
    it equals the state dict of a meta model, name for name.
    """
    d, m, hd = dims.hidden, dims.mlp, dims.head_dim
    ff = 4 * d  # diffusers' FeedForward(mult=4) in the double blocks, whatever mlp_ratio says
    shapes: dict[str, tuple[int, ...]] = {}

    def linear(name: str, fan_in: int, fan_out: int) -> None:
        shapes[f"{name}.weight"] = (fan_out, fan_in)
        shapes[f"{name}.bias"] = (fan_out,)

    embedders = ["timestep_embedder"] + (["guidance_embedder"] if dims.guidance else [])
    for emb in embedders:
        linear(f"time_text_embed.{emb}.linear_1", TIMESTEP_CHANNELS, d)
        linear(f"time_text_embed.{emb}.linear_2", d, d)
    linear("time_text_embed.text_embedder.linear_1", dims.pooled_dim, d)
    linear("time_text_embed.text_embedder.linear_2", d, d)
    linear("context_embedder", dims.text_dim, d)
    linear("x_embedder", dims.in_channels, d)
    for i in range(dims.double_blocks):
        p = f"transformer_blocks.{i}"
        linear(f"{p}.norm1.linear", d, 6 * d)
        linear(f"{p}.norm1_context.linear", d, 6 * d)
        for norm in ("norm_q", "norm_k"):
            shapes[f"{p}.attn.{norm}.weight"] = (hd,)
        for proj in ("to_q", "to_k", "to_v"):
            linear(f"{p}.attn.{proj}", d, d)
        linear(f"{p}.attn.to_out.0", d, d)
        for norm in ("norm_added_q", "norm_added_k"):
            shapes[f"{p}.attn.{norm}.weight"] = (hd,)
        for proj in ("add_q_proj", "add_k_proj", "add_v_proj"):
            linear(f"{p}.attn.{proj}", d, d)
        linear(f"{p}.attn.to_add_out", d, d)
        for stream in ("ff", "ff_context"):
            linear(f"{p}.{stream}.net.0.proj", d, ff)
            linear(f"{p}.{stream}.net.2", ff, d)
    for i in range(dims.single_blocks):
        p = f"single_transformer_blocks.{i}"
        linear(f"{p}.norm.linear", d, 3 * d)
        linear(f"{p}.proj_mlp", d, m)
        linear(f"{p}.proj_out", d + m, d)
        for norm in ("norm_q", "norm_k"):
            shapes[f"{p}.attn.{norm}.weight"] = (hd,)
        for proj in ("to_q", "to_k", "to_v"):
            linear(f"{p}.attn.{proj}", d, d)
    linear("norm_out.linear", d, 2 * d)
    linear("proj_out", d, dims.in_channels)
    return shapes


def weight_bytes(dims: FluxDims, layout: ParallelLayout, dtype_bytes: int, rank: int = 0) -> int:
    """Parameter bytes one rank holds in `layout`: a TP shard, or the full model under context parallelism."""
    from .parallel.tensor import FLUX_TP_PLAN, _pattern, shard_pieces

    shapes = flux_parameter_shapes(dims)
    if layout.tp == 1:
        return dtype_bytes * sum(math.prod(s) for s in shapes.values())
    patterns = [(_pattern(k), split) for k, split in FLUX_TP_PLAN.items()]
    total = 0
    for name, shape in shapes.items():
        module, _, param = name.rpartition(".")
        split = next((s for rx, s in patterns if rx.match(module)), None)
        pieces = None if split is None else shard_pieces(split, param, shape, rank, layout.tp, dims)
        total += math.prod(shape if pieces is None else pieces.shape(shape))
    return dtype_bytes * total


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


def modulation_width(dims: FluxDims) -> int:
    """Features of all AdaLN modulation vectors of one forward (the TP plan's single all-gather)."""
    d = dims.hidden
    return dims.double_blocks * 12 * d + dims.single_blocks * 3 * d + 2 * d


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
    attentions = dims.double_blocks + dims.single_blocks
    if layout.world_size == 1:
        return []
    if layout.tp > 1:
        activation = batch * setup.tokens * dims.hidden * b
        return [
            Collective(
                "all_reduce",
                2 * dims.double_blocks + dims.single_blocks,
                activation,
                layout.tp,
                "row-parallel outputs (image and text streams fused)",
            ),
            Collective(
                "all_gather", 1, batch * modulation_width(dims) * b, layout.tp, "AdaLN modulation vectors"
            ),
        ]
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
# tokens are the rank's own (all of them under TP). Calibrated with torch's MemTracker on the meta device
# (the GPU's flash attention standing in, no score matrix), bf16; a FLUX with 24 heads x 16 and FLUX.1-dev
# gave the same units to 1 % (see `bench planner` and BENCHMARKS.md "Planner vs measurement").
#
# * Peak 1, inside a single-stream block's attention (RoPE): the block input, its concatenation and its
#   norm at full width, never sharded (3 + 0.35 for RoPE tables and norms), plus the MLP branch (4 x
#   hidden: projection and GELU), q/k/v and their float32 norm/RoPE temporaries: 14 units, which TP splits.
# * Peak 2, in the fused double-stream block when TP has shrunk peak 1: the row-parallel partial sums,
#   their concatenation for the one all-reduce, the bias-added outputs and both residual streams, all at
#   full width: 8.35 units whatever the TP degree (measured at TP 4 and 8).
# * Ring attention adds the gathered K and V of the whole sequence (2 x S x hidden/ulysses: diffusers
#   gathers every chunk at once) and one more full-sequence unit that MemTracker sees alive through the
#   ring loop (calibrated: ring 2, 4, 8 and ring x Ulysses 2x2, 2x4, 4x2 within 10 %).
ATTENTION_BLOCK_FULL = 3.35
ATTENTION_BLOCK_SHARDED = 14.0
DOUBLE_BLOCK_FULL = 8.35
RING_EXTRA_FULL_SEQUENCE = 1.0


def activation_bytes(setup: Setup, layout: ParallelLayout) -> float:
    """Peak live activation bytes on one rank during one forward (weights and kernel workspaces excluded)."""
    unit = setup.batch * setup.bytes * setup.dims.hidden
    if layout.tp > 1 or layout.world_size == 1:
        tokens = setup.tokens
    else:
        tokens = cp_local_tokens(setup, layout.world_size)[0]
    peak_attention = (ATTENTION_BLOCK_FULL + ATTENTION_BLOCK_SHARDED / layout.tp) * tokens
    peak = max(peak_attention, DOUBLE_BLOCK_FULL * tokens) * unit
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
    """Dense FLOPs of one forward (all devices together): 2 x MACs of per-token linears + attention."""
    dims = setup.dims
    d, m, s, text, image = dims.hidden, dims.mlp, setup.tokens, setup.text_tokens, setup.image_tokens
    per_stream = 4 * d * d + 2 * d * 4 * d  # q, k, v, out + feed-forward, on each token of its stream
    macs = image * dims.in_channels * d + text * dims.text_dim * d + image * d * dims.in_channels
    macs += dims.double_blocks * s * per_stream
    macs += dims.single_blocks * s * (3 * d * d + d * m + (d + m) * d)
    attention_macs = (dims.double_blocks + dims.single_blocks) * 2 * s * s * d  # QK^T and PV
    return 2 * setup.batch * (macs + attention_macs)


# --------------------------------------------------------------------------------------------------
# Estimates


def layout_name(layout: ParallelLayout) -> str:
    if layout.world_size == 1:
        return "single"
    if layout.tp > 1:
        return f"tp={layout.tp}"
    parts = [f"ring={layout.ring}"] if layout.ring > 1 else []
    parts += [f"ulysses={layout.ulysses}"] if layout.ulysses > 1 else []
    return " x ".join(parts)


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
        return layout_name(self.layout)

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
        weights=weight_bytes(setup.dims, layout, setup.bytes),
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


# --------------------------------------------------------------------------------------------------
# auto


@dataclass(frozen=True)
class Choice:
    layout: ParallelLayout
    explanation: str
    estimates: list[Estimate]


def _gb(n: float) -> str:
    return f"{n / GB:.1f}"


def choose(setup: Setup, allow: Callable[[ParallelLayout], bool] | None = None) -> Choice:
    """The feasible layout with the lowest predicted step time, with a one-line reason.

    `allow` restricts the candidates (the Ring Attention Sampler offers only context layouts).
    Raises ConfigError naming what would fit when nothing does.
    """
    estimates = [e for e in plan(setup) if allow is None or allow(e.layout)]
    best = estimates[0]
    if not best.fits:
        raise ConfigError(_nothing_fits(setup, estimates))
    others = [e for e in estimates[1:] if e.fits]
    versus = f" vs {others[0].name} {others[0].step_s:.2f} s" if others else ""
    explanation = (
        f"auto: {best.name} — fits {_gb(best.per_gpu)} of {_capacity(setup.memory_gb)} GB per GPU; "
        f"predicted {best.step_s:.2f} s/step{versus} ({setup.link.describe()})"
    )
    return Choice(best.layout, explanation, estimates)


def _capacity(gb: float) -> str:
    """A device's memory as people say it: 16, 192, 12.6 (measured sizes are not round)."""
    if gb == round(gb) or gb >= 100:
        return f"{gb:.0f}"
    return f"{gb:.1f}"


def _nothing_fits(setup: Setup, estimates: list[Estimate]) -> str:
    smallest = min(estimates, key=lambda e: e.per_gpu)
    need = smallest.per_gpu / (1 - setup.margin)
    hints = [f"GPUs with at least {math.ceil(need / GB)} GB"]
    for devices in (2, 4, 8):
        if devices > setup.devices:
            more = [e for e in plan(replace(setup, devices=devices)) if e.fits]
            if more:
                hints.append(f"{devices} GPUs ({more[0].name})")
                break
    for side in (1024, 768, 512):
        if side * side < setup.width * setup.height:
            smaller = [e for e in plan(replace(setup, width=side, height=side)) if e.fits]
            if smaller:
                hints.append(f"{side}x{side} images ({smaller[0].name})")
                break
    return (
        f"no layout of {setup.devices} device(s) fits {setup.width}x{setup.height} x{setup.batch} in "
        f"{_capacity(setup.memory_gb)} GB per device: the smallest, {smallest.name}, needs {_gb(smallest.per_gpu)} GB "
        f"per GPU ({_gb(smallest.weights)} weights + {_gb(smallest.activations)} activations) and "
        f"{_gb(setup.usable_bytes)} GB are usable ({setup.margin:.0%} kept free); use " + " or ".join(hints)
    )


# --------------------------------------------------------------------------------------------------
# Report


def _count_by_kind(comms: list[Collective]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for c in comms:
        counts[c.kind] = counts.get(c.kind, 0) + c.count
    return counts


def format_table(setup: Setup, estimates: list[Estimate]) -> str:
    head = (
        f"FLUX ({setup.dims.heads} heads x {setup.dims.head_dim}, {setup.dims.double_blocks}+"
        f"{setup.dims.single_blocks} blocks), {setup.dtype}, {setup.width}x{setup.height} x{setup.batch} "
        f"({setup.tokens} tokens), {setup.devices} device(s) x {_capacity(setup.memory_gb)} GB, "
        f"{setup.link.describe()}, {setup.tflops:g} TFLOPS per device"
    )
    lines = [
        head,
        "",
        "| layout | weights (GB) | activations (GB) | of which buffers (GB) | per GPU (GB) | fits | "
        "collectives / step | sent per GPU (GB) | compute (s) | comm (s) | step (s) |",
        "|---|---:|---:|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    for e in estimates:
        counts = ", ".join(f"{n} {kind}" for kind, n in _count_by_kind(e.collectives).items()) or "-"
        lines.append(
            f"| {e.name} | {e.weights / GB:.2f} | {e.activations / GB:.2f} | {e.buffers / GB:.2f} | "
            f"{e.per_gpu / GB:.2f} | {'yes' if e.fits else 'no'} | {counts} | {e.sent_per_gpu / GB:.2f} | "
            f"{e.compute_s:.2f} | {e.comm_s:.3f} | {e.step_s:.2f} |"
        )
    return "\n".join(lines)
