"""Another host's agent: the one command that joins a host to the first host's worker groups.

    python custom_nodes/rocm-parallel worker --join 192.168.1.10:8190 --key-file hosts.key \\
        --devices 0,1 --models ComfyUI/models

It connects to the first host's hub (hub.py), proves it holds the group's key (tcp.py), says what it offers,
and waits. When a group names this host's devices, the hub asks it to start those ranks (`SpawnRanks`): the
same worker processes a group starts on the first host (launch.py's bootstrap, `worker_env`), which connect
back to the hub and join the group over the network. Meanwhile it relays what they report (heartbeat.py's
files, the OS's view of each process: procstat.py, exits, the end of their output) five times a second, and
does what the caller asks of them: cancel a job, answer its questions about collectives, kill a rank, stop.

What ends the ranks: the group's close (`StopRanks`); this agent's end (their stdin is their death pipe, so
they exit with it even on SIGKILL); the hub's connection closing or falling silent for `hub.SILENCE` seconds
(the first host died or the network failed): the agent then stops them and waits for the hub again.
Before any rank loads a file, the hub asks whether this host's copy is the same (`CheckFiles`: size and
header hash, fileid.py).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ..config import ConfigError
from ..platforms import device_host, local_device, validate_devices
from .fileid import identity
from .heartbeat import read_state, state_path, write_ask
from .hostsettings import DEFAULT_PORT, DOCS, code_fingerprint, interface_of, parse_address, read_key
from .launch import bootstrap_command, terminate, worker_env
from .messages import (
    AgentHello,
    AgentWelcome,
    AskRanks,
    CancelJob,
    CheckFiles,
    FilesChecked,
    HostReport,
    KillRanks,
    Ping,
    Spawned,
    SpawnRanks,
    Stopped,
    StopRanks,
)
from .procstat import sample
from .tcp import connect
from .transport import private_dir, recv_any, send_record

REPORT_EVERY = 0.2  # seconds between reports to the hub
RETRY_EVERY = 2.0  # seconds between attempts to reach the hub
OUTPUT_TAIL = 2000  # characters of a rank's output relayed when it changes


class Launch:
    """This host's ranks of one group start: their processes, private folders, and what was last relayed."""

    def __init__(self, spawn: SpawnRanks, address: str, key: bytes, threads: int) -> None:
        self.spawn, self.id = spawn, spawn.launch
        self.tmp, self.shm = private_dir("ctl"), private_dir("shm", tmpfs=True)
        self.live = private_dir("live", tmpfs=True)
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self._states: dict[int, str] = {}  # the last report relayed per rank
        self._sizes: dict[int, int] = {}  # each rank's output size when last relayed
        self._exits: set[int] = set()  # ranks whose exit was relayed
        hub_host, _ = parse_address(spawn.hub, "hub")
        devices = [local_device(d) for d in spawn.devices]
        # an interface name is the host's own: the one this host's traffic leaves by (launch.worker_env: 'lo')
        own = {k: v for k, v in spawn.env.items() if not k.endswith("_SOCKET_IFNAME")}
        interface = interface_of(address)
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if interface and name not in os.environ:
                own[name] = interface
        for rank in spawn.ranks:
            env = worker_env(
                devices, rank, f"tcp:{spawn.hub}", self.shm, extra_sys_path=spawn.extra_sys_path,
                methods=spawn.methods, backend=spawn.backend, threads=threads or spawn.threads, env=own,
                collective_timeout=spawn.collective_timeout,
            )  # fmt: skip
            env.update(
                RP_STATE_DIR=self.live, RP_LAUNCH=self.id, RP_SOURCE_ADDRESS=address, RP_INLINE="1",
                RP_STORE_HOST=hub_host,
            )  # fmt: skip
            with open(self.log(rank), "wb") as log:
                proc = subprocess.Popen(
                    bootstrap_command(), stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env,
                    cwd=self.tmp, start_new_session=True,
                )  # fmt: skip
            proc.stdin.write(key.hex().encode() + b"\n")  # then open: the rank's death pipe
            proc.stdin.flush()
            self.procs[rank] = proc

    def log(self, rank: int) -> str:
        return os.path.join(self.tmp, f"worker{rank}.log")

    def report(self, now: float) -> HostReport:
        """What changed since the last report: reports, processes, exits, output."""
        states, samples, exits, output = {}, {}, {}, {}
        for rank, proc in self.procs.items():
            with contextlib.suppress(OSError):
                with open(state_path(self.live, rank)) as f:
                    text = f.read()
                if text and text != self._states.get(rank):
                    states[rank] = self._states[rank] = text
            code = proc.poll()
            if code is None:
                state = read_state(state_path(self.live, rank)) if rank in self._states else None
                seen = sample(proc.pid, state.reporter if state is not None and state.reporter else None)
                if seen is not None:
                    samples[rank] = seen
            elif rank not in self._exits:
                exits[rank] = code
                self._exits.add(rank)
            with contextlib.suppress(OSError):
                size = os.path.getsize(self.log(rank))
                if size != self._sizes.get(rank):
                    self._sizes[rank] = size
                    output[rank] = Path(self.log(rank)).read_bytes()[-OUTPUT_TAIL:].decode(errors="replace")
        return HostReport(launch=self.id, now=now, states=states, samples=samples, exits=exits, output=output)

    def kill(self, ranks: tuple[int, ...]) -> None:
        for rank in ranks:
            proc = self.procs.get(rank)
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)

    def cancel(self, job: int) -> None:
        Path(self.shm, f"cancel-{job}").touch()

    def ask(self, questions: dict[str, int]) -> None:
        with contextlib.suppress(OSError):
            write_ask(self.live, questions)

    def stop(self, grace: float) -> dict[int, int | None]:
        """Stop every rank (launch.terminate: grace, death pipes, SIGTERM, SIGKILL) and remove the folders."""
        ranks = list(self.procs)
        procs = [self.procs[r] for r in ranks]
        terminate(procs, (self.tmp, self.shm, self.live), grace=grace)
        return {rank: proc.poll() for rank, proc in zip(ranks, procs, strict=True)}


