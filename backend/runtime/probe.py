"""Worker methods that measure the machine: `measure_link` (what the planner's cost model needs, measured
once per group), `health_check` (the start-up check of the collectives), `measure_hosts` (a group across
hosts: the link inside each host and the network between them) and `attention_kernels`.

`measure_link` times all-reduces over the group (bus bandwidth from a few MB, latency from a few bytes), a bf16 matmul
on the device (sustained TFLOPS) and reads the device's memory. nccl-tests' definition of bus
bandwidth: an all-reduce of P bytes on N ranks moves 2(N-1)/N x P per rank.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from .messages import (
    AttentionReport,
    HealthReport,
    HealthRequest,
    HostsLinkReport,
    HostsLinkRequest,
    LinkReport,
    LinkRequest,
    PairReport,
)
from .preflight import TRANSPORT_ENV
from .worker import WorkerContext, handler, synchronize

# The settings that change how collectives travel (preflight.py), as each rank saw them.
TRANSPORT_FLAGS = ("NCCL_P2P_DISABLE", "NCCL_PROTO", TRANSPORT_ENV)


def _timed(fn: Any, device: torch.device, repeats: int) -> float:
    fn()  # warm-up: first collectives set up connections, first matmul picks kernels
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best  # the least disturbed run: other work only ever adds time


def _device_memory(ctx: WorkerContext) -> int:
    if ctx.device.type == "cuda":
        return torch.cuda.mem_get_info(ctx.device)[1]
    import psutil

    return psutil.virtual_memory().total // ctx.world_size  # CPU workers share the host's memory


@handler("measure_link", LinkRequest)
def measure_link(ctx: WorkerContext, request: LinkRequest) -> LinkReport:
    """Every rank runs this together (it all-reduces); each returns its own figures."""
    device = ctx.device
    n = ctx.world_size
    link: dict[str, float] = {}
    if n > 1:
        big = torch.ones(int(request.megabytes * 1e6) // 4, dtype=torch.float32, device=device)
        tiny = torch.ones(1, dtype=torch.float32, device=device)
        latency = _timed(lambda: dist.all_reduce(tiny), device, request.repeats)
        seconds = _timed(lambda: dist.all_reduce(big), device, request.repeats)
        moved = 2 * (n - 1) / n * big.numel() * 4
        link = {"gbps": moved / max(seconds - latency, 1e-9) / 1e9, "latency_us": latency * 1e6}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    side = 4096 if device.type == "cuda" else 512
    a = torch.randn(side, side, dtype=dtype, device=device)
    seconds = _timed(lambda: a @ a, device, request.repeats)
    return LinkReport(
        rank=ctx.rank, device=str(device), world_size=n, tflops=2 * side**3 / seconds / 1e12,
        memory_bytes=_device_memory(ctx), **link,
    )  # fmt: skip


def _bus_bandwidth(group: Any, megabytes: float, repeats: int, device: torch.device) -> tuple[float, float]:
    """(GB/s, µs) of an all-reduce on `group`: bus bandwidth from `megabytes`, latency from 4 bytes."""
    n = dist.get_world_size(group)
    big = torch.ones(int(megabytes * 1e6) // 4, dtype=torch.float32, device=device)
    tiny = torch.ones(1, dtype=torch.float32, device=device)
    latency = _timed(lambda: dist.all_reduce(tiny, group=group), device, repeats)
    seconds = _timed(lambda: dist.all_reduce(big, group=group), device, repeats)
    moved = 2 * (n - 1) / n * big.numel() * 4
    return moved / max(seconds - latency, 1e-9) / 1e9, latency * 1e6


@handler("measure_hosts", HostsLinkRequest)
def measure_hosts(ctx: WorkerContext, request: HostsLinkRequest) -> HostsLinkReport:
    """The pre-flight of a group across hosts (docs/hosts.md): every host's ranks all-reduce together (all
    hosts at once: the link inside a host), then the ranks of one index on every host (all indices at once,
    as a ring or Ulysses dimension across hosts does: they share each host's network)."""
    hosts = [list(h) for h in request.hosts]
    within = [dist.new_group(h) for h in hosts]  # every rank creates every group, in the same order
    count = min(len(h) for h in hosts)
    across = [dist.new_group([h[i] for h in hosts]) for i in range(count)]
    report: dict[str, Any] = {}
    for index, ranks in enumerate(hosts):
        if ctx.rank in ranks and len(ranks) > 1:
            gbps, latency = _bus_bandwidth(within[index], request.megabytes, request.repeats, ctx.device)
            report.update(within_gbps=gbps, within_latency_us=latency)
    dist.barrier()  # the hosts' own links measured apart from the network's
    for index, group in enumerate(across):
        if ctx.rank in [h[index] for h in hosts]:
            gbps, latency = _bus_bandwidth(group, request.megabytes, request.repeats, ctx.device)
            report.update(between_gbps=gbps, between_latency_us=latency, between_groups=count)
    dist.barrier()
    for group in (*within, *across):
        dist.destroy_process_group(group)
    return HostsLinkReport(rank=ctx.rank, **report)


@handler("health_check", HealthRequest)
def health_check(ctx: WorkerContext, request: HealthRequest) -> HealthReport:
    """A small all-reduce and all-gather on every rank, checked and timed (seconds, first call included).

    Run by `WorkerGroup` right after start-up under a short watchdog (a broken peer-to-peer path hangs
    here, in the first collective) and by `doctor`. `correct` is False when a result is wrong.
    """
    device, n, elements = ctx.device, ctx.world_size, request.elements
    started = time.perf_counter()
    ones = torch.full((elements,), float(ctx.rank + 1), dtype=torch.float32, device=device)
    dist.all_reduce(ones)
    synchronize(device)
    all_reduce_s = time.perf_counter() - started
    expected_sum = n * (n + 1) / 2
    reduce_ok = bool((ones == expected_sum).all().item())
    started = time.perf_counter()
    mine = torch.full((elements,), float(ctx.rank), dtype=torch.float32, device=device)
    gathered = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(gathered, mine)
    synchronize(device)
    all_gather_s = time.perf_counter() - started
    gather_ok = all(bool((g == r).all().item()) for r, g in enumerate(gathered))
    detail = (
        ""
        if reduce_ok and gather_ok
        else (
            f"all-reduce gave {ones[0].item():g} (expected {expected_sum:g}); "
            f"all-gather gave {[g[0].item() for g in gathered]} (expected {list(range(n))})"
        )
    )
    return HealthReport(
        rank=ctx.rank,
        device=str(device),
        world_size=n,
        backend=dist.get_backend(),
        threads=torch.get_num_threads(),
        correct=reduce_ok and gather_ok,
        detail=detail,
        all_reduce_s=all_reduce_s,
        all_gather_s=all_gather_s,
        env={k: os.environ.get(k) for k in (*TRANSPORT_FLAGS, "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL")},
    )


def pair_rounds(n: int) -> list[list[tuple[int, int]]]:
    """Every pair of `n` ranks once, in n - 1 rounds (n rounds when n is odd) where each rank meets at most
    one partner: the circle method of a round-robin tournament."""
    seats: list[int | None] = [*range(n), *([None] if n % 2 else [])]
    rounds = []
    for _ in range(len(seats) - 1):
        half = len(seats) // 2
        pairs = [(seats[i], seats[-1 - i]) for i in range(half)]
        rounds.append(sorted((min(a, b), max(a, b)) for a, b in pairs if a is not None and b is not None))
        seats = [seats[0], seats[-1], *seats[1:-1]]
    return rounds


@handler("probe_pairs", HealthRequest)
def probe_pairs(ctx: WorkerContext, request: HealthRequest) -> PairReport:
    """Each pair of ranks swaps a tensor (round by round, every rank with at most one partner at a time),
    checked and timed: the paths a group-wide all-reduce does not use (a ring all-reduce over 4 GPUs never
    links GPU 0 and GPU 2; Ulysses' all-to-all does). Each round is one all-to-all over the group in which
    only the partners' splits are not empty: the communicator and the op Ulysses uses, and a collective
    torch's flight recorder numbers like any other. (Point-to-point sends on gloo advance the recorder's
    issued count without an entry, so every later hang was reported without its op's name.) Run after
    `health_check`: NCCL wants the group's first collective to include every rank. A pair whose path
    hangs hangs here, and the caller's limit ends it with each rank's place reported."""
    device, rank = ctx.device, ctx.rank
    pairs: dict[str, float] = {}
    wrong = []
    for round_pairs in pair_rounds(ctx.world_size):
        partner = next((b if a == rank else a for a, b in round_pairs if rank in (a, b)), None)
        splits = [request.elements if r == partner else 0 for r in range(ctx.world_size)]
        mine = torch.full((sum(splits),), float(rank + 1), dtype=torch.float32, device=device)
        theirs = torch.empty_like(mine)
        started = time.perf_counter()
        # every rank joins every round (one sitting out, n odd, with nothing to send)
        dist.all_to_all_single(theirs, mine, output_split_sizes=splits, input_split_sizes=splits)
        synchronize(device)
        if partner is None:
            continue
        pairs[f"{min(rank, partner)}-{max(rank, partner)}"] = time.perf_counter() - started
        if not bool((theirs == partner + 1).all().item()):
            wrong.append(f"from rank {partner}: {theirs[0].item():g} (expected {partner + 1})")
    return PairReport(rank=rank, correct=not wrong, detail="; ".join(wrong), pairs=pairs)


def _sdpa_backends() -> dict[str, Any]:
    from torch.nn.attention import SDPBackend

    names = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION"}
    found = {name: getattr(SDPBackend, attr) for name, attr in names.items() if hasattr(SDPBackend, attr)}
    return {**found, "math": SDPBackend.MATH}


@handler("attention_kernels")
def attention_kernels(ctx: WorkerContext) -> AttentionReport:
    """Which SDPA kernels run on this rank's device (FLUX's head size, bf16 on GPUs), and which one
    PyTorch picks when left alone: on a GPU, only `math` working means the ~10x slower fallback."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    device = ctx.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.randn(1, 4, 256, 128, dtype=dtype, device=device)
    works: dict[str, str] = {}
    for name, backend in _sdpa_backends().items():
        try:
            with sdpa_kernel([backend]):
                F.scaled_dot_product_attention(q, q, q)
            synchronize(device)
            works[name] = "ok"
        except Exception as exc:  # "No available kernel", a missing arch in the build, ...
            works[name] = (
                f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ''}"
            )
    enabled = {}
    if device.type == "cuda":
        enabled = {
            "flash": torch.backends.cuda.flash_sdp_enabled(),
            "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
            "math": torch.backends.cuda.math_sdp_enabled(),
        }
    fast = [name for name in ("flash", "efficient", "cudnn") if works.get(name) == "ok"]
    return AttentionReport(
        rank=ctx.rank, device=str(device), kernels=works, enabled=enabled, fast=tuple(fast)
    )
