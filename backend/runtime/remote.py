"""A worker group across hosts, seen from the first host: `HostsWorkers`, a launch whose ranks on other hosts
are started, watched and stopped through those hosts' agents (agent.py, connected to the hub: hub.py).

Ranks are placed host by host, this machine's first (platforms.by_host): rank 0 runs here, so the
rendezvous store, the cancel flag rank 0 reads and the ranks' reports of this machine stay as they are. What
differs for a rank on another host, and where it is handled:

- it connects to the hub over TCP with the group's key (not to the launch's Unix socket with a launch key),
  and the hub hands its connection over (`_next_hello`); the rendezvous store listens on the hub's address;
- its requests carry their tensors inline (the two hosts share no tmpfs) and name its host's copy of each
  file, which is checked before the request reaches any rank (`requests_for`: size and header hash, fileid.py);
  its replies come inline (the rank's RP_INLINE);
- its reports, the OS's view of its process, its exit and the end of its output arrive from its agent
  (`_Ranks.take`) and are written where this machine's ranks' are (the reports' and logs' folders), their
  times moved onto this host's clock: liveness.py, the messages and the panel read them unchanged;
- a kill, a cancel and the caller's questions go to its agent;
- its host can go: an agent whose connection closes or falls silent is gone (hub.py), and every group on it
  fails naming the host and its ranks (`exit_report`); its ranks end with the agent (their death pipe).

A group on this machine alone is a plain `launch.Workers` (`workers_for`): nothing here runs for it.
"""

from __future__ import annotations

import itertools
import os
import queue
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener, wait
from typing import Any

from ..config import ConfigError
from ..platforms import hosts_of
from . import hub as hubs
from .exits import exit_reason
from .fileid import FileIdentity, identity
from .heartbeat import state_path, write_state
from .hostsettings import DOCS, interface_of, relative_name, settings
from .launch import EnvFor, WorkerError, Workers, _authenticated_accept
from .liveness import Watchdog
from .messages import (
    AskRanks,
    CancelJob,
    CheckFiles,
    FileCheck,
    HostReport,
    KillRanks,
    RankState,
    SpawnRanks,
    StopRanks,
)
from .procstat import ProcSample
from .transport import Hello, Request, inlined, pack

STOP_SECONDS = 15.0  # beyond the grace, what an agent's stop may take (launch.terminate's own limits)
FILE_CHECK_SECONDS = 120.0  # an agent's answer about a request's files (headers on a slow disk)
_IFNAMES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_requests = itertools.count(1)


@dataclass(frozen=True)
class WorkerOptions:
    """What a rank's environment is made of besides its rank (launch.worker_env's keywords): what an agent
    needs to start one like this machine does."""

    extra_sys_path: tuple[str, ...] = ()
    methods: tuple[str, ...] = ()
    backend: str | None = None
    threads: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    collective_timeout: float = 600.0


def workers_for(
    devices: Sequence[str], start_timeout: float, watchdog: Watchdog, options: WorkerOptions
) -> Workers:
    """The launch for these devices: across hosts when any device is on another host."""
    if len(hosts_of(devices)) > 1:
        return HostsWorkers(devices, start_timeout, watchdog, options)
    return Workers(devices, start_timeout, watchdog)


class _Ranks:
    """One host's ranks of a launch as its agent reports them (written by the hub's reader thread)."""

    def __init__(self, host: str, ranks: list[int], link: hubs.AgentLink, workers: HostsWorkers) -> None:
        self.host, self.ranks, self.link, self.workers = host, ranks, link, workers
        self.pids: dict[int, int] = {}
        self.exits: dict[int, int | None] = {}
        self.samples: dict[int, ProcSample] = {}  # each rank's latest OS view not looked at yet
        self._lock = threading.Lock()

    def take(self, report: HostReport, offset: float) -> None:
        """A report from the agent: the ranks' reports into the launch's folder on this host's clock (`offset`:
        this host's monotonic clock minus the agent's), their output into their logs."""
        for rank, text in report.states.items():
            with_offset = _moved(RankState.from_json(text), offset)
            try:
                write_state(state_path(self.workers.live, rank), with_offset)
            except OSError:  # the launch stopped meanwhile: its folder is gone
                return
        for rank, text in report.output.items():
            try:
                with open(self.workers.log_path(rank), "w") as f:
                    f.write(text)
            except OSError:
                return
        with self._lock:
            self.samples.update(report.samples)
            self.exits.update(report.exits)

    def sample(self, rank: int) -> ProcSample | None:
        with self._lock:
            return self.samples.pop(rank, None)

    @property
    def described(self) -> str:
        devices = ", ".join(self.workers.devices[r] for r in self.ranks)
        return f"rank(s) {', '.join(map(str, self.ranks))} ({devices})"


