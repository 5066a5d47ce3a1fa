"""WorkerGroup: the persistent group of worker processes, one per device, seen from the caller.

Where a request enters: `WorkerGroup.call(method, **kwargs)` sends the same request to every rank and
returns their replies (rank 0 first). Workers are plain subprocesses of `sys.executable` that import
this very source tree by path, so the pack works from ComfyUI's custom_nodes/<any folder> as well as
pip-installed. The control channel is a Unix socket in a private temporary directory, authenticated
with a random key handed over on the worker's stdin; stdin then stays open as the death pipe.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, Listener, wait
from pathlib import Path
from typing import Any, NoReturn

from .config import ConfigError
from .transport import files_in, pack, private_dir, unpack
from .worker import recv, send

PACK_ROOT = Path(__file__).resolve().parent.parent

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


class JobTimeout(WorkerError):
    """A job ran past its time limit (the group survives when the job stopped at a step boundary)."""


ProgressCallback = Callable[[int, int], None]


def validate_devices(devices: Sequence[str]) -> tuple[str, ...]:
    """Normalize and check a device list before any process starts."""
    if not devices:
        raise ConfigError(
            "devices=[] is empty; give at least one device, e.g. ['cuda:0', 'cuda:1'] or ['cpu', 'cpu']"
        )
    normalized = tuple(str(d).strip().lower() for d in devices)
    kinds = {d.split(":")[0] for d in normalized}
    if not kinds <= {"cpu", "cuda"}:
        raise ConfigError(
            f"devices={list(devices)}: only 'cpu' and 'cuda:N' (ROCm GPUs are 'cuda:N' too) are supported"
        )
    if len(kinds) > 1:
        raise ConfigError(f"devices={list(devices)} mixes CPU and GPU workers; use only GPUs or only 'cpu'")
    if "cuda" in kinds:
        import torch

        available = torch.cuda.device_count()
        indices = [int(d.split(":")[1]) if ":" in d else 0 for d in normalized]
        if len(set(indices)) != len(indices):
            raise ConfigError(f"devices={list(devices)} names a GPU twice; each worker needs its own GPU")
        missing = [i for i in indices if i >= available]
        if missing:
            raise ConfigError(
                f"devices={list(devices)} asks for GPU {missing[0]} but {available} GPU(s) are visible; "
                f"use indices 0..{available - 1}"
            )
        normalized = tuple(f"cuda:{i}" for i in indices)
    return normalized


def bootstrap_command() -> list[str]:
    return [sys.executable, "-c", _BOOTSTRAP, str(PACK_ROOT)]


class WorkerGroup:
    """One worker process per device, started once and kept until `close()`.

    >>> with WorkerGroup(["cpu", "cpu"]) as group:
    ...     group.call("ping")
    """

    def __init__(
        self,
        devices: Sequence[str],
        *,
        threads: int | None = None,
        start_timeout: float = 300.0,
        extra_sys_path: Sequence[str] = (),
        methods: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        """`methods` names extra modules each worker imports at start (found on `extra_sys_path` or in
        the pack); their `@worker.handler` functions become callable methods of this group."""
        self.devices = validate_devices(devices)
        self.threads, self.start_timeout = threads, start_timeout
        self._extra_sys_path, self._env = tuple(extra_sys_path), dict(env or {})
        self._methods = tuple(methods)
        self._procs: list[subprocess.Popen[bytes]] = []
        self._conns: list[Connection] = []
        self._tmp: str | None = None
        self._shm = private_dir()
        self._closed = False
        self._job = 0
        self.pids: list[int] = []
        self.exit_codes: list[int | None] = []
        self._start()
        self._finalizer = weakref.finalize(self, _terminate, self._procs, self._tmp, self._shm)
        atexit.register(self._finalizer)

    # ---------------------------------------------------------------- start

    @property
    def world_size(self) -> int:
        return len(self.devices)

    def _worker_env(self, rank: int, address: str) -> dict[str, str]:
        env = {**os.environ, **self._env}
        env.update(
            RP_RANK=str(rank),
            RP_WORLD_SIZE=str(self.world_size),
            RP_DEVICE=self.devices[rank],
            RP_ADDRESS=address,
            RP_SHM_DIR=self._shm,
            RP_EXTRA_SYS_PATH=os.pathsep.join(self._extra_sys_path),
            RP_METHODS=",".join(self._methods),
            PYTHONUNBUFFERED="1",
        )
        if self.threads:
            env.update(RP_THREADS=str(self.threads), OMP_NUM_THREADS=str(self.threads))
        # Every socket on loopback: gloo (CPU) and the NCCL/RCCL bootstrap otherwise listen on the
        # interface the hostname resolves to. All workers of a group run on this machine anyway.
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
        if self.devices[0].startswith("cuda"):
            # RDNA3 (RX 7000) gets flash SDPA from AOTriton only with this set before torch starts; on
            # officially supported GPUs (MI300X) and on NVIDIA it changes nothing. A user's value wins.
            env.setdefault("TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL", "1")
        return env

    def _start(self) -> None:
        self._tmp = tempfile.mkdtemp(prefix="rocm-parallel-")  # mode 0700: only this user reaches the socket
        address = os.path.join(self._tmp, "control.sock")
        key = secrets.token_bytes(32)
        listener = Listener(address, family="AF_UNIX", authkey=key)
        try:
            for rank in range(self.world_size):
                log = open(self.log_path(rank), "wb")
                proc = subprocess.Popen(
                    bootstrap_command(),
                    stdin=subprocess.PIPE,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self._worker_env(rank, address),
                    cwd=self._tmp,
                )
                log.close()
                proc.stdin.write(key.hex().encode() + b"\n")
                proc.stdin.flush()
                self._procs.append(proc)
                self.pids.append(proc.pid)
            self._handshake(listener)
        except BaseException:
            _terminate(self._procs, self._tmp, self._shm)
            self._closed = True
            raise
        finally:
            listener.close()

    def _accept(self, listener: Listener, deadline: float) -> Connection:
        # Listener.accept blocks without a timeout; poll its socket so a worker that dies at import time
        # is reported instead of hanging the caller.
        sock = listener._listener._socket
        while True:
            self._check_alive("starting")
            if time.monotonic() > deadline:
                raise WorkerError(f"workers did not connect within {self.start_timeout:.0f} s")
            if wait([sock], timeout=0.2):
                return listener.accept()

    def _handshake(self, listener: Listener) -> None:
        deadline = time.monotonic() + self.start_timeout
        by_rank: dict[int, Connection] = {}
        for _ in range(self.world_size):
            conn = self._accept(listener, deadline)
            by_rank[recv(conn)["hello"]] = conn
        self._conns = [by_rank[r] for r in range(self.world_size)]
        port = self._expect(0, "store_port", deadline)
        for conn in self._conns[1:]:
            send(conn, {"store_port": port})
        for rank in range(self.world_size):
            self._expect(rank, "ready", deadline)

    def _expect(self, rank: int, key: str, deadline: float) -> Any:
        conn = self._conns[rank]
        while not conn.poll(0.2):
            self._check_alive("starting")
            if time.monotonic() > deadline:
                raise WorkerError(
                    f"worker rank {rank} did not report {key!r} within {self.start_timeout:.0f} s", rank
                )
        return recv(conn)[key]

    # ---------------------------------------------------------------- calls

    def log_path(self, rank: int) -> str:
        return os.path.join(self._tmp or "", f"worker{rank}.log")

    def log_tail(self, rank: int, chars: int = 2000) -> str:
        try:
            return Path(self.log_path(rank)).read_bytes()[-chars:].decode(errors="replace").strip()
        except OSError:
            return ""

    def _check_alive(self, doing: str) -> None:
        for rank, proc in enumerate(self._procs):
            code = proc.poll()
            if code is not None:
                tail = self.log_tail(rank)
                self.close(timeout=2.0)
                raise WorkerError(
                    f"worker rank {rank} ({self.devices[rank]}, pid {proc.pid}) exited with code {code} while "
                    f"{doing}" + (f"; its last output:\n{tail}" if tail else ""),
                    rank,
                )

    def _lost(self, rank: int, doing: str) -> NoReturn:
        """Rank's connection closed: report its exit status (give the OS a moment to reap it)."""
        try:
            self._procs[rank].wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            pass
        self._check_alive(doing)
        self.close(timeout=2.0)
        raise WorkerError(
            f"worker rank {rank} ({self.devices[rank]}) closed its connection while {doing}", rank
        )

    @property
    def alive(self) -> bool:
        return not self._closed and all(p.poll() is None for p in self._procs)

    def call_all(
        self,
        method: str,
        timeout: float | None = None,
        progress: ProgressCallback | None = None,
        cancel_grace: float = 10.0,
        **kwargs: Any,
    ) -> list[Any]:
        """Run `method` on every rank; the list of results by rank. Raises WorkerError on any failure.

        `progress(step, total)` is called for each step rank 0 reports; if it raises (ComfyUI's interrupt
        does), the job is cancelled at the next step boundary on every rank and the exception re-raised.
        `timeout` (seconds) cancels the same way; a job that does not stop within `cancel_grace` seconds
        after that is stuck, and the group is closed.
        """
        if self._closed:
            raise WorkerError("the worker group is closed; start a new one")
        self._job += 1
        job = self._job
        packed = pack(kwargs, self._shm, f"request-{job}")
        try:
            for conn in self._conns:
                send(conn, {"method": method, "kwargs": packed, "job": job})
            replies, interrupt = self._collect(method, job, timeout, progress, cancel_grace)
        finally:
            for path in files_in(packed):
                _unlink(path)
            _unlink(os.path.join(self._shm, f"cancel-{job}"))
        results = [unpack(replies[r].get("result")) for r in range(self.world_size)]
        if interrupt is not None:
            raise interrupt
        failed = [(r, rep) for r, rep in sorted(replies.items()) if not rep["ok"]]
        if failed:
            rank, rep = failed[0]
            raise WorkerError(f"rank {rank} ({self.devices[rank]}): {rep['error']}", rank, rep["type"])
        return results

    def _collect(
        self,
        method: str,
        job: int,
        timeout: float | None,
        progress: ProgressCallback | None,
        cancel_grace: float,
    ) -> tuple[dict[int, dict[str, Any]], BaseException | None]:
        """Wait for every rank's reply, relaying progress and turning interrupts/timeouts into a cancel."""
        replies: dict[int, dict[str, Any]] = {}
        interrupt: BaseException | None = None
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(replies) < self.world_size:
            pending = [c for r, c in enumerate(self._conns) if r not in replies]
            for conn in wait(pending, timeout=0.2):
                try:
                    message = recv(conn)
                except (EOFError, OSError):
                    self._lost(self._conns.index(conn), f"running {method!r}")
                if "progress" in message:
                    if progress is not None and interrupt is None:
                        try:
                            progress(message["progress"], message["total"])
                        except BaseException as exc:  # the caller's interrupt: stop every rank together
                            interrupt = exc
                            self.cancel()
                    continue
                replies[self._conns.index(conn)] = message
            if len(replies) < self.world_size:
                self._check_alive(f"running {method!r}")
            if deadline is not None and time.monotonic() > deadline:
                if interrupt is None:
                    interrupt = JobTimeout(
                        f"{method!r} ran past its time limit of {timeout:g} s and was cancelled"
                    )
                    self.cancel()
                    deadline = time.monotonic() + cancel_grace
                else:
                    late = [r for r in range(self.world_size) if r not in replies]
                    self.close(timeout=2.0)
                    raise JobTimeout(
                        f"{method!r} did not stop within {cancel_grace:g} s of being cancelled on rank(s) {late}; "
                        "the worker group was closed",
                        late[0],
                    )
        return replies, interrupt

    def cancel(self) -> None:
        """Ask the running job to stop after its current step (safe to call from another thread)."""
        Path(self._shm, f"cancel-{self._job}").touch()

    def call(
        self,
        method: str,
        timeout: float | None = None,
        progress: ProgressCallback | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run `method` on every rank and return rank 0's result."""
        return self.call_all(method, timeout=timeout, progress=progress, **kwargs)[0]

    # ---------------------------------------------------------------- shutdown

    def close(self, timeout: float = 15.0) -> None:
        """Ask every worker to leave the group, then terminate, then kill whatever is left."""
        if self._closed:
            return
        self._closed = True
        for conn in self._conns:
            try:
                send(conn, {"method": "shutdown"})
            except OSError:
                pass
        _terminate(self._procs, None, None, grace=timeout)
        self.exit_codes = [p.returncode for p in self._procs]
        self.final_output = [self.log_tail(r) for r in range(len(self._procs))]
        _terminate(self._procs, self._tmp, self._shm)
        for conn in self._conns:
            conn.close()

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _terminate(
    procs: list[subprocess.Popen[bytes]], tmp: str | None, shm: str | None, grace: float = 5.0
) -> None:
    """Wait for exits, then SIGTERM, then SIGKILL; close the death pipes; remove the private directories."""
    deadline = time.monotonic() + grace
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
        if proc.stdin and not proc.stdin.closed:
            try:
                proc.stdin.close()
            except OSError:
                pass
    for directory in (tmp, shm):
        if directory:
            shutil.rmtree(directory, ignore_errors=True)
