"""WorkerGroup: the persistent group of worker processes, one per device, seen from the caller.

Where a request enters: `WorkerGroup.call_all(method, request, timeout=, progress=)` sends the same
`transport.Request` (carrying one payload record from runtime/messages.py or a model's messages.py, or
none) to every rank and returns their reply records (rank 0 first); `call` returns rank 0's. How the processes start is
launch.py; how a job in flight is waited for (cancel, errors) is watch.py, and how a hung rank is told
from a slow one is liveness.py (from the reports each rank writes several times a second, heartbeat.py).
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..config import ConfigError
from ..platforms import DeviceSpec, check_threads, default_cpu_threads, hosts_of, validate_devices
from . import preflight
from .launch import PACK_ROOT, WorkerError, bootstrap_command, check_seconds, worker_env
from .messages import HealthReport, HealthRequest, HostsLinkReport, HostsLinkRequest, PairReport
from .preflight import Transport
from .remote import WorkerOptions, workers_for
from .transport import (
    Reply,
    Request,
    files_in,
    is_record,
    pack,
    remove_stale_dirs,
    uninterrupted,
    unpack,
)
from .watch import DEFAULT_WATCHDOG, Job, JobTimeout, ProgressCallback, Watchdog

# The start-up health check: a few bytes all-reduced and all-gathered. NCCL/RCCL set up their
# communicators on the first collective (seconds); a broken peer-to-peer path hangs there forever.
HEALTH_TIMEOUT = 60.0

__all__ = [
    "DEFAULT_WATCHDOG", "PACK_ROOT", "JobCancelled", "JobTimeout", "ProgressCallback", "Watchdog", "WorkerError", "WorkerGroup",
    "bootstrap_command", "check_group_options", "validate_devices",
]  # fmt: skip


class JobCancelled(WorkerError):
    """`WorkerGroup.cancel()` ended a loop of calls (`ParallelModel.sample`) between two of them: the user's
    cancel, not a failure (the group keeps its model). The panel shows it as a cancel (registry.is_cancel)."""


def check_group_options(
    threads: object,
    start_timeout: object,
    group: WorkerGroup | None = None,
    devices: Sequence[str] | None = None,
    backend: str | None = None,
) -> None:
    """What `ParallelModel(...)` passes on to its group, refused before anything starts where it would be
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
        `health_timeout`: after the workers joined, one small all-reduce and all-gather, then an exchange
        between every pair of ranks, must finish in this many seconds each (None skips them: the
        transport pre-flight, preflight.py). `retry_without_p2p`: when that check hangs or gives a wrong
        result, start the group again with the next transport (NCCL_P2P_DISABLE=1, then also
        NCCL_PROTO=Simple, then gloo; None: on GPUs only) and say so in `warnings`; `transport` and
        `transport_why` say what it runs on. `watchdog`: how long each sign of a hang must last (liveness.Watchdog); its
        `collective_timeout` is set on the workers' process groups. `self.watchdog` may be replaced between jobs
        (the next job's rules use it; the collective timeout stays the one the workers started with)."""
        backend = preflight.forced_backend(backend)
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
        self.cancels = 0  # how many times `cancel()` was called: a loop of calls stops when it changes
        self.last_replies: dict[int, Reply] = {}  # what each rank said of the last job (diagnostics)
        self.warnings: list[str] = []  # what start-up changed on its own (shown by the API, nodes, doctor)
        self.health: list[HealthReport] = []  # each rank's health-check figures
        self.pairs: list[PairReport] = []  # each rank's exchange with every other (the pre-flight)
        # across hosts: rank 0's measure of the link inside its host and of the network (the pre-flight)
        self.hosts_link: HostsLinkReport | None = None
        # how the collectives travel, and why (preflight.py; set by the start)
        self.transport, self.transport_why = preflight.P2P, ""
        remove_stale_dirs()
        self._start()

    # ---------------------------------------------------------------- start

    @property
    def world_size(self) -> int:
        return len(self.devices)

    def _launch(self, transport: Transport) -> None:
        options = WorkerOptions(
            extra_sys_path=self._extra_sys_path, methods=self._methods, backend=transport.backend or self.backend,
            threads=self.threads, env=preflight.worker_env(transport, self._env),
            collective_timeout=self.watchdog.collective_timeout,
        )  # fmt: skip

        def env_for(rank: int, address: str, shm: str) -> dict[str, str]:
            return worker_env(self.devices, rank, address, shm, **dataclasses.asdict(options))

        # ranks on other hosts are started through their agents (remote.py); a group here alone as always
        self._workers = workers_for(self.devices, self.start_timeout, self.watchdog, options)
        self._workers.start(env_for)

    def _start(self) -> None:
        """Launch the workers and run the transport pre-flight (preflight.py): when its probe hangs or
        gives wrong results, start once more with the next transport of the ladder, and say so."""
        plan = preflight.plan_transports(
            self.devices, self.backend, {**os.environ, **self._env}, retry=self.retry_without_p2p
        )
        tried: list[tuple[Transport, WorkerError]] = []
        for transport in plan.ladder:
            self._launch(transport)
            if self.health_timeout is None:
                break
            try:
                self._check_health()
                break
            except WorkerError as exc:
                tried.append((transport, exc))
                if transport is plan.ladder[-1]:
                    for earlier, error in tried[:-1]:
                        exc.add_note(f"before that, with {earlier.settings}: {error}")
                    raise
        self.transport, self.transport_why = transport, plan.why
        self._env.update(transport.env)  # a later start (none today) keeps what works
        if tried:
            self.transport_why = ", ".join(t.settings for t, _ in tried) + preflight.FAILED
            self._warn(preflight.fallback_warning(self.devices, [(t, str(e)) for t, e in tried], transport))
        if transport.backend == "gloo" and (tried or any(d.startswith("cuda") for d in self.devices)):
            self._warn_gloo_cost(plan.why if not tried else None)  # GPUs on gloo, or fallen back to it

    def _warn(self, text: str) -> None:
        self.warnings.append(text)
        print(f"[ROCm Parallel] warning: {text}", file=sys.stderr, flush=True)

    def _warn_gloo_cost(self, why: str | None) -> None:
        """GPUs on gloo: measure gloo's link here and let the planner say what it costs."""
        from .messages import LinkRequest

        if self.world_size < 2:
            return
        link = self.call("measure_link", LinkRequest(megabytes=8.0, repeats=2), limit=float(HEALTH_TIMEOUT))
        self._warn(
            (f"{why}; " if why else "collectives run through gloo; ")
            + preflight.gloo_cost(self.world_size, link.gbps, link.latency_us)
        )

    @property
    def transport_note(self) -> str | None:
        """One line for the loader's panel when the group is not on the fastest transport."""
        return preflight.short_note(self.transport, fell_back=self.transport_why.endswith(preflight.FAILED))

    def _check_health(self) -> None:
        """One small all-reduce and all-gather on every rank within `health_timeout` seconds, with the
        right results; otherwise the group is closed and a WorkerError raised."""
        limit = float(self.health_timeout or HEALTH_TIMEOUT)
        try:
            self.health = self.call_all("health_check", HealthRequest(), limit=limit)
            wrong = [(h.rank, h.detail) for h in self.health if not h.correct]
            if not wrong and self.world_size > 1:
                self.pairs = self.call_all("probe_pairs", HealthRequest(), limit=limit)
                wrong = [(p.rank, p.detail) for p in self.pairs if not p.correct]
            hosts = tuple(tuple(ranks) for _, ranks in hosts_of(self.devices))
            if not wrong and len(hosts) > 1:  # the network between hosts, for the planner (plan/cost.py)
                self.hosts_link = self.call("measure_hosts", HostsLinkRequest(hosts), limit=limit)
        except WorkerError as exc:
            self.close(timeout=1.0)
            raise WorkerError(f"health check failed: {exc}", exc.rank) from exc
        if wrong:
            self.close(timeout=1.0)
            rank, detail = wrong[0]
            raise WorkerError(
                f"health check failed: rank {rank} ({self.devices[rank]}) got wrong "
                f"collective results ({detail}); peer-to-peer transfers may corrupt data",
                rank,
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
        so does any exception while waiting (Ctrl+C wherever it lands: before the request is sent nothing
        is waited for, while it is sent every rank gets it first) or from the check
        `watch.interrupt_check` installs: the group keeps its model; the next call never sees this job's
        messages, nor its files. `timeout` (seconds) cancels the same way, and a job that does not
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
            _sweep(workers.shm)
            self._job += 1
            job: Job | None = None
            tag = "request" if reuse_files else f"request-{self._job}"
            try:
                # A Ctrl+C from here to the last rank's send is held, and raised once every rank has the
                # request or none has (Job.send): a job is either not started (nothing to wait for) or
                # started everywhere (cancelled together, at the same step), never half of each.
                with uninterrupted():
                    job = Job(
                        workers, self._job, method, timeout=timeout, progress=progress,
                        watchdog=watchdog or self.watchdog,
                        cancel_grace=cancel_grace, limit=limit, label=label,
                    )  # fmt: skip
                    self._running = job
                    payload = pack(request, workers.shm, tag, reuse=reuse_files)
                    job.send(Request(job=job.id, method=method, payload=payload, reuse_files=reuse_files))
                if while_waiting is not None:
                    while_waiting()
                job.collect()
                with uninterrupted():  # each reply's tensor files read and removed whole
                    results = [
                        unpack(job.replies[r].result, remove=not reuse_files) for r in range(self.world_size)
                    ]
            except BaseException as exc:
                if job is not None and not job.settled and not workers.closed:
                    job.stop(exc)
                raise
            finally:
                with uninterrupted():  # nothing of this job stays behind, however it ended
                    self._running = None
                    if job is not None:
                        self.last_replies = dict(job.replies)
                        _remove_files(job, tag, reuse_files)
            job.outcome()
            return results

    def check_files(self, request: Any) -> None:
        """ConfigError, before anything is sent, when a rank on another host lacks a file `request` names or
        holds another file under its name (remote.py; nothing to check on one host)."""
        with self._lock:
            self._workers.check_files(request)

    def call(self, method: str, request: Any = None, **options: Any) -> Any:
        """Run `method` on every rank and return rank 0's reply (options as for `call_all`)."""
        return self.call_all(method, request, **options)[0]

    def cancel(self) -> None:
        """Ask the running job to stop at its next cancel point (inside a model call too), and a loop of jobs
        (`ParallelModel.sample`: one model call per step) to stop before its next one (`cancels`). Safe to
        call from another thread."""
        self.cancels += 1
        job = self._running
        if job is not None and not self._workers.closed:
            job.cancel()

    # ---------------------------------------------------------------- shutdown

    def close(self, timeout: float = 15.0) -> None:
        """Ask every worker to leave the group, then terminate, then kill whatever is left."""
        with self._lock:
            self._workers.shutdown(grace=timeout)

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# The files of one job (`pack` names them after the job; the reused ones, `request-0.bin` and
# `result-1-0.bin`, are rewritten by the next such call and are kept) and cancel flags.
_JOB_FILES = re.compile(r"(?:request-\d+-\d+-\d+|result-\d+-\d+-\d+-\d+)\.bin|cancel-\d+")


def _sweep(shm: str) -> None:
    """Remove what earlier jobs left in the group's folder: a call removes its own files as it ends, but a
    Ctrl+C can land before that cleanup starts. Run under the group's lock, with no job in flight."""
    for name in os.listdir(shm):
        if _JOB_FILES.fullmatch(name):
            _unlink(os.path.join(shm, name))


def _remove_files(job: Job, tag: str, reused: bool) -> None:
    """A finished job's files: its cancel flag and, unless they are reused by the next call, the request's
    tensor files (those `pack` wrote before it failed too) and any reply file nobody read (a job stopped
    after some ranks had replied)."""
    _unlink(job.cancel_path)
    if reused:
        return
    for path in Path(job.workers.shm).glob(f"{tag}-*.bin"):
        _unlink(str(path))
    for reply in job.replies.values():
        for path in files_in(reply.result):
            _unlink(path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
