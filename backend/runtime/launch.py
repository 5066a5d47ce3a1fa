"""Starting a group's worker processes: devices checked, one process per device spawned, each control
connection authenticated (HMAC before anything is read), the process group joined.

`Workers` is one launch: the processes, their connections, logs and private directories, and how to tell
whether (and how) one of them ended. `client.WorkerGroup` owns one at a time (a restart is a new launch).
Workers are plain subprocesses of `sys.executable` that import this very source tree by path, so the
pack works from ComfyUI's custom_nodes/<any folder> as well as pip-installed. The key arrives on the
worker's stdin, which then stays open as the death pipe: when the caller dies, every worker exits.

Each worker reports what it is doing several times a second into its own file in a private tmpfs
directory (heartbeat.py), from before it connects: a rank that is stopped or stuck while starting is named
within seconds (liveness.py), not after `start_timeout`. Workers run in a session of their own, so a
Ctrl+C in the caller's terminal reaches the caller alone, which cancels the job on every rank together.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge, wait
from pathlib import Path
from typing import Any, TypeVar

import psutil

from ..config import ConfigError, package_named
from ..platforms import AOTRITON_FLAG, gpu_arch, needs_aotriton_flag
from .exits import MemoryReading, exit_reason, oom_kill_count
from .heartbeat import read_state, state_path, write_ask
from .liveness import DEFAULT_WATCHDOG, Hang, Liveness, Process, Watchdog, describe
from .messages import RankState
from .procstat import sample
from .transport import Hello, Ready, Request, StorePort, private_dir, recv, send, uninterrupted

T = TypeVar("T")

PACK_ROOT = Path(__file__).resolve().parents[2]

# Imports the backend as `rocm_parallel.backend` from PACK_ROOT without executing the pack's
# __init__ (which is ComfyUI's entry point) and whatever folder name the pack was installed under.
_BOOTSTRAP = (
    "import sys, types; root = sys.argv[1]; pkg = types.ModuleType('rocm_parallel'); "
    "pkg.__path__ = [root]; sys.modules['rocm_parallel'] = pkg; "
    "from rocm_parallel.backend.runtime.worker import main; main()"
)


@package_named
class WorkerError(RuntimeError):
    """A worker failed: `rank` names it, the message carries its error or exit status. It and its
    subclasses are named by the package in ComfyUI's error dialog (config.package_named)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        package_named(cls)

    def __init__(self, message: str, rank: int | None = None, remote_type: str | None = None):
        super().__init__(message)
        self.rank, self.remote_type = rank, remote_type
        self.remote_traceback = ""  # the worker's own traceback, also attached as a note


def check_seconds(name: str, value: object, optional: bool = False) -> None:
    """A time limit in seconds: a finite number > 0 (or None when `optional`)."""
    if value is None and optional:
        return
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not 0 < float(value) < float("inf"):  # NaN fails both comparisons
        allowed = "a number of seconds > 0" + (", or None for no limit" if optional else "")
        raise ConfigError(f"{name}={value!r} must be {allowed}")


def bootstrap_command() -> list[str]:
    return [sys.executable, "-c", _BOOTSTRAP, str(PACK_ROOT)]