class Agent:
    """The connection to the hub and this host's launches."""

    def __init__(self, hub: tuple[str, int], key: bytes, devices: tuple[str, ...], models: str,
                 address: str | None, threads: int) -> None:  # fmt: skip
        self.hub, self.key, self.devices, self.models = hub, key, devices, models
        self.address, self.threads = address, threads
        self.launches: dict[str, Launch] = {}

    def run(self) -> int:
        """Join the hub, serve it until it goes, stop this host's ranks, join again; forever (Ctrl+C ends it)."""
        waiting = False
        while True:
            try:
                conn = connect(self.hub, self.key, self.address)
            except AuthenticationError:
                _say(
                    f"the hub at {_shown(self.hub)} refused the key: copy the key file from the first host again"
                )
                return 2
            except OSError as exc:
                if not waiting:
                    _say(f"waiting for the hub at {_shown(self.hub)} ({exc.strerror or exc}); retrying every "
                         f"{RETRY_EVERY:g} s")  # fmt: skip
                    waiting = True
                time.sleep(RETRY_EVERY)
                continue
            waiting = False
            try:
                welcome = self._hello(conn)
                if not welcome.ok:
                    _say(f"the hub at {_shown(self.hub)} refused this host: {welcome.why}")
                    if welcome.final:
                        return 2
                    time.sleep(RETRY_EVERY)
                    continue
                _say(f"joined the hub at {_shown(self.hub)}, offering {', '.join(self.devices)}")
                self._serve(conn)
            except (EOFError, OSError) as exc:
                _say(f"the hub at {_shown(self.hub)} is gone ({exc or type(exc).__name__}); stopping this host's "
                     "ranks and waiting for it again")  # fmt: skip
            finally:
                self.stop_all()
                with contextlib.suppress(OSError):
                    conn.close()

    def _hello(self, conn: Connection) -> AgentWelcome:
        import importlib.metadata

        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            address = sock.getsockname()[0]
        self.address = self.address or address
        names = tuple(dict.fromkeys((self.address, socket.gethostname().lower())))
        send_record(conn, AgentHello(
            names=names, address=self.address, devices=self.devices, models=self.models, pid=os.getpid(),
            torch=importlib.metadata.version("torch"), code=code_fingerprint(), threads=self.threads,
        ))  # fmt: skip
        if not conn.poll(30.0):
            raise OSError("no answer to this host's hello")
        welcome = recv_any(conn)
        if not isinstance(welcome, AgentWelcome):
            raise OSError(f"the hub answered a {type(welcome).__name__}")
        return welcome

    def _serve(self, conn: Connection) -> None:
        from .hub import PING, SILENCE

        heard = sent = pinged = time.monotonic()
        while True:
            if conn.poll(REPORT_EVERY / 2):
                record = recv_any(conn)
                heard = time.monotonic()
                self._do(conn, record)
            now = time.monotonic()
            if now - heard > SILENCE:
                raise OSError(f"nothing heard from it for {SILENCE:g} s")
            if now - sent >= REPORT_EVERY:
                for launch in list(self.launches.values()):
                    send_record(conn, launch.report(now))
                sent = now
            if now - pinged >= PING:
                send_record(conn, Ping(now=now))
                pinged = now

    def _do(self, conn: Connection, record: Any) -> None:
        if isinstance(record, SpawnRanks):
            send_record(conn, self._spawn(record))
        elif isinstance(record, StopRanks):
            launch = self.launches.pop(record.launch, None)
            exits = launch.stop(record.grace) if launch is not None else {}
            send_record(conn, Stopped(launch=record.launch, exits=exits))
        elif isinstance(record, KillRanks | CancelJob | AskRanks):
            launch = self.launches.get(record.launch)
            if launch is not None:
                if isinstance(record, KillRanks):
                    launch.kill(record.ranks)
                elif isinstance(record, CancelJob):
                    launch.cancel(record.job)
                else:
                    launch.ask(record.questions)
        elif isinstance(record, CheckFiles):
            send_record(conn, FilesChecked(request=record.request, problems=self._check(record)))
        elif not isinstance(record, Ping):
            raise OSError(f"the hub sent a {type(record).__name__}, which an agent does not take")

    def _spawn(self, spawn: SpawnRanks) -> Spawned:
        wanted = [local_device(spawn.devices[r]) for r in spawn.ranks]
        missing = [d for d in dict.fromkeys(wanted) if wanted.count(d) > self.devices.count(d)]
        if missing:
            return Spawned(spawn.launch, {}, f"it offers {', '.join(self.devices)}, not {', '.join(wanted)}")
        try:
            launch = Launch(spawn, self.address or "", self.key, self.threads)
        except OSError as exc:
            return Spawned(spawn.launch, {}, f"starting its ranks failed: {exc}")
        self.launches[spawn.launch] = launch
        return Spawned(spawn.launch, {rank: proc.pid for rank, proc in launch.procs.items()})

    def _check(self, check: CheckFiles) -> tuple[str, ...]:
        problems = []
        for file in check.files:
            if not os.path.exists(file.path):
                problems.append(f"{file.shown}: not found at {file.path}")
                continue
            try:
                mine = identity(file.path)
            except OSError as exc:
                problems.append(f"{file.shown}: {file.path} cannot be read ({exc.strerror or exc})")
                continue
            from .fileid import FileIdentity

            differs = FileIdentity(file.size, file.digest, file.header).differs(mine)
            if differs:
                problems.append(f"{file.shown}: {file.path} is not the same file: {differs}")
        return tuple(problems)

    def stop_all(self) -> None:
        for launch_id in list(self.launches):
            self.launches.pop(launch_id).stop(0.0)


