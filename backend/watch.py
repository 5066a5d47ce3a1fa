"""A job in flight, seen from the caller: waiting for every rank's reply without ever hanging.

`WorkerGroup.call_all` (client.py) sends a request and hands the waiting to a `Job`: it relays rank 0's
progress, turns the caller's interrupt or `timeout` into a cancel all ranks honour at the same step,
takes the first real failure as the job's error, and watches for ranks that died, were stopped by the
OS or fell silent past the `Watchdog`. When a rank's peers cannot finish (they wait for it in a
collective) the job closes the group; the next call starts a new one.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import NoReturn

from .launch import WorkerError, Workers
from .transport import Progress, Reply, recv

# After one rank reported an error, how long the others may stay silent before they count as stuck. A
# failure before the first collective (bad input: every rank raises) keeps the group, and so does one
# whose peers keep reporting until they stop at the cancel it triggers (a load); a rank left waiting in
# a collective for the failed one cannot be freed, so the group is torn down and rebuilt on the next call.
FAILURE_GRACE = 2.0
CANCELLED = "JobCancelled"  # the workers' error type for a job stopped by a cancel: not a failure

ProgressCallback = Callable[[int, int], None]


class JobTimeout(WorkerError):
    """A job ran past its time limit (the group survives when the job stopped at a step boundary)."""


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


class Job:
    """One call on every rank of `workers`, from the request sent to the last reply."""

    def __init__(
        self,
        workers: Workers,
        id: int,
        method: str,
        *,
        timeout: float | None = None,
        progress: ProgressCallback | None = None,
        watchdog: Watchdog = DEFAULT_WATCHDOG,
        cancel_grace: float = 10.0,
    ) -> None:
        self.workers, self.id, self.method = workers, id, method
        self.timeout, self.progress, self.watchdog, self.cancel_grace = (
            timeout,
            progress,
            watchdog,
            cancel_grace,
        )
        self.replies: dict[int, Reply] = {}
        self.interrupt: BaseException | None = None  # the caller's exception, or a JobTimeout
        self.first_error: Reply | None = None  # the failure itself, not the peers' cancels it caused
        self.cancel_deadline: float | None = None
        self.last_progress: tuple[int, int, str] | None = None
        self.stopped_since: dict[int, float] = {}
        self.longest_gap: float | None = None
        self.started = time.monotonic()
        self.last_heard: dict[int, float] = {}  # by rank; every rank reports progress

    # ---------------------------------------------------------------- state

    @property
    def pending(self) -> list[int]:
        """The ranks that have not replied yet."""
        return [r for r in range(len(self.workers.devices)) if r not in self.replies]

    @property
    def settled(self) -> bool:
        """Every rank replied: nothing of this job can reach a later call."""
        return not self.pending

    @property
    def cancel_path(self) -> str:
        """The flag file the workers look for at each step boundary (WorkerContext.cancel_requested)."""
        return os.path.join(self.workers.shm, f"cancel-{self.id}")

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

    def failure(self, reply: Reply, note: str = "") -> WorkerError:
        """The WorkerError a failed reply becomes: the rank, its device, its message, its traceback."""
        rank = reply.rank
        error = WorkerError(
            f"rank {rank} ({self.workers.devices[rank]}): {reply.error}{note}", rank, reply.error_type
        )
        error.remote_traceback = reply.traceback
        if reply.traceback:
            error.add_note(f"traceback on rank {rank}:\n{reply.traceback.rstrip()}")
        return error

    def outcome(self) -> None:
        """Raise what ended the job: the caller's interrupt or timeout, else the first real failure."""
        if self.interrupt is not None:
            raise self.interrupt
        if self.first_error is not None:
            raise self.failure(self.first_error)
        failed = [reply for _, reply in sorted(self.replies.items()) if not reply.ok]
        if failed:
            raise self.failure(failed[0])

    # ---------------------------------------------------------------- waiting

    def collect(self) -> None:
        """Wait for every rank's reply, relaying progress and turning interrupts/timeouts into a cancel."""
        conns = self.workers.conns
        while not self.settled:
            for conn in wait([conns[r] for r in self.pending], timeout=0.2):
                rank = conns.index(conn)
                try:
                    record = recv(conn)
                except (EOFError, OSError):
                    self.lost(rank)
                if getattr(record, "job", None) != self.id:
                    continue  # another job's message: never taken for this one's
                self.heard(rank)
                if isinstance(record, Progress) and record.rank == 0:
                    self._relay(record)  # every rank reports (liveness); rank 0 speaks for the job
                elif isinstance(record, Reply):
                    self.replies[rank] = record
                    if not record.ok and record.error_type != CANCELLED and self.first_error is None:
                        # A real failure: stop the peers that can still stop (a load, a step boundary);
                        # those stuck in a collective for the failed rank fall silent (see _check_time).
                        self.first_error = record
                        self.cancel()
            if not self.settled:
                self.workers.raise_if_exited(f"running {self.method!r}")
                self._check_time()

    def _relay(self, record: Progress) -> None:
        self.last_progress = (record.step, record.total, record.phase)
        if self.progress is None or self.interrupt is not None:
            return
        try:
            self.progress(record.step, record.total)
        except BaseException as exc:  # the caller's interrupt: stop every rank together
            self.interrupt = exc
            self.cancel()

    def _check_time(self) -> None:
        now, pending = time.monotonic(), self.pending
        quiet = now - max(self.last_heard.get(r, self.started) for r in pending)  # all pending ranks
        if self.first_error is not None and quiet > FAILURE_GRACE:
            self.workers.shutdown(grace=1.0)
            raise self.failure(
                self.first_error,
                f"; rank(s) {pending} were left waiting for it in a collective, so the worker group was "
                "stopped (the next call starts it again)",
            )
        if self.cancel_deadline is not None and now > self.cancel_deadline:
            self.workers.shutdown(grace=1.0)
            raise JobTimeout(
                f"{self.method!r} did not stop within {self.cancel_grace:g} s of being cancelled on rank(s) "
                f"{pending}; the worker group was closed",
                pending[0],
            )
        if self.timeout is not None and self.interrupt is None and now - self.started > self.timeout:
            self.interrupt = JobTimeout(
                f"{self.method!r} ran past its time limit of {self.timeout:g} s and was cancelled"
            )
            self.cancel()
        self._watch(now, pending)

    def _watch(self, now: float, pending: list[int]) -> None:
        """Fail the job (and close the group) when a pending rank is stopped by the OS or silent too long."""
        stopped = [r for r in pending if self.workers.stopped(r)]
        for rank in stopped:
            self.stopped_since.setdefault(rank, now)
        for rank in list(self.stopped_since):
            if rank not in stopped:
                del self.stopped_since[rank]
        stuck = [r for r, since in self.stopped_since.items() if now - since > self.watchdog.stopped]
        limit = self.watchdog.limit(self.longest_gap)
        # a rank not heard from yet in this job (imports, a first step that compiles) gets `first`
        silent = [
            r
            for r in pending
            if now - self.last_heard.get(r, self.started)
            > (limit if r in self.last_heard else self.watchdog.first)
        ]
        if not stuck and not silent:
            return
        devices = self.workers.devices
        silence = now - min(self.last_heard.get(r, self.started) for r in (silent or pending))
        if stuck:
            rank = stuck[0]
            self.workers.procs[rank].kill()  # SIGTERM waits for a SIGCONT that may never come
            why = (
                f"worker rank {rank} ({devices[rank]}, pid {self.workers.pids[rank]}) is stopped "
                f"(SIGSTOP or a debugger) while running {self.method!r}"
            )
        else:
            why = (
                f"no progress or reply from rank(s) {silent} ({', '.join(devices[r] for r in silent)}) "
                f"for {silence:.0f} s while running {self.method!r} (watchdog limit {limit:.0f} s"
                + (f"; last progress: {self.describe_progress()}" if self.last_progress else "")
                + "); a rank hung in a collective or a device call"
            )
        self.workers.shutdown(grace=1.0)
        raise WorkerError(why + "; the worker group was stopped (the next call starts it again)", pending[0])

    # ---------------------------------------------------------------- ending early

    def cancel(self) -> None:
        """Ask every rank to stop at its next step boundary (and start the grace period for it)."""
        if self.cancel_deadline is None:
            self.cancel_deadline = time.monotonic() + self.cancel_grace
        Path(self.cancel_path).touch()

    def stop(self) -> None:
        """Cancel and wait for every rank's reply, so nothing of this job reaches a later call; a rank
        that does not stop within the grace time is stuck: close the group."""
        self.cancel()
        deadline, conns = time.monotonic() + self.cancel_grace, self.workers.conns
        try:
            while not self.settled and time.monotonic() < deadline:
                for conn in wait([conns[r] for r in self.pending], timeout=0.2):
                    record = recv(conn)
                    if isinstance(record, Reply) and record.job == self.id:
                        self.replies[conns.index(conn)] = record
                if not self.workers.running:
                    break
        except BaseException:  # a second interrupt, a lost connection: no time for manners
            pass
        if not self.settled:
            self.workers.shutdown(grace=1.0)

    def lost(self, rank: int) -> NoReturn:
        """Rank's connection closed: report its exit status (give the OS a moment to reap it)."""
        doing = f"running {self.method!r}"
        self.workers.wait_for_exit(rank, 2.0)
        self.workers.raise_if_exited(doing)
        self.workers.shutdown(grace=1.0)
        raise WorkerError(
            f"worker rank {rank} ({self.workers.devices[rank]}) closed its connection while {doing}", rank
        )