def worker_env(
    devices: Sequence[str],
    rank: int,
    address: str,
    shm: str,
    *,
    extra_sys_path: Sequence[str] = (),
    methods: Sequence[str] = (),
    backend: str | None = None,
    threads: int | None = None,
    env: dict[str, str] | None = None,
    collective_timeout: float = DEFAULT_WATCHDOG.collective_timeout,
) -> dict[str, str]:
    """The environment of rank `rank`'s process: who it is, where to connect, what to import."""
    out = {**os.environ, **(env or {})}
    out.update(
        RP_RANK=str(rank),
        RP_WORLD_SIZE=str(len(devices)),
        RP_DEVICE=devices[rank],
        RP_ADDRESS=address,
        RP_SHM_DIR=shm,
        RP_EXTRA_SYS_PATH=os.pathsep.join(extra_sys_path),
        RP_METHODS=",".join(methods),
        # The process groups' own timeout, the one the caller's rules assume (liveness.Watchdog).
        RP_COLLECTIVE_TIMEOUT=f"{collective_timeout:g}",
        PYTHONUNBUFFERED="1",
    )
    # The flight recorder keeps this many collectives (torch's default, 2000, makes each dump of its entries
    # ~1 MB of JSON and ~40 ms): the reports look one up only when a rank has waited in it (heartbeat.py).
    # torch 2.9 records nothing unless given a buffer (measured: an empty `pg_status` on 2.9.1; 2.11 and
    # later default to 2000 entries); without it a hung collective reads as 'computing'. A user's value wins.
    out.setdefault("TORCH_FR_BUFFER_SIZE", "256")
    if backend:
        out.update(RP_BACKEND=backend)
    if threads:
        out.update(RP_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    # Every socket on loopback: gloo (CPU) and the NCCL/RCCL bootstrap otherwise listen on the
    # interface the hostname resolves to. All workers of a group run on this machine anyway.
    out.setdefault("GLOO_SOCKET_IFNAME", "lo")
    out.setdefault("NCCL_SOCKET_IFNAME", "lo")
    # torch's flight recorder tells the caller which collective a rank waits in (heartbeat.Collectives).
    if devices[rank].startswith("cuda") and needs_aotriton_flag(gpu_arch(devices[rank])):
        # The one place this flag is set. RDNA3/4 (gfx11xx/gfx12xx) get flash SDPA from AOTriton only
        # with it set before torch starts; other known archs (MI300X, NVIDIA) do not get it; an arch
        # that cannot be read gets it (harmless where not needed). A user's value wins.
        out.setdefault(AOTRITON_FLAG, "1")
    return out


EnvFor = Callable[[int, str, str], dict[str, str]]  # (rank, socket address, tmpfs dir) -> environment


class Workers:
    """The processes of one launch, their control connections (by rank) and private directories."""

    def __init__(
        self, devices: Sequence[str], start_timeout: float, watchdog: Watchdog = DEFAULT_WATCHDOG
    ) -> None:
        self.devices, self.start_timeout, self.watchdog = tuple(devices), start_timeout, watchdog
        self.procs: list[subprocess.Popen[bytes]] = []
        self.conns: list[Connection] = []
        self.tmp = private_dir("ctl")  # mode 0700: only this user reaches the socket
        self.shm = private_dir("shm", tmpfs=True)  # tensor files and cancel flags
        self.live = private_dir("live", tmpfs=True)  # each rank's latest report (heartbeat.py)
        self.closed = False  # stopped: the connections are closed, the directories gone
        self.exit_codes: list[int | None] = []
        self.final_output: list[str] = []  # each rank's last output, read when stopped
        self.left: list[str] = []  # the workers SIGKILL did not end when stopped, in words (`stop`)
        self._ps: dict[int, psutil.Process] = {}
        self._memory: dict[int, MemoryReading] = {}  # each rank's last resident memory (exits.py)
        self._stopped_by_pack: set[int] = set()  # ranks this launch killed itself
        self._oom_kills = oom_kill_count()  # the kernel's count when the launch began
        self._connected: set[int] = set()
        self._liveness: Liveness | None = None
        self._asked: dict[str, int] = {}  # the questions the ranks were last asked (heartbeat.ASK_FILE)
        # Called with each job's start and every look `watch` takes: tests/tools/record_liveness_traces.py
        # records the reports and OS views with it, and tests replay them through `Liveness`.
        self.trace: Callable[[dict[str, Any]], None] | None = None
        # Runs at interpreter exit too: closing the death pipes first makes the workers leave at once.
        directories = (self.tmp, self.shm, self.live)
        self._finalizer = weakref.finalize(self, terminate, self.procs, directories, 0.0)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def start(self, env_for: EnvFor) -> None:
        """Spawn every rank, authenticate its connection and wait until all joined the process group.
        On any failure everything started is stopped and the error names the rank and its output."""
        address = os.path.join(self.tmp, "control.sock")
        key = secrets.token_bytes(32)
        listener = Listener(address, family="AF_UNIX", authkey=key)
        try:
            for rank in self.local_ranks:
                with open(self.log_path(rank), "wb") as log:
                    proc = subprocess.Popen(
                        bootstrap_command(),
                        stdin=subprocess.PIPE,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env={**env_for(rank, address, self.shm), "RP_STATE_DIR": self.live},
                        cwd=self.tmp,
                        start_new_session=True,  # the terminal's Ctrl+C goes to the caller only
                    )
                proc.stdin.write(key.hex().encode() + b"\n")
                proc.stdin.flush()
                self.procs.append(proc)
            self.spawn_elsewhere()
            self._liveness = Liveness(self.devices, self.pids, self.watchdog, time.monotonic())
            self._handshake(listener)
        except BaseException as exc:
            # The directory (and the socket file in it) may already be gone (`raise_if_exited` shut the
            # launch down): closing must not replace the real error with a FileNotFoundError.
            with contextlib.suppress(OSError):
                listener.close()
            # A WorkerError already names the rank and its log (read before the directory went).
            failure = exc if isinstance(exc, WorkerError) else (self.exit_report("starting") or exc)
            self.stop(grace=0.0)
            if failure is exc:
                raise
            raise failure from exc
        listener.close()

    @property
    def local_ranks(self) -> range:
        """The ranks this machine starts (all of them; remote.HostsWorkers: those not on another host)."""
        return range(len(self.devices))

    def spawn_elsewhere(self) -> None:
        """Start the ranks this machine does not (none here; remote.HostsWorkers: other hosts')."""

    def _accept(self, listener: Listener, deadline: float) -> Connection:
        # Listener.accept blocks without a timeout; poll its socket so a worker that dies at import time
        # is reported instead of hanging the caller, and drop connections that fail the HMAC challenge
        # (or stay silent through it) instead of failing the start.
        sock = listener._listener._socket
        while True:
            self._check_starting(deadline, "connecting")
            if not wait([sock], timeout=0.2):
                continue
            try:
                return _authenticated_accept(listener, seconds=5.0)
            except (AuthenticationError, OSError, EOFError):
                continue

    def _handshake(self, listener: Listener) -> None:
        deadline = time.monotonic() + self.start_timeout
        by_rank: dict[int, Connection] = {}
        while len(by_rank) < len(self.devices):
            conn, hello = self._next_hello(listener, deadline)
            by_rank[hello.rank] = conn
            self._connected.add(hello.rank)
        self.conns = [by_rank[r] for r in range(len(self.devices))]
        port = self._next_record(self.conns[0], StorePort, deadline, "opening the store").port
        for conn in self.conns[1:]:
            send(conn, StorePort(port=port))
        for conn in self.conns:
            self._next_record(conn, Ready, deadline, "joining the process group")

    def _next_hello(self, listener: Listener, deadline: float) -> tuple[Connection, Hello]:
        """The next rank to connect, and its Hello."""
        conn = self._accept(listener, deadline)
        return conn, self._next_record(conn, Hello, deadline, "connecting")

    def _next_record(self, conn: Connection, kind: type[T], deadline: float, doing: str) -> T:
        while not conn.poll(0.2):
            self._check_starting(deadline, doing)
        try:
            with uninterrupted():
                record = recv(conn)
        except (EOFError, OSError):
            # The worker closed its connection: it is exiting. Its exit status (and log) says why; the
            # OS may need a moment to report it after the socket closed.
            self._wait_for_an_exit(2.0)
            self.raise_if_exited("starting")
            raise WorkerError(f"a worker closed its connection while {doing}" + self.log_tails()) from None
        if not isinstance(record, kind):
            raise WorkerError(
                f"a worker sent {type(record).__name__} while {doing}; expected {kind.__name__}"
            )
        return record

    def _check_starting(self, deadline: float, doing: str) -> None:
        """While starting: a rank that exited, is stopped or stuck, by name, within seconds; then the
        caller's `start_timeout`, naming the ranks not there yet and what each was doing."""
        self.raise_if_exited("starting")
        now = time.monotonic()
        hang = self.watch(range(len(self.devices)), (), now)
        if hang is not None:
            self.kill(hang.kill)
            connected = (
                " (it had connected)" if hang.ranks[0] in self._connected else " (it had not connected yet)"
            )
            raise WorkerError(hang.why + connected + self.log_tails(), hang.ranks[0])
        if now > deadline:
            late = [r for r in range(len(self.devices)) if r not in self._connected] or list(
                range(len(self.devices))
            )
            assert self._liveness is not None
            where = "; ".join(f"rank {r}: {describe(self._liveness.state(r), now)}" for r in late)
            raise WorkerError(
                f"worker rank(s) {late} did not finish {doing} within {self.start_timeout:.0f} s "
                f"(start_timeout; {where})" + self.log_tails(),
                late[0],
            )

    def watch(
        self, pending: Sequence[int], done: Sequence[int], now: float, failed: bool = False
    ) -> Hang | None:
        """Read every rank's report and the pending ranks' processes, and return the hang among them (or
        None). A rank that has answered still counts with its last report: the collectives it issued."""
        live = self._liveness
        assert live is not None
        looks: dict[int, Any] = {}
        for rank in range(len(self.devices)):
            state = self.state(rank)
            process = self.process(rank, state) if rank in pending else None
            live.observe(rank, now, state, process)
            looks[rank] = (state, process)
        hang = live.verdict(now, pending, done, failed)
        if self.trace is not None:
            self.trace(
                {"now": now, "pending": list(pending), "done": list(done), "failed": failed, "looks": looks}
            )
        if live.questions != self._asked and not self.closed:
            self.ask(live.questions)
            self._asked = dict(live.questions)
        return hang

    def ask(self, questions: dict[str, int]) -> None:
        """Ask every rank about these collectives (heartbeat.write_ask)."""
        with contextlib.suppress(OSError):
            write_ask(self.live, questions)

    def cancel(self, job: int) -> None:
        """Touch job `job`'s cancel flag, which every rank looks for at its cancel points."""
        Path(self.shm, f"cancel-{job}").touch()

    def check_files(self, record: Any) -> None:
        """Whether every rank can read the files `record` names as this process does: here they can
        (remote.HostsWorkers checks other hosts' copies)."""

    def requests_for(self, request: Request) -> list[Request]:
        """The request each rank gets, by rank: the same one here (remote.HostsWorkers: other hosts' with
        their tensors inline and their files checked). Raises before anything is sent."""
        return [request] * len(self.devices)

    def begin(self, method: str, job: int, watchdog: Watchdog | None = None) -> Liveness:
        """A fresh judge for a job, with every rank's latest report (a rank silent since before counts)."""
        old, now = self._liveness, time.monotonic()
        self._liveness = Liveness(self.devices, self.pids, watchdog or self.watchdog, now, method, job)
        if old is not None:
            self._liveness.carry(old.seen)
        states = {rank: self.state(rank) for rank in range(len(self.devices))}
        for rank, state in states.items():
            self._liveness.observe(rank, now, state, None)
        if self.trace is not None:
            self.trace({"now": now, "begin": method, "job": job, "states": states})
        return self._liveness

    def state(self, rank: int) -> RankState | None:
        """Rank's latest report (heartbeat.py), or None before its first."""
        try:
            return read_state(state_path(self.live, rank))
        except (OSError, ValueError, TypeError, KeyError):  # the directory is gone: the group closed
            return None

    def process(self, rank: int, state: RankState | None = None) -> Process | None:
        """What the OS says about rank's process, its threads and children (procstat.py; the reporting
        thread named in `state` left out), None once it is gone; its resident memory is noted (exits.py)."""
        try:
            ps = self._ps.get(rank) or self._ps.setdefault(rank, psutil.Process(self.procs[rank].pid))
            rss = ps.memory_info().rss
            machine = psutil.virtual_memory()
        except psutil.Error:
            return None
        seen = sample(self.procs[rank].pid, state.reporter if state is not None and state.reporter else None)
        if seen is not None and not seen.zombie and rss > 0:  # a dying process has given its memory back
            self._memory[rank] = MemoryReading(rss, machine.available, machine.total, time.monotonic())
        return seen

    def kill(self, ranks: Sequence[int]) -> None:
        """SIGKILL these ranks now, with what they started (a stopped or stuck process ignores SIGTERM and
        the death pipe)."""
        for rank in ranks:
            self._stopped_by_pack.add(rank)
            _kill_group(self.procs[rank])

    def _wait_for_an_exit(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and all(reap(p) is None for p in self.procs):
            time.sleep(0.02)

    # ---------------------------------------------------------------- how they are

    def log_path(self, rank: int) -> str:
        return os.path.join(self.tmp, f"worker{rank}.log")

    def log_tail(self, rank: int, chars: int = 2000) -> str:
        try:
            return Path(self.log_path(rank)).read_bytes()[-chars:].decode(errors="replace").strip()
        except OSError:
            return ""

    def log_tails(self) -> str:
        tails = [(r, self.log_tail(r, 800)) for r in range(len(self.devices))]
        return "".join(f"\nrank {r} output:\n{t}" for r, t in tails if t)

    def exit_report(self, doing: str) -> WorkerError | None:
        """A WorkerError for the first rank that exited (rank, device, pid, exit code, its last output)."""
        for rank, proc in enumerate(self.procs):
            code = reap(proc)
            if code is not None:
                tail = self.log_tail(rank)
                name, why = self.exit_reason(rank, code)
                return WorkerError(
                    f"worker rank {rank} ({self.devices[rank]}, pid {proc.pid}) exited with code {code}{name} "
                    f"while {doing}{why}" + (f"; its last output:\n{tail}" if tail else ""),
                    rank,
                )
        return None

    def exit_reason(self, rank: int, code: int) -> tuple[str, str]:
        """The signal's name, and for a SIGKILL whether the kernel ran out of memory (exits.py)."""
        return exit_reason(
            code,
            stopped_by_pack=rank in self._stopped_by_pack,
            oom_kills_before=self._oom_kills,
            oom_kills_now=oom_kill_count(),
            memory=self._memory.get(rank),
            now=time.monotonic(),
        )

    def raise_if_exited(self, doing: str) -> None:
        """When a rank exited: stop the rest and raise its exit report."""
        failure = self.exit_report(doing)
        if failure is not None:
            self.stop(grace=0.0)
            raise failure

    def wait_for_exit(self, rank: int, seconds: float) -> None:
        """Give the OS a moment to report the exit of a rank whose connection closed."""
        _wait_for_exits([self.procs[rank]], seconds)

    @property
    def running(self) -> bool:
        return all(reap(p) is None for p in self.procs)

    # ---------------------------------------------------------------- the end

    def shutdown(self, grace: float) -> None:
        """Ask every worker to leave the process group cleanly, then `stop`."""
        for conn in self.conns if not self.closed else ():
            try:
                send(conn, Request(job=0, method="shutdown"))
            except OSError:
                pass
        self.stop(grace)

    def stop(self, grace: float) -> None:
        """Wait `grace` s for the processes to leave, then close the death pipes, terminate, kill; close
        the connections and remove the private directories. Never blocks longer than that and a few
        seconds: a worker SIGKILL cannot end (state D) is left to the OS and said (`left`, and on stderr).
        Idempotent."""
        if self.closed:
            self.exit_codes = [reap(p) for p in self.procs]  # a worker left to the OS may have gone since
            return
        self.closed = True
        left = terminate(self.procs, (), grace=grace)
        if left:
            self.left = [
                f"worker rank {self.procs.index(p)} ({self.devices[self.procs.index(p)]}, pid {p.pid}): "
                f"{why_left(p.pid) or 'gone'}"
                for p in left
            ]
            print(
                "[ROCm Parallel] the worker group was closed, but SIGKILL has not ended "
                + "; ".join(self.left)
                + ". It is left to the operating system; the next call starts a new group.",
                file=sys.stderr,
                flush=True,
            )
        self.exit_codes = [p.returncode for p in self.procs]
        self.final_output = [self.log_tail(r) for r in range(len(self.devices))]
        self._finalizer.detach()  # its terminate has run: only the directories are left to remove
        for directory in (self.tmp, self.shm, self.live):
            shutil.rmtree(directory, ignore_errors=True)
        for conn in self.conns:
            conn.close()


def _authenticated_accept(listener: Listener, seconds: float) -> Connection:
    """`Listener.accept()` with a receive timeout on the HMAC challenge: a silent stray connection then
    fails with an OSError instead of blocking the start. (An AF_UNIX socket does not inherit the
    listener's SO_RCVTIMEO, and Connection reads its fd directly, so the timeout is set on the accepted
    socket itself, and cleared once the peer is authenticated: a worker may stay quiet for long.)"""
    conn = listener._listener.accept()
    try:
        _set_receive_timeout(conn, seconds)
        deliver_challenge(conn, listener._authkey)
        answer_challenge(conn, listener._authkey)
        _set_receive_timeout(conn, 0)
    except BaseException:
        conn.close()
        raise
    return conn


def _set_receive_timeout(conn: Connection, seconds: float) -> None:
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:  # the same socket, through a second fd
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(seconds), 0))


