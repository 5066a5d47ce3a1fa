"""Starting a group's worker processes: devices checked, one process per device spawned, each control
connection authenticated (HMAC before anything is read), the process group joined.

`Workers` is one launch: the processes, their connections, logs and private directories, and how to tell
whether (and how) one of them ended. `client.WorkerGroup` owns one at a time (a restart is a new launch).
Workers are plain subprocesses of `sys.executable` that import this very source tree by path, so the
pack works from ComfyUI's custom_nodes/<any folder> as well as pip-installed. The key arrives on the
worker's stdin, which then stays open as the death pipe: when the caller dies, every worker exits.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
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
from typing import TypeVar

import psutil

from .config import ConfigError
from .platforms import (
    AOTRITON_FLAG,
    DeviceSpec,
    check_platform,
    echo_devices,
    gpu_arch,
    missing_gpu_error,
    needs_aotriton_flag,
    parse_devices,
)
from .transport import Hello, Ready, Request, StorePort, private_dir, recv, send

T = TypeVar("T")

PACK_ROOT = Path(__file__).resolve().parent.parent
WORKER_HOST_BYTES = 0.5e9  # host memory one worker process needs at least (python, torch, diffusers)

# Imports the backend as `rocm_parallel.backend` from PACK_ROOT without executing the pack's
# __init__ (which is ComfyUI's entry point) and whatever folder name the pack was installed under.
_BOOTSTRAP = (
    "import sys, types; root = sys.argv[1]; pkg = types.ModuleType('rocm_parallel'); "
    "pkg.__path__ = [root]; sys.modules['rocm_parallel'] = pkg; "
    "from rocm_parallel.backend.worker import main; main()"
)


class WorkerError(RuntimeError):
    """A worker failed: `rank` names it, the message carries its error or exit status."""

    def __init__(self, message: str, rank: int | None = None, remote_type: str | None = None):
        super().__init__(message)
        self.rank, self.remote_type = rank, remote_type
        self.remote_traceback = ""  # the worker's own traceback, also attached as a note


def validate_devices(devices: DeviceSpec, backend: str | None = None) -> tuple[str, ...]:
    """Parse (`platforms.parse_devices`: 'all', '0,1', 'cuda:0,cuda:1', 'cpu x2' or a list) and check a
    device spec before any process starts.

    A GPU may be named twice only with `backend='gloo'` (several workers on one GPU: NCCL/RCCL refuse
    two ranks on one device; gloo does not care, which lets one GPU test the multi-rank paths)."""
    normalized = parse_devices(devices)
    shown = echo_devices(devices)
    kinds = {d.split(":")[0] for d in normalized}
    if len(kinds) > 1:
        raise ConfigError(f"devices={shown} mixes CPU and GPU workers; use only GPUs or only 'cpu'")
    if "cpu" in kinds:
        _check_host_memory(len(normalized), devices)
    if "cuda" in kinds:
        import torch

        available = torch.cuda.device_count()
        indices = [int(d.split(":")[1]) for d in normalized]
        if len(set(indices)) != len(indices) and backend != "gloo":
            raise ConfigError(
                f"devices={shown} names a GPU twice; each worker needs its own GPU "
                "(backend='gloo' allows several workers on one GPU, for testing)"
            )
        missing = [i for i in indices if i >= available]
        if missing:
            raise missing_gpu_error(devices, missing[0], available)
    check_platform(normalized, backend)
    return normalized


def _check_host_memory(workers: int, devices: DeviceSpec) -> None:
    """Each CPU worker is a whole Python process with torch and diffusers: bound the count by host RAM.
    The advice is also bounded by the cores: more CPU workers than cores only share them."""
    available = psutil.virtual_memory().available
    most = max(1, int(available // WORKER_HOST_BYTES))
    if workers > most:
        cores = os.cpu_count() or 1
        advice = max(1, min(most, cores))
        raise ConfigError(
            f"devices={echo_devices(devices)} asks for {workers} CPU workers, which need at least "
            f"{workers * WORKER_HOST_BYTES / 1e9:.0f} GB of host memory ({WORKER_HOST_BYTES / 1e9:g} GB each "
            f"before any model) but {available / 1e9:.1f} GB are available; this machine has {cores} "
            f"core(s), so use 'cpu x{advice}' (CPU workers are for testing)"
        )


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
        PYTHONUNBUFFERED="1",
    )
    if backend:
        out.update(RP_BACKEND=backend)
    if threads:
        out.update(RP_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    # Every socket on loopback: gloo (CPU) and the NCCL/RCCL bootstrap otherwise listen on the
    # interface the hostname resolves to. All workers of a group run on this machine anyway.
    out.setdefault("GLOO_SOCKET_IFNAME", "lo")
    out.setdefault("NCCL_SOCKET_IFNAME", "lo")
    if devices[rank].startswith("cuda") and needs_aotriton_flag(gpu_arch(devices[rank])):
        # The one place this flag is set. RDNA3/4 (gfx11xx/gfx12xx) get flash SDPA from AOTriton only
        # with it set before torch starts; other known archs (MI300X, NVIDIA) do not get it; an arch
        # that cannot be read gets it (harmless where not needed). A user's value wins.
        out.setdefault(AOTRITON_FLAG, "1")
    return out


EnvFor = Callable[[int, str, str], dict[str, str]]  # (rank, socket address, tmpfs dir) -> environment


class Workers:
    """The processes of one launch, their control connections (by rank) and private directories."""

    def __init__(self, devices: Sequence[str], start_timeout: float) -> None:
        self.devices, self.start_timeout = tuple(devices), start_timeout
        self.procs: list[subprocess.Popen[bytes]] = []
        self.conns: list[Connection] = []
        self.tmp = private_dir("ctl")  # mode 0700: only this user reaches the socket
        self.shm = private_dir("shm", tmpfs=True)  # tensor files and cancel flags
        self.closed = False  # stopped: the connections are closed, the directories gone
        self.exit_codes: list[int | None] = []
        self.final_output: list[str] = []  # each rank's last output, read when stopped
        # Runs at interpreter exit too: closing the death pipes first makes the workers leave at once.
        self._finalizer = weakref.finalize(self, terminate, self.procs, (self.tmp, self.shm), 0.0)

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
            for rank in range(len(self.devices)):
                with open(self.log_path(rank), "wb") as log:
                    proc = subprocess.Popen(
                        bootstrap_command(),
                        stdin=subprocess.PIPE,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env_for(rank, address, self.shm),
                        cwd=self.tmp,
                    )
                proc.stdin.write(key.hex().encode() + b"\n")
                proc.stdin.flush()
                self.procs.append(proc)
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

    def _accept(self, listener: Listener, deadline: float) -> Connection:
        # Listener.accept blocks without a timeout; poll its socket so a worker that dies at import time
        # is reported instead of hanging the caller, and drop connections that fail the HMAC challenge
        # (or stay silent through it) instead of failing the start.
        sock = listener._listener._socket
        while True:
            self.raise_if_exited("starting")
            if time.monotonic() > deadline:
                raise WorkerError(f"workers did not connect within {self.start_timeout:.0f} s")
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
            conn = self._accept(listener, deadline)
            hello = self._next_record(conn, Hello, deadline, "connecting")
            by_rank[hello.rank] = conn
        self.conns = [by_rank[r] for r in range(len(self.devices))]
        port = self._next_record(self.conns[0], StorePort, deadline, "opening the store").port
        for conn in self.conns[1:]:
            send(conn, StorePort(port=port))
        for conn in self.conns:
            self._next_record(conn, Ready, deadline, "joining the process group")

    def _next_record(self, conn: Connection, kind: type[T], deadline: float, doing: str) -> T:
        while not conn.poll(0.2):
            self.raise_if_exited("starting")
            if time.monotonic() > deadline:
                raise WorkerError(
                    f"a worker did not finish {doing} within {self.start_timeout:.0f} s (start_timeout)"
                    + self.log_tails()
                )
        try:
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

    def _wait_for_an_exit(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and all(p.poll() is None for p in self.procs):
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
        tails = [(r, self.log_tail(r, 800)) for r in range(len(self.procs))]
        return "".join(f"\nrank {r} output:\n{t}" for r, t in tails if t)

    def exit_report(self, doing: str) -> WorkerError | None:
        """A WorkerError for the first rank that exited (rank, device, pid, exit code, its last output)."""
        for rank, proc in enumerate(self.procs):
            code = proc.poll()
            if code is not None:
                tail = self.log_tail(rank)
                return WorkerError(
                    f"worker rank {rank} ({self.devices[rank]}, pid {proc.pid}) exited with code {code} while "
                    f"{doing}" + (f"; its last output:\n{tail}" if tail else ""),
                    rank,
                )
        return None

    def raise_if_exited(self, doing: str) -> None:
        """When a rank exited: stop the rest and raise its exit report."""
        failure = self.exit_report(doing)
        if failure is not None:
            self.stop(grace=0.0)
            raise failure

    def wait_for_exit(self, rank: int, seconds: float) -> None:
        """Give the OS a moment to report the exit of a rank whose connection closed."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.procs[rank].wait(timeout=seconds)

    @property
    def running(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def stopped(self, rank: int) -> bool:
        """The OS reports rank's process stopped (SIGSTOP, a debugger)."""
        try:
            status = psutil.Process(self.procs[rank].pid).status()
        except psutil.Error:
            return False
        return status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)

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
        the connections and remove the private directories. Idempotent."""
        self.closed = True
        terminate(self.procs, (), grace=grace)
        self.exit_codes = [p.returncode for p in self.procs]
        self.final_output = [self.log_tail(r) for r in range(len(self.procs))]
        self._finalizer()
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


def terminate(procs: list[subprocess.Popen[bytes]], directories: Sequence[str], grace: float = 5.0) -> None:
    """Wait `grace` s for exits, close the death pipes (workers leave at once), SIGTERM, then SIGKILL;
    remove the private directories. With grace 0 (interpreter exit, a failed start) it takes about as
    long as the workers need to notice their closed stdin."""
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        if proc.stdin and not proc.stdin.closed:
            try:
                proc.stdin.close()
            except OSError:
                pass
    deadline = time.monotonic() + 1.0
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)
