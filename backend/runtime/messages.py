"""What the caller and the workers say to each other about the group itself: one frozen record per
request and per reply (the models' own records are beside their jobs: backend/resident/messages.py for
every resident model's load and status, backend/diffusion/messages.py, backend/encoders/messages.py and
backend/vae/messages.py).

Every worker method takes one of these (or nothing) and answers with one (or None); `transport.pack`
sends them as plain data and rebuilds only registered classes on arrival. Both sides import this module.
The tests' own worker methods define their records next to them (tests/worker_jobs.py, ...).

| method (module)                 | request          | reply                                   |
|---------------------------------|------------------|-----------------------------------------|
| ping (worker.py)                | -                | RankInfo                                |
| measure_link (probe.py)         | LinkRequest      | LinkReport                              |
| health_check (probe.py)         | HealthRequest    | HealthReport                            |
| probe_pairs (probe.py)          | HealthRequest    | PairReport                              |
| attention_kernels (probe.py)    | -                | AttentionReport                         |
| measure_hosts (probe.py)        | HostsLinkRequest | HostsLinkReport                         |

Besides the jobs' replies, every rank writes a `RankState` several times a second from a thread of its own
(heartbeat.py): what it is doing and where it is in each process group's collectives. The caller reads it
to tell a hung rank from a slow one (liveness.py).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from .procstat import ProcSample
from .transport import record, register

register(ProcSample)  # what the OS says of a rank on another host travels to the caller (HostReport)


@record
@dataclass(frozen=True)
class RankInfo:
    """`ping`: who answered."""

    rank: int
    pid: int
    device: str
    backend: str


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
class HostsLinkRequest:
    """`measure_hosts`: each host's ranks, in rank order."""

    hosts: tuple[tuple[int, ...], ...]
    megabytes: float = 8.0
    repeats: int = 3


@record
@dataclass(frozen=True)
class HostsLinkReport:
    """All-reduce bus bandwidth (GB/s) and latency inside each host (its ranks together) and between hosts (the
    ranks of one index on every host together), every group at once, as the planner prices them; None where a
    rank had no such group (one device on its host; more devices than another host)."""

    rank: int
    within_gbps: float | None = None
    within_latency_us: float | None = None
    between_gbps: float | None = None
    between_latency_us: float | None = None
    between_groups: int = 0  # groups that crossed the hosts at once (sharing each host's network)


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


# --------------------------------------------------------------------------------------------------
# Between the first host's hub (hub.py) and another host's agent (agent.py), over one authenticated TCP
# connection: the agent starts, watches and stops that host's ranks and relays what they report.


@record
@dataclass(frozen=True)
class AgentHello:
    """An agent's first record: who it is (`names`: its address and host name, as devices may name it), what it
    offers, where its model folder is, and what it runs (a group needs the same torch and pack everywhere)."""

    names: tuple[str, ...]
    address: str  # the address its connection comes from: its ranks' traffic leaves from there too
    devices: tuple[str, ...]  # this host's devices it offers ('cpu', 'cuda:0', ...)
    models: str  # its models folder ('' when none: files keep their paths)
    pid: int
    torch: str
    code: str  # the pack's code fingerprint (agent.code_fingerprint)
    threads: int = 0  # torch threads per CPU worker it was told to use (0: the coordinator's)


@record
@dataclass(frozen=True)
class AgentWelcome:
    """The hub's answer: accepted, or why not (the agent says it and exits)."""

    ok: bool
    why: str = ""
    final: bool = False  # the agent cannot join this hub at all (another torch, another version of the pack)


@record
@dataclass(frozen=True)
class SpawnRanks:
    """Start `ranks` of launch `launch` on the agent's host: the whole group's devices (each rank's own named
    as on its host), where to connect (the hub) and what `launch.worker_env` needs."""

    launch: str
    ranks: tuple[int, ...]
    devices: tuple[str, ...]
    hub: str  # 'ADDRESS:PORT' the ranks connect to (and the rendezvous store's address)
    env: dict[
        str, str
    ]  # the group's own variables (transport, the caller's env=): never the caller's whole environment
    methods: tuple[str, ...] = ()
    extra_sys_path: tuple[str, ...] = ()
    backend: str | None = None
    threads: int | None = None
    collective_timeout: float = 600.0


@record
@dataclass(frozen=True)
class Spawned:
    launch: str
    pids: dict[int, int]  # rank -> pid on the agent's host
    error: str = ""


@record
@dataclass(frozen=True)
class StopRanks:
    """Stop launch `launch`'s ranks: `grace` seconds to leave, then the death pipes, SIGTERM, SIGKILL."""

    launch: str
    grace: float = 0.0


@record
@dataclass(frozen=True)
class Stopped:
    launch: str
    exits: dict[int, int | None]  # rank -> exit code (None: SIGKILL did not end it)


@record
@dataclass(frozen=True)
class KillRanks:
    launch: str
    ranks: tuple[int, ...]


@record
@dataclass(frozen=True)
class CancelJob:
    """Touch job `job`'s cancel flag beside launch `launch`'s ranks (WorkerContext.cancel_requested)."""

    launch: str
    job: int


@record
@dataclass(frozen=True)
class AskRanks:
    """The caller's questions about collectives (heartbeat.write_ask), for launch `launch`'s ranks."""

    launch: str
    questions: dict[str, int]


@record
@dataclass(frozen=True)
class FileCheck:
    """A file a request names: its path on the agent's host, what it is called, and this host's identity."""

    path: str
    shown: str  # its name under the models folder, or its path
    size: int
    digest: str
    header: str


@record
@dataclass(frozen=True)
class CheckFiles:
    request: int
    files: tuple[FileCheck, ...]


@record
@dataclass(frozen=True)
class FilesChecked:
    request: int
    problems: tuple[str, ...]  # one line per file that is missing or differs


@record
@dataclass(frozen=True)
class HostReport:
    """Five times a second, per launch: what changed since the last (each rank's report as written, the
    OS's view of its process, exits, the new end of its output) and the agent's clock (`now`, monotonic: the
    hub moves the reports' times onto its own)."""

    launch: str
    now: float
    states: dict[int, str]  # rank -> RankState JSON
    samples: dict[int, ProcSample]
    exits: dict[int, int]
    output: dict[int, str]  # rank -> its output's last 2000 characters, when it changed


@record
@dataclass(frozen=True)
class Ping:
    """Both ways, every second: the other end is there (a silent one is gone after hub.SILENCE seconds)."""

    now: float