# A SIGKILLed worker not gone after this long is left to the OS (see `terminate`): a GPU worker's driver
# may take seconds to tear its context down, a frozen or stuck one never ends by itself.
REAP_SECONDS = 5.0
STUCK_SECONDS = 1.0  # a worker in uninterruptible sleep this long will not leave the group by itself


def terminate(
    procs: list[subprocess.Popen[bytes]], directories: Sequence[str], grace: float = 5.0
) -> list[subprocess.Popen[bytes]]:
    """Wait `grace` s for exits (less once a worker can no longer run: stopped, frozen or stuck in D, its
    peers cannot finish leaving the group either), close the death pipes (workers leave at once), SIGTERM,
    then SIGKILL; remove the private directories. Every wait has a limit: a process SIGKILL does not end
    (uninterruptible sleep in a driver call, a cgroup v1 freezer) is returned, left to the OS, which reaps
    it when the call returns (Popen keeps it on its list of children to reap). With grace 0 (interpreter
    exit, a failed start) it takes about as long as the workers need to notice their closed stdin."""
    _wait_for_exits(procs, grace, stop_early=True)
    for proc in procs:
        if proc.stdin and not proc.stdin.closed:
            try:
                proc.stdin.close()
            except OSError:
                pass
    _wait_for_exits(procs, 1.0)
    asked = []
    for proc in procs:
        if proc.returncode is None:
            if _can_run(proc.pid):
                proc.terminate()
                asked.append(proc)
            else:
                _kill_group(proc)  # SIGTERM would wait for a stopped process to be continued
    _wait_for_exits(asked, 2.0)
    for proc in procs:
        _kill_group(proc)
    _wait_for_exits(procs, REAP_SECONDS)
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)
    return [proc for proc in procs if proc.returncode is None]


