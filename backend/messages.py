"""What the client and the workers say to each other: one frozen record per request and per reply.

Every worker method takes one of these (or nothing) and answers with one (or None); `transport.pack`
sends them as plain data and rebuilds only registered classes on arrival. Both sides import this module.
The tests' own worker methods define their records next to them (tests/worker_jobs.py, ...).

| method (module)                 | request          | reply                                   |
|---------------------------------|------------------|-----------------------------------------|
| ping (worker.py)                | -                | RankInfo                                |
| load (jobs.py)                  | LoadRequest      | LoadReport (a RankStatus plus the load) |
| status, unload (jobs.py)        | -                | RankStatus, Unloaded (every slot)       |
| unload_slot (jobs.py)           | UnloadRequest    | Unloaded                                |
| model_call (serve.py)           | ForwardRequest   | ForwardReply                            |
| measure_link (probe.py)         | LinkRequest      | LinkReport                              |
| health_check (probe.py)         | HealthRequest    | HealthReport                            |
| probe_pairs (probe.py)          | HealthRequest    | PairReport                              |
| attention_kernels (probe.py)    | -                | AttentionReport                         |

Besides the jobs' replies, every rank writes a `RankState` several times a second from a thread of its own
(heartbeat.py): what it is doing and where it is in each process group's collectives. The caller reads it
to tell a hung rank from a slow one (liveness.py).
"""

from __future__ import annotations

import dataclasses
import json
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .checkpoint import CheckpointInfo, StoredTensor
from .config import DEFAULT_SLOT, ParallelLayout
from .transport import record, register

# The layout and the checkpoint's header travel as they are: the workers neither rebuild the layout from
# numbers nor read the header again.
register(ParallelLayout, CheckpointInfo, StoredTensor)

Lora = tuple[str, float]  # (path, strength), applied in order


@record
@dataclass(frozen=True)
class RankInfo:
    """`ping`: who answered."""

    rank: int
    pid: int
    device: str
    backend: str


# --------------------------------------------------------------------------------------------------
# Loading and status


@record
@dataclass(frozen=True)
class Loaded:
    """What a rank holds, as its status reports it (and what it compares to decide a reload)."""

    checkpoint: str  # the path as the caller named it
    layout: ParallelLayout
    dtype: str | None
    weight_dtype: str
    attention: str | None = None
    loras: tuple[Lora, ...] = ()
    compile: str = "off"  # compile.COMPILE_MODES: the repeated blocks compiled on every rank
    engine: str = "diffusers"  # models/options.py ENGINES: the family's diffusers model or ComfyUI's own
    comfyui: str = ""  # the ComfyUI checkout the comfy engine imports on the workers
    detection: str = ""  # JSON: values over ComfyUI's detection output (models/build.py)

    def same_weights(self, other: Any) -> bool:
        """The same model in the same layout, whatever the LoRAs: a LoRA change re-reads only what they touch."""
        return isinstance(other, Loaded) and replace(self, loras=()) == replace(other, loras=())


@record
@dataclass(frozen=True)
class LoadRequest:
    """Make `checkpoint` resident in `layout` with `loras` applied; what `ParallelModel.resident` keeps.

    `info` is the caller's reading of the checkpoint's header (read once per run and carried along);
    `dtype` the compute dtype (None: the devices' default); `weight_dtype` how the linear weights are held
    (config.WEIGHT_DTYPE_BYTES: 'default', 'fp8_e4m3fn', 'fp8_e5m2', 'compute'); `compile` whether the
    repeated transformer blocks run compiled (compile.py; 'off', 'inductor', 'aot_eager'); `slot` which of
    the group's resident models it is (a graph that uses two models keeps both, each in its own slot).
    `engine` which model runs it (models/options.py: 'diffusers', or 'comfy': ComfyUI's own class from the
    checkout `comfyui`, its detection told `detection`'s values).
    """

    checkpoint: str
    info: CheckpointInfo
    layout: ParallelLayout
    dtype: str | None = None
    weight_dtype: str = "default"
    attention: str | None = None
    loras: tuple[Lora, ...] = ()
    compile: str = "off"
    slot: str = DEFAULT_SLOT  # which of the group's resident models this is (several can be resident)
    engine: str = "diffusers"
    comfyui: str = ""
    detection: str = ""

    def loaded(self) -> Loaded:
        return Loaded(
            self.checkpoint,
            self.layout,
            self.dtype,
            self.weight_dtype,
            self.attention,
            self.loras,
            self.compile,
            self.engine,
            self.comfyui,
            self.detection,
        )