def _moved(state: RankState, offset: float) -> RankState:
    """A report's times (its host's time.monotonic()) on this host's clock."""
    groups = tuple(
        replace(g, pending_since=g.pending_since + offset) if g.pending_since else g for g in state.groups
    )
    return replace(state, since=state.since + offset if state.since else 0.0, groups=groups)


class HostsWorkers(Workers):
    """A launch whose ranks are on this machine and on other hosts (see the module's docstring)."""

    def __init__(
        self, devices: Sequence[str], start_timeout: float, watchdog: Watchdog, options: WorkerOptions
    ) -> None:
        super().__init__(devices, start_timeout, watchdog)
        self.options, self.launch = options, secrets.token_hex(8)
        hosts = hosts_of(self.devices)
        self._here = hosts[0][1]  # this machine's ranks: 0 .. n-1 (platforms.by_host)
        self._hosts = [(host, ranks) for host, ranks in hosts[1:] if host is not None]
        self.elsewhere: list[_Ranks] = []
        self._host_of: dict[int, _Ranks] = {}
        self._box: queue.Queue[tuple[Connection, Hello]] | None = None
        self._hub: hubs.Hub | None = None
        self._prepared: tuple[Request, list[Request]] | None = None
        self._verified: set[tuple[str, str, int, int]] = set()  # (host, path, size, mtime) checked there

    @property
    def local_ranks(self) -> range:
        return range(len(self._here))

    @property
    def pids(self) -> list[int]:
        remote = {rank: pid for r in self.elsewhere for rank, pid in r.pids.items()}
        return [p.pid for p in self.procs] + [
            remote.get(rank, 0) for rank in range(len(self.procs), len(self.devices))
        ]

    # ---------------------------------------------------------------- start

    def start(self, env_for: EnvFor) -> None:
        """Find every named host's agent (refused before any process starts when one is missing or offers
        other devices), then start as a launch does, the other hosts' ranks through their agents."""
        self._hub = hub = hubs.hub()
        for host, ranks in self._hosts:
            link = self._agent(hub, host, ranks)
            mine = _Ranks(host, ranks, link, self)
            self.elsewhere.append(mine)
            self._host_of.update({rank: mine for rank in ranks})
        address = hub.address[0]
        interface = interface_of(address)

        def here(rank: int, socket_path: str, shm: str) -> dict[str, str]:
            env = env_for(rank, socket_path, shm)
            env["RP_STORE_HOST"] = address  # the rendezvous, where the other hosts' ranks reach it
            for name in _IFNAMES:
                if interface and name not in os.environ:
                    env[name] = interface
            return env

        self._box = hub.expect(self.launch)
        try:
            super().start(here)
        finally:
            hub.forget(self.launch)

    def _agent(self, hub: hubs.Hub, host: str, ranks: list[int]) -> hubs.AgentLink:
        wanted = [self.devices[r].removeprefix(f"{host}:") for r in ranks]
        try:
            link = hub.agent(host, min(hubs.AGENT_WAIT, self.start_timeout))
        except TimeoutError:
            raise WorkerError(
                f"devices name {host}'s {', '.join(wanted)}, but no agent of {host} has joined this host's hub at "
                f"{_address(hub.address)} within {min(hubs.AGENT_WAIT, self.start_timeout):g} s; on {host} run "
                f"`python custom_nodes/rocm-parallel worker --join {_address(hub.address)} --key-file <a copy of "
                f"{settings().key_file}> --devices '{_offer(wanted)}' --models <its ComfyUI/models>` ({DOCS})"
            ) from None
        offered = list(link.hello.devices)
        if any(wanted.count(d) > offered.count(d) for d in wanted):
            raise ConfigError(
                f"devices name {host}'s {', '.join(wanted)}, but its agent offers {', '.join(offered)}; name those, "
                f"or start its agent with --devices '{_offer(wanted)}'"
            )
        return link

    def spawn_elsewhere(self) -> None:
        assert self._hub is not None
        for mine in self.elsewhere:
            mine.link.follow(self.launch, mine.take)
            spawn = SpawnRanks(
                launch=self.launch, ranks=tuple(mine.ranks), devices=self.devices, hub=_address(self._hub.address),
                env={k: v for k, v in self.options.env.items() if k not in _IFNAMES},
                methods=self.options.methods, extra_sys_path=self.options.extra_sys_path,
                backend=self.options.backend, threads=self.options.threads,
                collective_timeout=self.options.collective_timeout,
            )  # fmt: skip
            try:
                spawned = mine.link.ask(spawn, ("Spawned", self.launch), 60.0)
            except (hubs.HostGone, TimeoutError) as exc:
                raise WorkerError(
                    f"{mine.link.name} could not start {mine.described}: {exc}", mine.ranks[0]
                ) from None
            if spawned.error:
                raise WorkerError(
                    f"{mine.link.name} could not start {mine.described}: {spawned.error}", mine.ranks[0]
                )
            mine.pids.update(spawned.pids)

    def _next_hello(self, listener: Listener, deadline: float) -> tuple[Connection, Hello]:
        """The next rank to connect: one of this machine's on the launch's socket, or another host's that the
        hub handed over (authenticated, its Hello read)."""
        assert self._box is not None
        sock = listener._listener._socket
        while True:
            self._check_starting(deadline, "connecting")
            try:
                conn, hello = self._box.get_nowait()
            except queue.Empty:
                pass
            else:
                if hello.rank in self._host_of and hello.rank not in self._connected:
                    return conn, hello
                conn.close()  # a rank of this launch that connected twice, or not one of another host's
                continue
            if not wait([sock], timeout=0.1):
                continue
            try:
                conn = _authenticated_accept(listener, seconds=5.0)
            except (AuthenticationError, OSError, EOFError):
                continue
            return conn, self._next_record(conn, Hello, deadline, "connecting")

    # ---------------------------------------------------------------- requests

    def requests_for(self, request: Request) -> list[Request]:
        """Other hosts' ranks get the request with its tensors inline and their host's copy of each file it
        names, checked to be the same (size and header hash) before any rank gets it."""
        if self._prepared is not None and self._prepared[0] is request:
            return self._prepared[1]
        out = [request] * len(self.devices)
        for mine, theirs in self._for_hosts(inlined(request.payload)):
            for rank in mine.ranks:
                out[rank] = replace(request, payload=theirs)
        self._prepared = (request, out)
        return out

    def check_files(self, record: Any) -> None:
        """Every file `record` names, checked on every other host (once per version of a file), before
        anything is sent: a load refused here leaves what the ranks hold as it was."""
        self._for_hosts(pack(record, "", "", inline=True))

    def _for_hosts(self, payload: Any) -> list[tuple[_Ranks, Any]]:
        """A packed payload as each other host's ranks get it: paths mapped, files checked there."""
        folders, out = settings().folders, []
        for mine in self.elsewhere:
            files: list[tuple[str, str, str]] = []
            out.append((mine, _mapped(payload, mine.link.hello.models, folders, files)))
            self._check_files(mine, files)
        return out

    def _check_files(self, mine: _Ranks, files: list[tuple[str, str, str]]) -> None:
        checks, stamps = [], []
        for here, there, shown in dict.fromkeys(files):
            stat = os.stat(here)
            stamp = (mine.host, here, stat.st_size, stat.st_mtime_ns)
            if stamp in self._verified:
                continue
            found = _identity(here, stat.st_size, stat.st_mtime_ns)
            checks.append(FileCheck(there, shown, found.size, found.digest, found.header))
            stamps.append(stamp)
        if not checks:
            return
        number = next(_requests)
        try:
            answer = mine.link.ask(CheckFiles(number, tuple(checks)), ("files", number), FILE_CHECK_SECONDS)
        except (hubs.HostGone, TimeoutError) as exc:
            raise WorkerError(
                f"{mine.link.name} could not check the request's files: {exc}", mine.ranks[0]
            ) from None
        if answer.problems:
            where = mine.link.hello.models or "the same paths"
            raise ConfigError(
                f"{mine.link.name} does not have this host's files, so nothing was loaded: "
                + "; ".join(answer.problems)
                + f". Copy this host's file to the same name under its models folder ({where}) ({DOCS})"
            )
        self._verified.update(stamps)

    # ---------------------------------------------------------------- how they are

    def process(self, rank: int, state: RankState | None = None) -> Any:
        mine = self._host_of.get(rank)
        return super().process(rank, state) if mine is None else mine.sample(rank)

    def kill(self, ranks: Sequence[int]) -> None:
        super().kill([r for r in ranks if r not in self._host_of])
        for mine in self.elsewhere:
            theirs = tuple(r for r in ranks if r in mine.ranks)
            if theirs:
                self._stopped_by_pack.update(theirs)
                _quietly(mine.link, KillRanks(self.launch, theirs))

    def cancel(self, job: int) -> None:
        super().cancel(job)
        for mine in self.elsewhere:
            _quietly(mine.link, CancelJob(self.launch, job))

    def ask(self, questions: dict[str, int]) -> None:
        super().ask(questions)
        for mine in self.elsewhere:
            _quietly(mine.link, AskRanks(self.launch, dict(questions)))

    def exit_report(self, doing: str) -> WorkerError | None:
        """A gone host first (the cause: its ranks went with it), then this machine's exits, then another
        host's rank that exited."""
        for mine in self.elsewhere:
            if mine.link.gone is not None:
                return WorkerError(
                    f"{mine.link.name} is gone while {doing}: {mine.link.gone}; its {mine.described} are lost with it"
                    + self.log_tails(),
                    mine.ranks[0],
                )
        found = super().exit_report(doing)
        if found is not None:
            return found
        for mine in self.elsewhere:
            for rank, code in sorted(mine.exits.items()):
                if code is None:
                    continue
                # the signal's name only: whether that host's out-of-memory killer sent a SIGKILL is its own to say
                name, why = exit_reason(
                    code, stopped_by_pack=True, oom_kills_before=None, oom_kills_now=None, memory=None,
                    now=time.monotonic(),
                )  # fmt: skip
                tail = self.log_tail(rank)
                return WorkerError(
                    f"worker rank {rank} ({self.devices[rank]}, pid {mine.pids.get(rank)} on {mine.host}) exited "
                    f"with code {code}{name} while {doing}{why}"
                    + (f"; its last output:\n{tail}" if tail else ""),
                    rank,
                )
        return None

    @property
    def running(self) -> bool:
        return super().running and not any(m.link.gone is not None or m.exits for m in self.elsewhere)

    def wait_for_exit(self, rank: int, seconds: float) -> None:
        mine = self._host_of.get(rank)
        if mine is None:
            super().wait_for_exit(rank, seconds)
            return
        deadline = time.monotonic() + seconds
        while rank not in mine.exits and mine.link.gone is None and time.monotonic() < deadline:
            time.sleep(0.02)

    def _wait_for_an_exit(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self.running:
            time.sleep(0.02)

    # ---------------------------------------------------------------- the end

    def stop(self, grace: float) -> None:
        """Every host's ranks stopped at once: the agents are asked first, this machine's ranks stopped (the
        launch's own way), then the agents' answers waited for (bounded: a gone host's ranks died with it)."""
        asked = []
        if not self.closed:
            for mine in self.elsewhere:
                try:
                    mine.link.expect(("Stopped", self.launch))
                    mine.link.send(StopRanks(self.launch, grace))
                    asked.append(mine)
                except hubs.HostGone:
                    pass
        super().stop(grace)
        for mine in asked:
            try:
                stopped = mine.link.answer(("Stopped", self.launch), grace + STOP_SECONDS)
                mine.exits.update(stopped.exits)
            except (hubs.HostGone, TimeoutError):
                pass
        for mine in self.elsewhere:
            mine.link.follow(self.launch, None)
        remote = {rank: code for m in self.elsewhere for rank, code in m.exits.items()}
        self.exit_codes = self.exit_codes[: len(self.procs)] + [
            remote.get(rank) for rank in range(len(self.procs), len(self.devices))
        ]


# --------------------------------------------------------------------------------------------------
# Helpers


def _quietly(link: hubs.AgentLink, record: Any) -> None:
    """Tell an agent something that matters only while it is there."""
    try:
        link.send(record)
    except hubs.HostGone:
        pass


def _address(address: tuple[str, int]) -> str:
    host, port = address[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _offer(devices: list[str]) -> str:
    """What an agent's --devices should say to offer `devices`."""
    if devices and all(d == "cpu" for d in devices):
        return f"cpu x{len(devices)}"
    return ",".join(d.removeprefix("cuda:") for d in devices)


_IDENTITIES: dict[tuple[str, int, int], FileIdentity] = {}


def _identity(path: str, size: int, mtime: int) -> FileIdentity:
    """A file's identity, once per version of it (its size and modification time)."""
    key = (path, size, mtime)
    if key not in _IDENTITIES:
        _IDENTITIES[key] = identity(path)
    return _IDENTITIES[key]


_SKIP = ("__rocm_parallel_bytes__",)


def _mapped(
    obj: Any, models: str, folders: tuple[tuple[str, str], ...], files: list[tuple[str, str, str]]
) -> Any:
    """A packed payload with every path of a file or folder of this host that it names replaced by that file's
    path on the agent's host: under its `models` folder by the name it has under this host's `folders`, or the
    same path when it is in none of them (a shared disk). Each becomes (here, there, shown) in `files`."""
    if isinstance(obj, str):
        if not (os.path.isabs(obj) and os.path.exists(obj)):
            return obj
        name = relative_name(obj, folders)
        there = os.path.join(models, name) if name is not None and models else obj
        files.append((obj, there, name or obj))
        return there
    if isinstance(obj, dict):
        if any(key in obj for key in _SKIP):
            return obj
        return {k: _mapped(v, models, folders, files) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_mapped(v, models, folders, files) for v in obj)
    return obj


__all__ = ["HostsWorkers", "WorkerOptions", "workers_for"]