def _shown(address: tuple[str, int]) -> str:
    return f"{address[0]}:{address[1]}"


def _say(text: str) -> None:
    print(f"[ROCm Parallel agent] {text}", file=sys.stderr, flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--join",
        required=True,
        metavar="ADDRESS:PORT",
        help=f"the first host's ROCM_PARALLEL_LISTEN (its address the hosts reach it by; port {DEFAULT_PORT} by "
        "default)",
    )
    parser.add_argument(
        "--key-file",
        required=True,
        help="a copy of the first host's key file (ComfyUI/user/rocm_parallel/hosts.key there); mode 600",
    )
    parser.add_argument(
        "--devices", required=True, help="this host's devices it offers: '0,1', 'all' or 'cpu x2'"
    )
    parser.add_argument(
        "--models",
        default="",
        help="this host's models folder (ComfyUI/models): files are found here by the names they have under the "
        "first host's; without it, by the same paths",
    )
    parser.add_argument(
        "--address",
        default=None,
        help="this host's address the others reach it by (default: the one its connection to the hub leaves from)",
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads per CPU worker (default: the group's)"
    )


def run(args: argparse.Namespace) -> int:
    """`worker --join`: join the hub and serve it until Ctrl+C or SIGTERM (this host's ranks stop first)."""
    devices = validate_devices(args.devices)
    if any(device_host(d) for d in devices):
        raise ConfigError(
            f"--devices={args.devices!r}: an agent offers its own host's devices, e.g. '0,1' or 'cpu x2'"
        )
    models = str(Path(args.models).expanduser().resolve()) if args.models else ""
    if models and not os.path.isdir(models):
        raise ConfigError(
            f"--models={args.models!r} is not a folder; give this host's ComfyUI/models ({DOCS})"
        )
    agent = Agent(
        parse_address(args.join, "--join"),
        read_key(args.key_file),
        devices,
        models,
        args.address,
        args.threads,
    )

    def leave(signum: int, frame: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, leave)
    try:
        return agent.run()
    except KeyboardInterrupt:
        return 0
    finally:
        agent.stop_all()
