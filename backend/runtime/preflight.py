"""The transport pre-flight: which way the workers' collectives travel, tried in order until one works.

Consumer multi-GPU machines fail in the first collective more often than anywhere else: 2 x 7900 XTX
collectives failing (ROCm/legacy-rocm-build#6074), 4 x R9700 hanging the host with peer-to-peer on
(ROCm/rocm-systems#11348), no RCCL for Strix Halo at all (rccl#2026), none in AMD's Windows wheels. So a
group start is a pre-flight (client.WorkerGroup._start): the workers start with the first transport of
the ladder below, run a bounded probe — an all-reduce and an all-gather over the group, then a tensor
exchanged by every pair of ranks, each checked (probe.py `health_check`, `probe_pairs`) — and when it
hangs past `health_timeout` or gives a wrong result, the group is stopped and started again with the next:

1. NCCL/RCCL as the environment has it (peer-to-peer between GPUs: the fastest);
2. NCCL_P2P_DISABLE=1: NCCL/RCCL's shared-memory transport through the host;
3. the same with NCCL_PROTO=Simple (the LL/LL128 protocols off: the ones seen corrupting or hanging on
   some consumer boards);
4. gloo: collectives through host memory over loopback TCP (slowest; works wherever the CPU does).

A torch without NCCL/RCCL starts at gloo. What changed is said in the group's `warnings` (the Status
node, the loader's panel, ComfyUI's console), with the environment that makes it permanent; a fall back
to gloo also says what it costs, priced by the planner (`gloo_cost`). `doctor` prints the transport the
group uses and why. Pure decisions here (no torch at import); the loop is the client's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

# The worker's name for the rung it runs on (tests' fake probes read it; `HealthReport.env` shows it).
TRANSPORT_ENV = "RP_TRANSPORT"


@dataclass(frozen=True)
class Transport:
    """One way for the workers' collectives to travel: the environment it sets and the backend."""

    name: str
    what: str  # for people: how tensors travel
    env: Mapping[str, str] = field(default_factory=dict)
    backend: str | None = None  # None: NCCL/RCCL for GPUs, gloo for CPU workers

    @property
    def settings(self) -> str:
        """'NCCL_P2P_DISABLE=1 NCCL_PROTO=Simple', "backend='gloo'" or 'the defaults'."""
        if self.backend:
            return f"backend={self.backend!r}"
        return " ".join(f"{k}={v}" for k, v in self.env.items()) or "the defaults"


P2P = Transport("nccl", "NCCL/RCCL with peer-to-peer transfers between the GPUs")
SHM = Transport(
    "nccl-shm", "NCCL/RCCL through host shared memory (peer-to-peer off)", {"NCCL_P2P_DISABLE": "1"}
)
SIMPLE = Transport(
    "nccl-shm-simple",
    "NCCL/RCCL through host shared memory with the Simple protocol (peer-to-peer and LL/LL128 off)",
    {"NCCL_P2P_DISABLE": "1", "NCCL_PROTO": "Simple"},
)
GLOO = Transport("gloo", "gloo through host memory over loopback TCP", backend="gloo")
LADDER = (P2P, SHM, SIMPLE, GLOO)


FAILED = " failed the start-up probe (warnings)"  # how `WorkerGroup.transport_why` ends after a fall back


@dataclass(frozen=True)
class Plan:
    """The transports to try, in order, and why the first is the first."""

    ladder: tuple[Transport, ...]
    why: str


