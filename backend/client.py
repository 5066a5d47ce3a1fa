"""WorkerGroup: the persistent group of worker processes, one per device, seen from the caller.

Where a request enters: `WorkerGroup.call_all(method, request, timeout=, progress=)` sends the same
`transport.Request` (carrying one payload record from backend/messages.py, or none) to every rank and
returns their reply records (rank 0 first); `call` returns rank 0's. How the processes start is
launch.py; how a job in flight is waited for (cancel, errors) is watch.py, and how a hung rank is told
from a slow one is liveness.py (from the reports each rank writes several times a second, heartbeat.py).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .config import ConfigError
from .launch import (
    PACK_ROOT,
    WorkerError,
    Workers,
    bootstrap_command,
    check_seconds,
    check_threads,
    validate_devices,
    worker_env,
)  # fmt: skip
from .messages import HealthReport, HealthRequest
from .platforms import DeviceSpec, default_cpu_threads
from .transport import (
    Reply,
    Request,
    files_in,
    is_record,
    pack,
    remove_stale_dirs,
    send,
    uninterrupted,
    unpack,
)
from .watch import DEFAULT_WATCHDOG, Job, JobTimeout, ProgressCallback, Watchdog

# The start-up health check: a few bytes all-reduced and all-gathered. NCCL/RCCL set up their
# communicators on the first collective (seconds); a broken peer-to-peer path hangs there forever.
HEALTH_TIMEOUT = 60.0
P2P_FLAG = "NCCL_P2P_DISABLE"

__all__ = [
    "DEFAULT_WATCHDOG", "PACK_ROOT", "JobTimeout", "ProgressCallback", "Watchdog", "WorkerError", "WorkerGroup",
    "bootstrap_command", "check_group_options", "validate_devices",
]  # fmt: skip


def check_group_options(
    threads: object,
    start_timeout: object,
    group: WorkerGroup | None = None,
    devices: Sequence[str] | None = None,
    backend: str | None = None,
) -> None:
    """What `ParallelFlux(...)` passes on to its group, refused before anything starts where it would be
    ignored: a bad thread count or time limit, or devices, backend or threads that differ from those of
    the group it adopts."""
    check_threads(threads)
    check_seconds("start_timeout", start_timeout)
    if group is None:
        return
    if devices is not None and validate_devices(devices, backend or group.backend) != group.devices:
        raise ConfigError(
            f"devices={list(devices)} but the group given runs on {list(group.devices)}; pass one"
        )
    if backend is not None and backend != group.backend:
        raise ConfigError(f"backend={backend!r} but the group given uses {group.backend!r}; pass one")
    if threads is not None and threads != group.threads:
        raise ConfigError(
            f"threads={threads!r} but the group given runs {group.threads} per worker; pass one"
        )


class WorkerGroup:
    """One worker process per device, started once and kept until `close()`.

    Thread-safe: one call runs at a time (a lock owns the connections); a second thread's call waits
    for it, and `busy` says whether a job is running. `cancel()` may be called from any thread.

    >>> with WorkerGroup(["cpu", "cpu"]) as group:
    ...     group.call("ping")
    """

    def __init__(
        self,
        devices: DeviceSpec,
        *,
        threads: int | None = None,
        start_timeout: float = 300.0,
        extra_sys_path: Sequence[str] = (),
        methods: Sequence[str] = (),
        env: dict[str, str] | None = None,
        backend: str | None = None,
        health_timeout: float | None = HEALTH_TIMEOUT,
        retry_without_p2p: bool | None = None,
        watchdog: Watchdog = DEFAULT_WATCHDOG,
    ) -> None:
        """`methods` names extra modules each worker imports at start (found on `extra_sys_path` or in
        the pack); their `@worker.handler` functions become callable methods of this group.

        `threads`: torch threads per worker; CPU workers default to the cores shared out
        (`platforms.default_cpu_threads`). `backend`: None picks NCCL/RCCL for GPUs and gloo for CPU;
        'gloo' runs GPU collectives through gloo and allows several workers on one GPU (tests).
        `health_timeout`: after the workers joined, one small all-reduce and all-gather must finish in
        this many seconds (None skips it). `retry_without_p2p`: when that check hangs or gives a wrong
        result, start the group once more with NCCL_P2P_DISABLE=1 (None: on GPUs only) and say so in
        `warnings`. `watchdog`: how long each sign of a hang must last (liveness.Watchdog); its
        `collective_timeout` is set on the workers' process groups."""
        self.devices = validate_devices(devices, backend)
        check_threads(threads)
        check_seconds("start_timeout", start_timeout)
        check_seconds("health_timeout", health_timeout, optional=True)
        if threads is None and self.devices[0] == "cpu":
            threads = default_cpu_threads(len(self.devices))
        self.threads, self.start_timeout, self.backend = threads, start_timeout, backend
        self.health_timeout, self.watchdog = health_timeout, watchdog
        self.retry_without_p2p = (
            self.devices[0].startswith("cuda") if retry_without_p2p is None else retry_without_p2p
        )
        self._extra_sys_path, self._env, self._methods = (
            tuple(extra_sys_path),
            dict(env or {}),
            tuple(methods),
        )
        self._lock = threading.RLock()
        self._job = 0
        self._running: Job | None = None  # the job in flight (`activity` reads it from any thread)
        self.last_replies: dict[int, Reply] = {}  # what each rank said of the last job (diagnostics)
        self.warnings: list[str] = []  # what start-up changed on its own (shown by the API, nodes, doctor)
        self.health: list[HealthReport] = []  # each rank's health-check figures
        remove_stale_dirs()
        self._start()

    # ---------------------------------------------------------------- start

    @property
    def world_size(self) -> int:
        return len(self.devices)

    def _launch(self) -> None:
        def env_for(rank: int, address: str, shm: str) -> dict[str, str]:
            return worker_env(
                self.devices, rank, address, shm, extra_sys_path=self._extra_sys_path, methods=self._methods,
                backend=self.backend, threads=self.threads, env=self._env,
                collective_timeout=self.watchdog.collective_timeout,
            )  # fmt: skip

        self._workers = Workers(self.devices, self.start_timeout, self.watchdog)
        self._workers.start(env_for)

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
            self._workers.stop(grace=0.0)
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
        try:
            self.health = self.call_all("health_check", HealthRequest(), limit=limit)
        except WorkerError as exc:
            self.close(timeout=1.0)
            raise WorkerError(f"health check failed: {exc}", exc.rank) from exc
        wrong = [h for h in self.health if not h.correct]
        if wrong:
            self.close(timeout=1.0)
            raise WorkerError(
                f"health check failed: rank {wrong[0].rank} ({self.devices[wrong[0].rank]}) got wrong "
                f"collective results ({wrong[0].detail}); peer-to-peer transfers may corrupt data",
                wrong[0].rank,
            )

    # ---------------------------------------------------------------- state

    @property
    def pids(self) -> list[int]:
        return self._workers.pids

    @property
    def exit_codes(self) -> list[int | None]:
        return self._workers.exit_codes

    @property
    def final_output(self) -> list[str]:
        """Each rank's last output, read when the group closed."""
        return self._workers.final_output

    def log_path(self, rank: int) -> str:
        return self._workers.log_path(rank)

    def log_tail(self, rank: int, chars: int = 2000) -> str:
        return self._workers.log_tail(rank, chars)

    @property
    def alive(self) -> bool:
        return not self._workers.closed and self._workers.running

    @property
    def activity(self) -> str | None:
        """What the running job's ranks are doing ('step 3 of 20: 41 s so far, still computing'), from
        their latest reports; None between jobs. Safe to read from any thread (the panel does)."""
        job = self._running
        return job.activity() if job is not None and not job.settled else None

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
        request: Any = None,
        *,
        timeout: float | None = None,
        progress: ProgressCallback | None = None,
        watchdog: Watchdog | None = None,
        cancel_grace: float = 10.0,
        reuse_files: bool = False,
        while_waiting: Callable[[], None] | None = None,
        limit: float | None = None,
        label: str | None = None,
    ) -> list[Any]:
        """Run `method(request)` on every rank (`request`: a payload record, or None); the replies by
        rank. Raises WorkerError on any failure.

        `progress(step, total)` is called for each step rank 0 reports; if it raises (ComfyUI's interrupt
        does), the job is cancelled at the next cancel point on every rank (a few transformer blocks into
        a model call: cancel_points.py; a step's end; a tensor of a load) and the exception re-raised, and
        so does any exception while waiting (Ctrl+C, even inside a send or a receive) or from the check
        `watch.interrupt_check` installs: the group keeps its model; the next call never sees this job's
        messages. `timeout` (seconds) cancels the same way, and a job that does not
        stop within `cancel_grace` seconds after that closes the group. `limit`: a hard limit, past which
        the group is closed (the start-up health check).

        No clock decides that a rank is hung: a rank that is stopped, that its peers wait for while it does
        no work, or that waits in a collective that cannot complete fails the job within seconds
        (`watchdog`: the group's by default; liveness.py), naming it and where it is; a rank that works is
        waited for, however long. A rank that fails fails the job with its own message; when its peers cannot finish (they wait
        for it in a collective) the group is closed too, and `alive` turns False (watch.py). `label` names
        the job in `activity`.

        `reuse_files`: the request's and the replies' tensor files keep fixed names and are rewritten in
        place by the next such call (a call made every step, with tensors of the same size).
        `while_waiting()` runs once the request is sent, before waiting for the replies: work that can
        overlap with the ranks' (an exception from it stops the job like an interrupt).
        """
        if request is not None and not is_record(request):
            raise TypeError(
                f"{method!r}: a request is a registered record or None; got {type(request).__name__}"
            )
        check_seconds("timeout", timeout, optional=True)
        with self._lock:
            workers = self._workers
            if workers.closed:
                raise WorkerError("the worker group is closed; start a new one")
            workers.raise_if_exited(f"running {method!r}")  # it died since the last call
            self._job += 1
            job = Job(
                workers, self._job, method, timeout=timeout, progress=progress, watchdog=watchdog,
                cancel_grace=cancel_grace, limit=limit, label=label,
            )  # fmt: skip
            tag = "request" if reuse_files else f"request-{job.id}"
            packed = pack(request, workers.shm, tag, reuse=reuse_files)
            self._running = job
            try:
                envelope = Request(job=job.id, method=method, payload=packed, reuse_files=reuse_files)
                with uninterrupted():  # every rank gets the request, or none does
                    for rank, conn in enumerate(workers.conns):
                        try:
                            send(conn, envelope)
                        except OSError:  # its process died since the check above
                            job.lost(rank)
                if while_waiting is not None:
                    while_waiting()
                job.collect()
            except BaseException as exc:
                if not job.settled and not workers.closed:
                    job.stop(exc)
                raise
            finally:
                self._running = None
                self.last_replies = dict(job.replies)
                for path in files_in(packed) if not reuse_files else ():
                    _unlink(path)
                _unlink(job.cancel_path)
            results = [unpack(job.replies[r].result, remove=not reuse_files) for r in range(self.world_size)]
            job.outcome()
            return results

    def call(self, method: str, request: Any = None, **options: Any) -> Any:
        """Run `method` on every rank and return rank 0's reply (options as for `call_all`)."""
        return self.call_all(method, request, **options)[0]

    def cancel(self) -> None:
        """Ask the running job to stop at its next cancel point (inside a model call too; safe to call from
        another thread)."""
        if not self._workers.closed:
            Path(self._workers.shm, f"cancel-{self._job}").touch()

    # ---------------------------------------------------------------- shutdown

    def close(self, timeout: float = 15.0) -> None:
        """Ask every worker to leave the group, then terminate, then kill whatever is left."""
        with self._lock:
            self._workers.shutdown(grace=timeout)

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