@record
@dataclass(frozen=True)
class DeviceMemory:
    """A GPU's memory (CPU workers report none)."""

    allocated_gb: float
    peak_gb: float
    free_gb: float
    total_gb: float


@record
@dataclass(frozen=True)
class ResidentModel:
    """One of a rank's resident models: its slot, what it is and its parameter bytes."""

    slot: str
    loaded: Any  # a Loaded, or a test's own record describing random weights
    parameter_bytes: int = 0  # fp8 weights count 1 byte each
    parameter_bytes_by_dtype: dict[str, int] = field(default_factory=dict)
    on_host: bool = False  # parked in host memory between jobs (backend/parking.py)


@record
@dataclass(frozen=True)
class RankStatus:
    """One rank's device, resident models and memory. `loaded` and the parameter bytes are the rank's
    whole: the default slot's model (or the only one held), and the bytes of every resident model;
    `models` lists each."""

    rank: int
    device: str
    loaded: Any = None  # a Loaded, a test's own record describing random weights, or None
    parameter_bytes: int = 0  # resident parameter bytes (fp8 weights count 1 byte each)
    parameter_bytes_by_dtype: dict[str, int] = field(default_factory=dict)
    memory: DeviceMemory | None = None
    busy: bool = False  # ParallelModel.status() while a job runs: the last report, not a fresh one
    models: tuple[ResidentModel, ...] = ()


@record
@dataclass(frozen=True)
class LoadReport(RankStatus):
    """A rank's status after a load, and what the load did."""

    reused: bool = False  # the model was resident already (only the LoRAs may have changed)
    seconds: float = 0.0  # reading the checkpoint (0 when reused)
    lora_tensors: int = 0  # tensors the LoRA change rewrote
    lora_seconds: float = 0.0


@record
@dataclass(frozen=True)
class UnloadRequest:
    """`unload_slot`: drop the model resident in `slot` (the others stay)."""

    slot: str = DEFAULT_SLOT


@record
@dataclass(frozen=True)
class Unloaded:
    rank: int
    unloaded: bool  # a model was resident


# --------------------------------------------------------------------------------------------------
# The forward service (serve.py on the workers, forward_client.py in the caller)

CONDITIONING_SLOTS = 4  # prompts kept per rank: a CFG batch, a second sampler, a refiner pass


@record
@dataclass(frozen=True)
class Conditioning:
    """A prompt's inputs of a model call, by the family's names (its `CallSpec`'s held inputs: the text
    features, a pooled vector, reference latents, a text key mask, ...; None where a prompt has none): sent
    once, kept by every rank under a key."""

    inputs: dict[str, Any]


@record
@dataclass(frozen=True)
class ForwardRequest:
    """One model call, ComfyUI's `diffusion_model(x, timestep, **inputs)`: the prompt's inputs held under
    `cond_key` (sent along as `cond` when the ranks lack them) and the inputs that change every call
    (`inputs`: guidance, a placement) on the model resident in `slot`."""

    x: torch.Tensor
    timestep: torch.Tensor
    cond_key: int
    inputs: dict[str, Any] = field(default_factory=dict)
    cond: Conditioning | None = None
    slot: str = DEFAULT_SLOT


@record
@dataclass(frozen=True)
class ForwardReply:
    rank: int
    out: torch.Tensor | None  # rank 0: the output [B, C, H, W] in the compute dtype; other ranks: None
    seconds: float  # the forward on this rank
    compiled: str | None = None  # compile.note_compiles' line when this call compiled the blocks
    # rank 0: whether `out` holds no NaN or inf, checked where it was just written (in cache; the caller's
    # own pass over the fresh copy it reads cost 0.4 ms of a 1 MB output, `bench call`)
    finite: bool = True


class ConditioningSlots:
    """Least recently used key -> value, `CONDITIONING_SLOTS` long. The client and every rank make the
    same uses in the same order, so they evict the same keys (the rule both sides of the service share)."""

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