def plan_transports(
    devices: Sequence[str],
    backend: str | None,
    env: Mapping[str, str],
    *,
    retry: bool,
    nccl_available: bool | None = None,
) -> Plan:
    """What to try for a group on `devices` (`backend`: the caller's choice; `env`: the workers'
    environment; `retry`: fall down the ladder on a failed probe — GPUs by default)."""
    gpus = any(d.startswith("cuda") for d in devices)
    if backend == "gloo":
        return Plan((GLOO,), "backend='gloo' was asked for")
    if not gpus and not retry:
        return Plan((Transport("gloo", "gloo through host memory"),), "CPU workers: gloo is their backend")
    if gpus and nccl_available is None:
        import torch.distributed as dist

        nccl_available = dist.is_available() and dist.is_nccl_available()
    if gpus and not nccl_available:
        return Plan((GLOO,), f"this torch has no NCCL/RCCL ({_torch_build()}): {GLOO.what}")
    ladder = LADDER if backend is None else LADDER[:-1]  # backend='nccl': never gloo
    # Settings the user made already: start at the first rung that keeps them (never turn P2P back on).
    if env.get("NCCL_P2P_DISABLE") == "1":
        ladder = tuple(t for t in ladder if t is not P2P)
    if env.get("NCCL_PROTO"):
        ladder = tuple(t for t in ladder if "NCCL_PROTO" not in t.env)
    why = "GPUs with NCCL/RCCL" + ("" if ladder[0] is P2P else ", and the environment's own NCCL settings")
    return Plan(ladder if retry else ladder[:1], why)


def _torch_build() -> str:
    from ..platforms import torch_build

    return torch_build()


def worker_env(transport: Transport, env: Mapping[str, str]) -> dict[str, str]:
    """The group's environment for one rung: its settings over the caller's (the caller's own
    NCCL_P2P_DISABLE=1 stays), and the rung's name for the workers."""
    return {**env, **transport.env, TRANSPORT_ENV: transport.name}


def fallback_warning(devices: Sequence[str], tried: Sequence[tuple[Transport, str]], now: Transport) -> str:
    """What the group says when the first transport failed its probe and `now` works."""
    first, error = tried[0]
    with_first = "peer-to-peer transfers enabled" if first is P2P else first.settings
    others = "".join(f"; then with {t.settings}: {e}" for t, e in tried[1:])
    permanent = (
        f"pass backend='gloo' (the node: start ComfyUI with {TRANSPORT_FORCE}=gloo)"
        if now.backend
        else f"start ComfyUI with {now.settings} in its environment (e.g. `{now.settings} python main.py`)"
    )
    return (
        f"the first collective over {', '.join(devices)} failed with {with_first} ({error}){others}; the "
        f"worker group was started again with {now.settings} and now works (collectives go through "
        f"{'host memory: slower' if now is not P2P else 'peer-to-peer'}). To make it permanent, {permanent}; "
        "to get fast P2P back, try the kernel parameter iommu=pt (AMD: amd_iommu=on iommu=pt) and "
        "HSA_FORCE_FINE_GRAIN_PCIE=1, then run `python -m rocm_parallel doctor`"
    )


# The environment variable that makes every group start with gloo (ComfyUI users cannot pass backend=).
TRANSPORT_FORCE = "ROCM_PARALLEL_BACKEND"


def forced_backend(backend: str | None) -> str | None:
    """The caller's backend, else the one ROCM_PARALLEL_BACKEND names ('gloo' or 'nccl')."""
    forced = os.environ.get(TRANSPORT_FORCE, "").strip().lower()
    if backend is not None or not forced:
        return backend
    if forced not in ("gloo", "nccl"):
        from ..config import ConfigError

        raise ConfigError(
            f"{TRANSPORT_FORCE}={forced!r} in the environment; use 'gloo' or 'nccl', or unset it"
        )
    return forced


def short_note(transport: Transport, fell_back: bool) -> str | None:
    """The panel's one line: only when the group is not on the fastest transport."""
    if transport is P2P or (transport.name == "gloo" and transport.backend is None):
        return None
    return f"collectives: {transport.what}" + (
        " (the faster ones failed at start: Status node)" if fell_back else ""
    )


# The planner's price of a group on gloo, in words: (devices, measured GB/s, µs per collective) -> text. The
# runtime imports no model code, so the planner's side puts its function here (backend/__init__.py, when the
# package is imported: always before a group starts).
PRICES: list[Callable[[int, float, float], str]] = []


def gloo_cost(devices: int, gbps: float, latency_us: float) -> str:
    """What gloo costs here, as the planner prices it (`PRICES`); a plain line when no planner is there."""
    if not PRICES:
        return f"gloo measured {gbps:.2f} GB/s, {latency_us:.0f} µs per collective here"
    return PRICES[-1](devices, gbps, latency_us)