def _wait_for_exits(
    procs: Sequence[subprocess.Popen[bytes]], seconds: float, stop_early: bool = False
) -> None:
    """Wait up to `seconds` until every process has exited (and is reaped); with `stop_early`, no longer
    once one that has not exited cannot run (`_can_run` false for `STUCK_SECONDS`)."""
    deadline, stuck = time.monotonic() + seconds, {}
    while any(reap(p) is None for p in procs) and time.monotonic() < deadline:
        if stop_early:
            now = time.monotonic()
            for proc in procs:
                if proc.returncode is None and not _can_run(proc.pid):
                    stuck.setdefault(proc.pid, now)
                else:
                    stuck.pop(proc.pid, None)
            if any(now - since >= STUCK_SECONDS for since in stuck.values()):
                return
        time.sleep(0.05)


def _can_run(pid: int) -> bool:
    """The process can go on by itself: not stopped, not frozen by its cgroup, its main thread not in
    uninterruptible sleep (one look; `_wait_for_exits` asks for it to last)."""
    seen = sample(pid)
    return seen is None or not (seen.stopped or seen.frozen or seen.main_state == "D")


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the worker and every process it started (its own session and process group: launch.py
    starts it with `start_new_session`), while it is not reaped (its pid, the group's id, is not reused
    before that)."""
    if proc.returncode is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        with contextlib.suppress(OSError):
            proc.kill()


def reap(proc: subprocess.Popen[bytes]) -> int | None:
    """`proc.poll()`, but once the worker has exited, what is left of its process group (a child it
    started: a compiler, a driver helper, a vfork child that never exec'd) is SIGKILLed first, while the
    unreaped worker still holds the group's id (no other process can have it yet)."""
    if proc.returncode is not None or not hasattr(os, "waitid"):
        return proc.poll()
    try:
        exited = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped elsewhere
        return proc.poll()
    if exited is None:
        return None
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.poll()


def why_left(pid: int) -> str:
    """What keeps a process SIGKILL did not end, in words ('' when it is gone)."""
    seen = sample(pid)
    if seen is None:
        return ""
    if seen.frozen:
        return f"its cgroup is frozen ({seen.frozen}); it ends when the cgroup is thawed"
    if seen.main_state == "D":
        where = f" at {seen.main_wait}" if seen.main_wait not in ("", "0") else ""
        return f"in uninterruptible sleep (D){where}; it ends when its kernel call returns"
    return f"state {seen.main_state or '?'}"