# --------------------------------------------------------------------------------------------------
# Probes (probe.py): the link, the start-up health check, attention kernels


@record
@dataclass(frozen=True)
class LinkRequest:
    megabytes: float = 8.0  # the all-reduce that measures bandwidth
    repeats: int = 5


@record
@dataclass(frozen=True)
class LinkReport:
    """What the planner needs about this machine (`ParallelModel.machine()`: memory is the least rank's)."""

    rank: int
    device: str
    world_size: int
    tflops: float  # sustained matmul throughput
    memory_bytes: int  # device memory (CPU workers: the host's, shared out)
    gbps: float | None = None  # all-reduce bus bandwidth; None with one worker (no link)
    latency_us: float | None = None


@record
@dataclass(frozen=True)
class HealthRequest:
    elements: int = 1024


@record
@dataclass(frozen=True)
class HealthReport:
    """A small all-reduce and all-gather, checked and timed (the first call included)."""

    rank: int
    device: str
    world_size: int
    backend: str
    threads: int
    correct: bool
    detail: str  # what was wrong, when not correct
    all_reduce_s: float
    all_gather_s: float
    env: dict[str, str | None]  # the flags that change how collectives run


@record
@dataclass(frozen=True)
class PairReport:
    """Every pair of ranks exchanged a tensor (the transport pre-flight, preflight.py): this rank's view."""

    rank: int
    correct: bool
    detail: str  # which partner sent what, when not correct
    pairs: dict[str, float]  # "0-1" -> seconds of this rank's exchange with that partner (first call)


@record
@dataclass(frozen=True)
class AttentionReport:
    """Which SDPA kernels run on a rank's device, and which PyTorch may pick."""

    rank: int
    device: str
    kernels: dict[str, str]  # name -> "ok" or the error
    enabled: dict[str, bool]
    fast: tuple[str, ...]


# --------------------------------------------------------------------------------------------------
# Liveness (heartbeat.py on the workers, liveness.py in the caller)


@record
@dataclass(frozen=True)
class GroupState:
    """One process group as a rank sees it in torch's flight recorder: how many collectives this rank has
    issued on it and how many of those have completed. `issued > completed`: the rank is in collective
    `completed + 1` (waiting for a peer, or its transfer is running), since `pending_since`."""

    name: str  # the process group's name (the same on every member)
    ranks: tuple[int, ...]  # its members' global ranks; () when the recorder did not say
    issued: int
    completed: int
    op: str = ""  # the oldest pending collective, e.g. 'all_reduce' ('' when none or not known)
    pending_since: float = 0.0  # time.monotonic() when this rank first saw it pending (0: none pending)
    # What the recorder says collective #`asked` of this group was ('all_reduce [[4, 3]]'): the caller asks
    # a group's ranks about the collective one of them waits in (liveness.py compares their answers).
    asked: int = 0
    answer: str = ""

    @property
    def pending(self) -> int:
        """The number of the collective this rank is in (0: none)."""
        return self.completed + 1 if self.issued > self.completed else 0


@record
@dataclass(frozen=True)
class RankState:
    """What one rank is doing, as its heartbeat thread last wrote it (`beat` counts the reports).

    `doing`: 'starting' (`detail` says which part), 'idle' (between jobs), 'computing' (job `job` running
    `method`; in step `step` of `total` when the job reports steps) or 'loading' (reading tensor `step` of
    `total`). `since` is the time.monotonic() this activity began (one clock for all processes on Linux).
    """

    rank: int
    pid: int
    beat: int
    doing: str
    job: int = 0
    method: str = ""
    step: int = 0
    total: int = 0
    since: float = 0.0
    detail: str = ""
    groups: tuple[GroupState, ...] = ()
    reporter: int = 0  # the reporting thread's id (the OS's): the caller leaves it out of "does it work"
    gpu: bool = False  # work was queued on the rank's GPU at this report (a non-blocking stream query)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RankState:
        data = json.loads(text)
        groups = tuple(GroupState(**{**g, "ranks": tuple(g["ranks"])}) for g in data.pop("groups"))
        return cls(**data, groups=groups)
