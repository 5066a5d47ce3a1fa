"""WorkerGroup: the persistent group of worker processes, one per device, seen from the caller.

Where a request enters: `WorkerGroup.call_all(method, kwargs, timeout=, progress=)` sends the same
`transport.Request` to every rank and returns their results (rank 0 first); `call` returns rank 0's. Workers are plain subprocesses of `sys.executable` that import
this very source tree by path, so the pack works from ComfyUI's custom_nodes/<any folder> as well as
pip-installed. The control channel is a Unix socket in a private temporary directory, authenticated
with a random key handed over on the worker's stdin; stdin then stays open as the death pipe.
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
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge, wait
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import psutil

from .config import ConfigError
from .platforms import AOTRITON_FLAG, check_platform, default_cpu_threads, gpu_arch, needs_aotriton_flag
from .transport import (
    Hello,
    Progress,
    Ready,
    Reply,
    Request,
    StorePort,
    files_in,
    pack,
    private_dir,
    recv,
    remove_stale_dirs,
    send,
    unpack,
)

T = TypeVar("T")

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
        self.remote_traceback = ""  # the worker's own traceback, also attached as a note


class JobTimeout(WorkerError):
    """A job ran past its time limit (the group survives when the job stopped at a step boundary)."""


ProgressCallback = Callable[[int, int], None]


def validate_devices(devices: Sequence[str], backend: str | None = None) -> tuple[str, ...]:
    """Normalize and check a device list before any process starts.

    A GPU may be named twice only with `backend='gloo'` (several workers on one GPU: NCCL/RCCL refuse
    two ranks on one device; gloo does not care, which lets one GPU test the multi-rank paths)."""
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
    if "cpu" in kinds:
        _check_host_memory(len(normalized), devices)
    if "cuda" in kinds:
        import torch

        available = torch.cuda.device_count()
        try:
            indices = [int(d.split(":")[1]) if ":" in d else 0 for d in normalized]
        except ValueError:
            indices = [-1]
        if min(indices) < 0:
            raise ConfigError(
                f"devices={list(devices)}: a GPU is named 'cuda:N' with N = 0, 1, ... (an index, not "
                f"{next(d for d in normalized if not d.removeprefix('cuda:').isdigit())!r})"
            )
        if len(set(indices)) != len(indices) and backend != "gloo":
            raise ConfigError(
                f"devices={list(devices)} names a GPU twice; each worker needs its own GPU "
                "(backend='gloo' allows several workers on one GPU, for testing)"
            )
        missing = [i for i in indices if i >= available]
        if missing:
            raise ConfigError(
                f"devices={list(devices)} asks for GPU {missing[0]} but {available} GPU(s) are visible; "
                f"use indices 0..{available - 1}"
            )
        normalized = tuple(f"cuda:{i}" for i in indices)
    check_platform(normalized, backend)
    return normalized


def _check_host_memory(workers: int, devices: Sequence[str]) -> None:
    """Each CPU worker is a whole Python process with torch and diffusers: bound the count by host RAM."""
    available = psutil.virtual_memory().available
    most = max(1, int(available // WORKER_HOST_BYTES))
    if workers > most:
        raise ConfigError(
            f"devices asks for {workers} CPU workers, which need at least {workers * WORKER_HOST_BYTES / 1e9:.0f} GB "
            f"of host memory ({WORKER_HOST_BYTES / 1e9:g} GB each before any model) but "
            f"{available / 1e9:.1f} GB are available; use at most {most} (e.g. 'cpu x2' for testing)"
        )


def bootstrap_command() -> list[str]:
    return [sys.executable, "-c", _BOOTSTRAP, str(PACK_ROOT)]


@dataclass(frozen=True)
class Watchdog:
    """How long a job may go without a word from the group (a progress record or a reply).

    Every rank reports each step (and each tensor of a load), so a rank that hangs (stopped,
    deadlocked in a collective, a driver that never returns) shows as its own silence: past the limit
    the job fails naming the silent ranks and the group is torn down. Before a rank's first record the
    limit is `first` (imports, a first step that compiles kernels); afterwards it is `factor` times the
    longest gap between one rank's records so far, at least `floor` seconds, so it follows the speed of
    the hardware. A rank the OS reports as stopped (SIGSTOP, a debugger) fails
    the job after `stopped` seconds whatever the phase.
    """

    first: float = 300.0
    floor: float = 8.0
    factor: float = 5.0
    stopped: float = 3.0

    def limit(self, longest_gap: float | None) -> float:
        return self.first if longest_gap is None else max(self.floor, self.factor * longest_gap)


DEFAULT_WATCHDOG = Watchdog()
# After one rank reported an error, how long the others may stay silent before they count as stuck. A
# failure before the first collective (bad input: every rank raises) keeps the group, and so does one
# whose peers keep reporting until they stop at the cancel it triggers (a load); a rank left waiting in
# a collective for the failed one cannot be freed, so the group is torn down and rebuilt on the next call.
FAILURE_GRACE = 2.0
CANCELLED = "JobCancelled"  # the workers' error type for a job stopped by a cancel: not a failure
WORKER_HOST_BYTES = 0.5e9  # host memory one worker process needs at least (python, torch, diffusers)
# The start-up health check: a few bytes all-reduced and all-gathered. NCCL/RCCL set up their
# communicators on the first collective (seconds); a broken peer-to-peer path hangs there forever.
HEALTH_TIMEOUT = 60.0
P2P_FLAG = "NCCL_P2P_DISABLE"


class WorkerGroup:
    """One worker process per device, started once and kept until `close()`.

    Thread-safe: one call runs at a time (a lock owns the connections); a second thread's call waits
    for it, and `busy` says whether a job is running. `cancel()` may be called from any thread.

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
        backend: str | None = None,
        health_timeout: float | None = HEALTH_TIMEOUT,
        retry_without_p2p: bool | None = None,
    ) -> None:
        """`methods` names extra modules each worker imports at start (found on `extra_sys_path` or in
        the pack); their `@worker.handler` functions become callable methods of this group.

        `threads`: torch threads per worker; CPU workers default to the cores shared out
        (`platforms.default_cpu_threads`). `backend`: None picks NCCL/RCCL for GPUs and gloo for CPU;
        'gloo' runs GPU collectives through gloo and allows several workers on one GPU (tests).
        `health_timeout`: after the workers joined, one small all-reduce and all-gather must finish in
        this many seconds (None skips it). `retry_without_p2p`: when that check hangs or gives a wrong
        result, start the group once more with NCCL_P2P_DISABLE=1 (None: on GPUs only) and say so in
        `warnings`."""
        self.devices = validate_devices(devices, backend)
        if threads is None and self.devices[0] == "cpu":
            threads = default_cpu_threads(len(self.devices))
        self.threads, self.start_timeout = threads, start_timeout
        self.backend = backend
        self.health_timeout = health_timeout
        on_gpu = self.devices[0].startswith("cuda")
        self.retry_without_p2p = on_gpu if retry_without_p2p is None else retry_without_p2p
        self._extra_sys_path, self._env = tuple(extra_sys_path), dict(env or {})
        self._methods = tuple(methods)
        self._lock = threading.RLock()
        self._job = 0
        self.last_replies: dict[int, Reply] = {}
        self.warnings: list[str] = []  # what start-up changed on its own (shown by the API, nodes, doctor)
        self.health: list[dict[str, Any]] = []  # each rank's health-check figures
        remove_stale_dirs()
        self._start()

    def _reset(self) -> None:
        """Fresh per-launch state: processes, connections, private directories and their finalizer."""
        self._procs: list[subprocess.Popen[bytes]] = []
        self._conns: list[Connection] = []
        self._closed = False
        self.pids: list[int] = []
        self.exit_codes: list[int | None] = []
        self._tmp = private_dir("ctl")  # mode 0700: only this user reaches the socket
        self._shm = private_dir("shm", tmpfs=True)
        # Runs at interpreter exit too: closing the death pipes first makes the workers leave at once.
        self._finalizer = weakref.finalize(self, _terminate, self._procs, (self._tmp, self._shm), 0.0)

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
        if self.backend:
            env.update(RP_BACKEND=self.backend)
        if self.threads:
            env.update(RP_THREADS=str(self.threads), OMP_NUM_THREADS=str(self.threads))
        # Every socket on loopback: gloo (CPU) and the NCCL/RCCL bootstrap otherwise listen on the
        # interface the hostname resolves to. All workers of a group run on this machine anyway.
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
        if self.devices[rank].startswith("cuda") and needs_aotriton_flag(gpu_arch(self.devices[rank])):
            # The one place this flag is set. RDNA3/4 (gfx11xx/gfx12xx) get flash SDPA from AOTriton only
            # with it set before torch starts; other known archs (MI300X, NVIDIA) do not get it; an arch
            # that cannot be read gets it (harmless where not needed). A user's value wins.
            env.setdefault(AOTRITON_FLAG, "1")
        return env

    def _start(self) -> None:
        """Launch the workers and check their collectives; on a hang, once more without P2P."""
        self._launch()
        if self.health_timeout is None:
            return
        try:
            self._check_health()
        except WorkerError as first:
            if not self.retry_without_p2p or self._env.get(P2P_FLAG, os.environ.get(P2P_FLAG)) == "1":
                raise
            self._shutdown_now()
            self._env[P2P_FLAG] = "1"
            self._launch()
            try:
                self._check_health()
            except WorkerError as second:
                second.add_note(f"before that, with peer-to-peer enabled: {first}")
                raise
            self.warnings.append(
                f"the first collective over {', '.join(self.devices)} failed with peer-to-peer transfers "
                f"enabled ({first}); the worker group was started again with {P2P_FLAG}=1 and now works "
                f"(collectives go through host memory: slower). To make it permanent, start ComfyUI with "
                f"{P2P_FLAG}=1 in its environment (e.g. `{P2P_FLAG}=1 python main.py`); to get fast P2P "
                "back, try the kernel parameter iommu=pt (AMD: amd_iommu=on iommu=pt) and "
                "HSA_FORCE_FINE_GRAIN_PCIE=1, then run `python -m rocm_parallel doctor`"
            )
            print(f"[ROCm Parallel] warning: {self.warnings[-1]}", file=sys.stderr, flush=True)

    def _check_health(self) -> None:
        """One small all-reduce and all-gather on every rank within `health_timeout` seconds, with the
        right results; otherwise the group is closed and a WorkerError raised."""
        limit = float(self.health_timeout or HEALTH_TIMEOUT)
        watchdog = Watchdog(first=limit, floor=limit, factor=1.0)
        try:
            self.health = self.call_all("health_check", watchdog=watchdog)
        except WorkerError as exc:
            if not self._closed:
                self.close(timeout=1.0)
            raise WorkerError(f"health check failed: {exc}", exc.rank) from exc
        wrong = [h for h in self.health if not h.get("correct")]
        if wrong:
            self.close(timeout=1.0)
            raise WorkerError(
                f"health check failed: rank {wrong[0]['rank']} ({self.devices[wrong[0]['rank']]}) got wrong "
                f"collective results ({wrong[0].get('detail')}); peer-to-peer transfers may corrupt data",
                wrong[0]["rank"],
            )

    def _launch(self) -> None:
        self._reset()
        address = os.path.join(self._tmp, "control.sock")
        key = secrets.token_bytes(32)
        listener = Listener(address, family="AF_UNIX", authkey=key)
        try:
            for rank in range(self.world_size):
                with open(self.log_path(rank), "wb") as log:
                    proc = subprocess.Popen(
                        bootstrap_command(),
                        stdin=subprocess.PIPE,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=self._worker_env(rank, address),
                        cwd=self._tmp,
                    )
                proc.stdin.write(key.hex().encode() + b"\n")
                proc.stdin.flush()
                self._procs.append(proc)
                self.pids.append(proc.pid)
            self._handshake(listener)
        except BaseException as exc:
            # The directory (and the socket file in it) may already be gone (`_raise_if_exited` shut the
            # group down): closing must not replace the real error with a FileNotFoundError.
            with contextlib.suppress(OSError):
                listener.close()
            # A WorkerError already names the rank and its log (read before the directory went).
            failure = exc if isinstance(exc, WorkerError) else (self._exit_report("starting") or exc)
            self._shutdown_now()
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
            self._raise_if_exited("starting")
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
        while len(by_rank) < self.world_size:
            conn = self._accept(listener, deadline)
            hello = self._next_record(conn, Hello, deadline, "connecting")
            by_rank[hello.rank] = conn
        self._conns = [by_rank[r] for r in range(self.world_size)]
        port = self._next_record(self._conns[0], StorePort, deadline, "opening the store").port
        for conn in self._conns[1:]:
            send(conn, StorePort(port=port))
        for conn in self._conns:
            self._next_record(conn, Ready, deadline, "joining the process group")

    def _next_record(self, conn: Connection, kind: type[T], deadline: float, doing: str) -> T:
        while not conn.poll(0.2):
            self._raise_if_exited("starting")
            if time.monotonic() > deadline:
                raise WorkerError(
                    f"a worker did not finish {doing} within {self.start_timeout:.0f} s (start_timeout)"
                    + self._log_tails()
                )
        try:
            record = recv(conn)
        except (EOFError, OSError):
            # The worker closed its connection: it is exiting. Its exit status (and log) says why; the
            # OS may need a moment to report it after the socket closed.
            self._wait_for_an_exit(2.0)
            self._raise_if_exited("starting")
            raise WorkerError(f"a worker closed its connection while {doing}" + self._log_tails()) from None
        if not isinstance(record, kind):
            raise WorkerError(
                f"a worker sent {type(record).__name__} while {doing}; expected {kind.__name__}"
            )
        return record

    def _wait_for_an_exit(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and all(p.poll() is None for p in self._procs):
            time.sleep(0.02)

    # ---------------------------------------------------------------- state

    def log_path(self, rank: int) -> str:
        return os.path.join(self._tmp, f"worker{rank}.log")

    def log_tail(self, rank: int, chars: int = 2000) -> str:
        try:
            return Path(self.log_path(rank)).read_bytes()[-chars:].decode(errors="replace").strip()
        except OSError:
            return ""

    def _log_tails(self) -> str:
        tails = [(r, self.log_tail(r, 800)) for r in range(len(self._procs))]
        return "".join(f"\nrank {r} output:\n{t}" for r, t in tails if t)

    def _exit_report(self, doing: str) -> WorkerError | None:
        """A WorkerError for the first rank that exited (rank, device, pid, exit code, its last output)."""
        for rank, proc in enumerate(self._procs):
            code = proc.poll()
            if code is not None:
                tail = self.log_tail(rank)
                return WorkerError(
                    f"worker rank {rank} ({self.devices[rank]}, pid {proc.pid}) exited with code {code} while "
                    f"{doing}" + (f"; its last output:\n{tail}" if tail else ""),
                    rank,
                )
        return None

    def _raise_if_exited(self, doing: str) -> None:
        failure = self._exit_report(doing)
        if failure is not None:
            self._shutdown_now()
            raise failure

    @property
    def alive(self) -> bool:
        return not self._closed and all(p.poll() is None for p in self._procs)

    @property
    def busy(self) -> bool:
        """A job is running (another thread's call would wait for it)."""
        if self._lock.acquire(blocking=False):
            self._lock.release()
            return False
        return True

    # ---------------------------------------------------------------- calls

    def call_all(
        self,
        method: str,
        kwargs: dict[str, Any] | None = None,
        *,
        timeout: float | None = None,
        progress: ProgressCallback | None = None,
        watchdog: Watchdog = DEFAULT_WATCHDOG,
        cancel_grace: float = 10.0,
        reuse_files: bool = False,
        while_waiting: Callable[[], None] | None = None,
    ) -> list[Any]:
        """Run `method(**kwargs)` on every rank; the results by rank. Raises WorkerError on any failure.

        `progress(step, total)` is called for each step rank 0 reports; if it raises (ComfyUI's interrupt
        does), the job is cancelled at the next step boundary on every rank and the exception re-raised.
        `timeout` (seconds) cancels the same way, and so does any exception while waiting (Ctrl+C): the
        next call never sees this job's messages. A job that does not stop within `cancel_grace` seconds
        after a cancel is stuck, and the group is closed. A rank that fails, dies or stays silent past
        `watchdog` fails the job with that rank's own message; when its peers cannot finish (they wait
        for it in a collective) the group is closed too, and `alive` turns False.

        `reuse_files`: the request's and the replies' tensor files keep fixed names and are rewritten in
        place by the next such call (a call made every step, with tensors of the same size).
        `while_waiting()` runs once the request is sent, before waiting for the replies: work that can
        overlap with the ranks' (an exception from it stops the job like an interrupt).
        """
        with self._lock:
            if self._closed:
                raise WorkerError("the worker group is closed; start a new one")
            self._job += 1
            job = Job(self._job, method, self.world_size, timeout, progress, watchdog, cancel_grace)
            if reuse_files:
                packed = pack(kwargs or {}, self._shm, "request", reuse=True)
            else:
                packed = pack(kwargs or {}, self._shm, f"request-{job.id}")
            try:
                for conn in self._conns:
                    send(conn, Request(job=job.id, method=method, kwargs=packed, reuse_files=reuse_files))
                if while_waiting is not None:
                    while_waiting()
                self._collect(job)
            except BaseException as exc:
                if not job.settled and not self._closed:
                    self._stop(job, f"{type(exc).__name__} while waiting")
                raise
            finally:
                self.last_replies = dict(job.replies)  # what each rank said of the last job (diagnostics)
                for path in files_in(packed) if not reuse_files else ():
                    _unlink(path)
                _unlink(self._cancel_path(job.id))
            results = [unpack(job.replies[r].result, remove=not reuse_files) for r in range(self.world_size)]
            if job.interrupt is not None:
                raise job.interrupt
            if job.first_error is not None:  # the failure itself, not the peers' cancels it caused
                raise self._failure(job.first_error)
            failed = [rep for _, rep in sorted(job.replies.items()) if not rep.ok]
            if failed:
                raise self._failure(failed[0])
            return results

    def call(
        self,
        method: str,
        kwargs: dict[str, Any] | None = None,
        *,
        timeout: float | None = None,
        progress: ProgressCallback | None = None,
        watchdog: Watchdog = DEFAULT_WATCHDOG,
        reuse_files: bool = False,
        while_waiting: Callable[[], None] | None = None,
    ) -> Any:
        """Run `method` on every rank and return rank 0's result."""
        return self.call_all(
            method, kwargs, timeout=timeout, progress=progress, watchdog=watchdog, reuse_files=reuse_files,
            while_waiting=while_waiting,
        )[0]  # fmt: skip

    def _failure(self, reply: Reply, note: str = "") -> WorkerError:
        rank = reply.rank
        error = WorkerError(
            f"rank {rank} ({self.devices[rank]}): {reply.error}{note}", rank, reply.error_type
        )
        error.remote_traceback = reply.traceback
        if reply.traceback:
            error.add_note(f"traceback on rank {rank}:\n{reply.traceback.rstrip()}")
        return error

    def _collect(self, job: Job) -> None:
        """Wait for every rank's reply, relaying progress and turning interrupts/timeouts into a cancel."""
        while len(job.replies) < self.world_size:
            pending = [c for r, c in enumerate(self._conns) if r not in job.replies]
            for conn in wait(pending, timeout=0.2):
                rank = self._conns.index(conn)
                try:
                    record = recv(conn)
                except (EOFError, OSError):
                    self._lost(rank, f"running {job.method!r}")
                if getattr(record, "job", None) != job.id:
                    continue  # another job's message: never taken for this one's
                job.heard(rank)
                if isinstance(record, Progress) and record.rank == 0:
                    self._relay(job, record)  # every rank reports (liveness); rank 0 speaks for the job
                elif isinstance(record, Reply):
                    job.replies[rank] = record
                    if not record.ok and record.error_type != CANCELLED and job.first_error is None:
                        # A real failure: stop the peers that can still stop (a load, a step boundary);
                        # those stuck in a collective for the failed rank fall silent (see _check_time).
                        job.first_error = record
                        self._cancel_job(job)
            if len(job.replies) < self.world_size:
                self._raise_if_exited(f"running {job.method!r}")
                self._check_time(job)

    def _relay(self, job: Job, record: Progress) -> None:
        job.last_progress = (record.step, record.total, record.phase)
        if job.progress is None or job.interrupt is not None:
            return
        try:
            job.progress(record.step, record.total)
        except BaseException as exc:  # the caller's interrupt: stop every rank together
            job.interrupt = exc
            self._cancel_job(job)

    def _check_time(self, job: Job) -> None:
        now = time.monotonic()
        pending = [r for r in range(self.world_size) if r not in job.replies]
        quiet_since = max([job.last_heard.get(r, job.started) for r in pending], default=now)
        if job.first_error is not None and now - quiet_since > FAILURE_GRACE:
            self.close(timeout=1.0)
            raise self._failure(
                job.first_error,
                f"; rank(s) {pending} were left waiting for it in a collective, so the worker group was "
                "stopped (the next call starts it again)",
            )
        if job.cancel_deadline is not None and now > job.cancel_deadline:
            self.close(timeout=1.0)
            raise JobTimeout(
                f"{job.method!r} did not stop within {job.cancel_grace:g} s of being cancelled on rank(s) "
                f"{pending}; the worker group was closed",
                pending[0],
            )
        if job.timeout is not None and job.interrupt is None and now - job.started > job.timeout:
            job.interrupt = JobTimeout(
                f"{job.method!r} ran past its time limit of {job.timeout:g} s and was cancelled"
            )
            self._cancel_job(job)
        self._watch(job, pending, now)

    def _watch(self, job: Job, pending: list[int], now: float) -> None:
        stopped = [r for r in pending if _is_stopped(self._procs[r].pid)]
        for rank in stopped:
            job.stopped_since.setdefault(rank, now)
        for rank in list(job.stopped_since):
            if rank not in stopped:
                del job.stopped_since[rank]
        stuck = [r for r, since in job.stopped_since.items() if now - since > job.watchdog.stopped]
        limit = job.watchdog.limit(job.longest_gap)
        # a rank not heard from yet in this job (imports, a first step that compiles) gets `first`
        silent = [
            r
            for r in pending
            if now - job.last_heard.get(r, job.started)
            > (limit if r in job.last_heard else job.watchdog.first)
        ]
        if not stuck and not silent:
            return
        silence = now - min(job.last_heard.get(r, job.started) for r in (silent or pending))
        if stuck:
            rank = stuck[0]
            self._procs[rank].kill()  # SIGTERM waits for a SIGCONT that may never come
            why = (
                f"worker rank {rank} ({self.devices[rank]}, pid {self._procs[rank].pid}) is stopped "
                f"(SIGSTOP or a debugger) while running {job.method!r}"
            )
        else:
            why = (
                f"no progress or reply from rank(s) {silent} ({', '.join(self.devices[r] for r in silent)}) "
                f"for {silence:.0f} s while running {job.method!r} (watchdog limit {limit:.0f} s"
                + (f"; last progress: {job.describe_progress()}" if job.last_progress else "")
                + "); a rank hung in a collective or a device call"
            )
        self.close(timeout=1.0)
        raise WorkerError(why + "; the worker group was stopped (the next call starts it again)", pending[0])

    def _stop(self, job: Job, why: str) -> None:
        """Cancel `job` on every rank and wait for their replies, so nothing of it reaches a later call;
        a rank that does not stop within the grace time is stuck: close the group."""
        self._cancel_job(job)
        deadline = time.monotonic() + job.cancel_grace
        try:
            while len(job.replies) < self.world_size and time.monotonic() < deadline:
                pending = [c for r, c in enumerate(self._conns) if r not in job.replies]
                for conn in wait(pending, timeout=0.2):
                    record = recv(conn)
                    if isinstance(record, Reply) and record.job == job.id:
                        job.replies[self._conns.index(conn)] = record
                if any(p.poll() is not None for p in self._procs):
                    break
        except BaseException:  # a second interrupt, a lost connection: no time for manners
            pass
        if len(job.replies) < self.world_size:
            self.close(timeout=1.0)

    def _cancel_path(self, job: int) -> str:
        return os.path.join(self._shm, f"cancel-{job}")

    def _cancel_job(self, job: Job) -> None:
        if job.cancel_deadline is None:
            job.cancel_deadline = time.monotonic() + job.cancel_grace
        Path(self._cancel_path(job.id)).touch()

    def cancel(self) -> None:
        """Ask the running job to stop after its current step (safe to call from another thread)."""
        if not self._closed:
            Path(self._cancel_path(self._job)).touch()

    def _lost(self, rank: int, doing: str) -> NoReturn:
        """Rank's connection closed: report its exit status (give the OS a moment to reap it)."""
        try:
            self._procs[rank].wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            pass
        self._raise_if_exited(doing)
        self.close(timeout=1.0)
        raise WorkerError(
            f"worker rank {rank} ({self.devices[rank]}) closed its connection while {doing}", rank
        )

    # ---------------------------------------------------------------- shutdown

    def close(self, timeout: float = 15.0) -> None:
        """Ask every worker to leave the group, then terminate, then kill whatever is left."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for conn in self._conns:
                try:
                    send(conn, Request(job=0, method="shutdown"))
                except OSError:
                    pass
            _terminate(self._procs, (), grace=timeout)
            self._finish()

    def _shutdown_now(self) -> None:
        """No clean leave (a start failed, a rank hung): close the death pipes, terminate, kill."""
        self._closed = True
        _terminate(self._procs, (), grace=0.0)
        self._finish()

    def _finish(self) -> None:
        self.exit_codes = [p.returncode for p in self._procs]
        self.final_output = [self.log_tail(r) for r in range(len(self._procs))]
        self._finalizer()
        for conn in self._conns:
            conn.close()

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class Job:
    """What the client knows about the job in flight."""

    id: int
    method: str
    ranks: int
    timeout: float | None
    progress: ProgressCallback | None
    watchdog: Watchdog
    cancel_grace: float
    replies: dict[int, Reply] = field(default_factory=dict)
    interrupt: BaseException | None = None
    first_error: Reply | None = None
    cancel_deadline: float | None = None
    last_progress: tuple[int, int, str] | None = None
    stopped_since: dict[int, float] = field(default_factory=dict)
    longest_gap: float | None = None
    started: float = field(default_factory=time.monotonic)
    last_heard: dict[int, float] = field(default_factory=dict)  # by rank; every rank reports progress

    @property
    def settled(self) -> bool:
        """Every rank replied: nothing of this job can reach a later call."""
        return len(self.replies) >= self.ranks

    def heard(self, rank: int) -> None:
        """A record from `rank`. Gaps between one rank's records measure the job's pace (the watchdog's
        limit follows it); the wait before a rank's first record (imports, compiling) does not count."""
        now = time.monotonic()
        if rank in self.last_heard:
            self.longest_gap = max(self.longest_gap or 0.0, now - self.last_heard[rank])
        self.last_heard[rank] = now

    def describe_progress(self) -> str:
        step, total, phase = self.last_progress or (0, 0, "step")
        return f"{'tensor' if phase == 'load' else 'step'} {step} of {total}"


def _is_stopped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False


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


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _terminate(procs: list[subprocess.Popen[bytes]], directories: Sequence[str], grace: float = 5.0) -> None:
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
