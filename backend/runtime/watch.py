"""A job in flight, seen from the caller: waiting for every rank's reply without ever hanging.

`WorkerGroup.call_all` (client.py) sends a request and hands the waiting to a `Job`: it relays rank 0's
progress, turns the caller's interrupt or `timeout` into a cancel all ranks honour at the same step,
takes the first real failure as the job's error, and asks `liveness.Liveness` at every poll whether a
rank is hung: stopped, stuck in a native call, or waiting in a collective that cannot complete. A rank
that is computing or loading is waited for however long it takes. When a rank is hung, or a failed
rank's peers wait for it in a collective, the job closes the group; the next call starts a new one.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from multiprocessing.connection import wait
from typing import NoReturn

from .launch import WorkerError, Workers
from .liveness import DEFAULT_WATCHDOG, Hang, Liveness, Watchdog, collective_text, describe
from .messages import GroupState
from .transport import Progress, Reply, Request, recv, send, uninterrupted

CANCELLED = "JobCancelled"  # the workers' error type for a job stopped by a cancel: not a failure
POLL = 0.2  # seconds between looks at the ranks' reports while waiting
HINT_AFTER = 2.0  # a Ctrl+C still waiting for the current step this long says so, and how to force it

ProgressCallback = Callable[[int, int], None]

__all__ = [
    "CANCELLED", "DEFAULT_WATCHDOG", "Job", "JobTimeout", "ProgressCallback", "Watchdog", "interrupt_check",
]  # fmt: skip

_CHECK: ContextVar[Callable[[], None] | None] = ContextVar("rocm_parallel_interrupt_check", default=None)


@contextmanager
def interrupt_check(check: Callable[[], None] | None) -> Iterator[None]:
    """Jobs started inside call `check()` every `POLL` seconds while they wait for the ranks; when it raises
    (ComfyUI's `throw_exception_if_processing_interrupted` on a Cancel), the job is cancelled on every rank
    (inside a model call too: cancel_points.py) and the exception re-raised. None: no check."""
    token = _CHECK.set(check)
    try:
        yield
    finally:
        _CHECK.reset(token)


class JobTimeout(WorkerError):
    """A job ran past its time limit (the group survives when the job stopped at a step boundary)."""


class Job:
    """One call on every rank of `workers`, from the request sent to the last reply.

    `timeout`: the caller's limit: past it the job is cancelled, and a job that does not stop within
    `cancel_grace` seconds after that closes the group. `limit`: a hard limit (the start-up health check):
    past it the group is closed at once. `label` names the job in `activity` ('step 3 of 20')."""

    def __init__(
        self,
        workers: Workers,
        id: int,
        method: str,
        *,
        timeout: float | None = None,
        progress: ProgressCallback | None = None,
        watchdog: Watchdog | None = None,
        cancel_grace: float = 10.0,
        limit: float | None = None,
        label: str | None = None,
    ) -> None:
        self.workers, self.id, self.method = workers, id, method
        self.timeout, self.progress, self.cancel_grace, self.limit = timeout, progress, cancel_grace, limit
        self.label = label or repr(method)
        self.replies: dict[int, Reply] = {}
        self.interrupt: BaseException | None = None  # the caller's exception, or a JobTimeout
        self.first_error: Reply | None = None  # the failure itself, not the peers' cancels it caused
        self.cancel_deadline: float | None = None
        self.sent: list[int] = []  # the ranks that have the request (Job.send): the ones to wait for
        self.request: Request | None = None
        self.check = _CHECK.get()  # the caller's interrupt check (interrupt_check), polled while waiting
        self.late: tuple[GroupState, list[int], int] | None = None  # ranks a collective timed out waiting for
        self.started = time.monotonic()
        self.liveness: Liveness = workers.begin(method, id, watchdog)

    # ---------------------------------------------------------------- state

    @property
    def pending(self) -> list[int]:
        """The ranks that have the request and have not replied yet."""
        return [r for r in self.sent if r not in self.replies]

    @property
    def settled(self) -> bool:
        """Every rank that has the request replied (none has it: nothing to wait for): nothing of this job
        can reach a later call."""
        return not self.pending

    def send(self, request: Request) -> None:
        """The request to every rank that lacks it, each recorded once it has it. A rank whose process died
        since the last check is lost (the group is stopped)."""
        self.request = request
        requests = self.workers.requests_for(request)  # raises before any rank has it
        for rank, conn in enumerate(self.workers.conns):
            if rank in self.sent:
                continue
            try:
                send(conn, requests[rank])
            except OSError:
                self.lost(rank)
            self.sent.append(rank)

    @property
    def cancel_path(self) -> str:
        """The flag file the workers look for at each step boundary (WorkerContext.cancel_requested)."""
        return os.path.join(self.workers.shm, f"cancel-{self.id}")

    def activity(self) -> str:
        """What the ranks still at work are doing: 'step 3 of 20: 41 s so far, still computing'."""
        return self.liveness.summary(time.monotonic(), self.pending, self.label)

    def where(self, now: float) -> str:
        """Each pending rank's last report, for messages."""
        return ", ".join(f"rank {r} {describe(self.liveness.state(r), now)}" for r in self.pending)

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
        while not self.settled:
            self._receive()
            if not self.settled:
                self.workers.raise_if_exited(f"running {self.method!r}")
                self._check(time.monotonic())

    def _receive(self) -> None:
        conns, progress = self.workers.conns, []
        for conn in wait([conns[r] for r in self.pending], timeout=POLL):
            with uninterrupted():  # a record is read and taken in whole, or not touched at all
                rank = conns.index(conn)
                try:
                    record = recv(conn)
                except (EOFError, OSError):
                    self.lost(rank)
                if getattr(record, "job", None) != self.id:
                    continue  # another job's message: never taken for this one's
                if isinstance(record, Progress):
                    loading = record.phase == "load"
                    self.liveness.progressed(rank, time.monotonic(), record.step, record.total, loading)
                    if record.rank == 0:
                        progress.append(record)  # rank 0 speaks for the job
                elif isinstance(record, Reply):
                    self._take(rank, record)
        for record in progress:
            self._relay(record)

    def _take(self, rank: int, reply: Reply) -> None:
        self.replies[rank] = reply
        if not reply.ok and reply.error_type != CANCELLED and self.first_error is None:
            # A real failure: stop the peers that can still stop (a load, a step boundary); those stuck
            # in a collective for the failed rank are found by the liveness rules.
            self.first_error = reply
            waited = self.liveness.waited_for(rank, time.monotonic())
            if waited is not None:  # its collective timed out: the rank(s) it waited for are the cause
                self.late = (*waited, rank)
            self.cancel()

    def _relay(self, record: Progress) -> None:
        if self.progress is None or self.interrupt is not None:
            return
        try:
            self.progress(record.step, record.total)
        except BaseException as exc:  # the caller's interrupt: stop every rank together
            self.interrupt = exc
            self.cancel()

    def _check(self, now: float) -> None:
        pending = self.pending
        if self.late is not None:
            self._timed_out(*self.late, now)
        if self.check is not None and self.interrupt is None:
            try:
                self.check()
            except BaseException as exc:  # the caller's Cancel: stop every rank at its next cancel point
                self.interrupt = exc
                self.cancel()
        hang = self.workers.watch(pending, list(self.replies), now, failed=self.first_error is not None)
        if hang is not None:
            self._hung(hang)
        if self.cancel_deadline is not None and now > self.cancel_deadline:
            rank, why = self._holding(now)
            where = self.where(now)
            self._close()
            raise JobTimeout(
                f"{self.method!r} did not stop within {self.cancel_grace:g} s of being cancelled at its time "
                f"limit{why} ({where}); the worker group was closed{self._left()}",
                rank,
            )
        if self.timeout is not None and self.interrupt is None and now - self.started > self.timeout:
            self.interrupt = JobTimeout(
                f"{self.method!r} ran past its time limit of {self.timeout:g} s and was cancelled"
            )
            self.cancel(deadline=True)
        if self.limit is not None and now - self.started > self.limit:
            where = self.where(now)
            self._close()
            raise WorkerError(
                f"{self.method!r} did not finish within {self.limit:g} s ({where}); the worker group was stopped",
                pending[0],
            )

    def _holding(self, now: float) -> tuple[int, str]:
        """The rank a job that ran out of time waited for (the chain's end: never a rank that waits in a
        collective for it), and in words who waits for it; else the first rank still at work."""
        pending = self.pending
        waited = self.liveness.waited_for_now(now, pending, list(self.replies))
        if not waited:
            return pending[0], ""
        rank = min(waited)
        return rank, f": worker rank {rank} ({self.workers.devices[rank]}) held it up ({waited[rank]})"

    def _left(self) -> str:
        """Workers SIGKILL did not end, in words, for a message (launch.Workers.stop)."""
        return (
            f"; SIGKILL did not end {'; '.join(self.workers.left)}: left to the OS"
            if self.workers.left
            else ""
        )

    def _hung(self, hang: Hang) -> NoReturn:
        """Close the group (the stuck ranks killed first) and raise the hang, or the failure behind it."""
        self.workers.kill(hang.kill)
        self._close()
        again = f"; the worker group was stopped (the next call starts it again){self._left()}"
        if self.first_error is not None:
            if hang.waiting:
                raise self.failure(
                    self.first_error,
                    f"; rank(s) {list(hang.ranks)} were left waiting for it in a collective, so the worker "
                    "group was stopped (the next call starts it again)",
                )
            raise self.failure(self.first_error, f"; then {hang.why}{again}")
        raise WorkerError(hang.why + again, hang.ranks[0])

    def _timed_out(self, group: GroupState, late: list[int], waiter: int, now: float) -> NoReturn:
        """`waiter` failed after waiting in `group`'s collective for the collective timeout: name the rank(s)
        it waited for (the cause), not the first to time out, and close the group (the collective is
        broken on the waiter's side)."""
        devices = self.workers.devices
        doing = "; ".join(f"rank {r}: {describe(self.liveness.state(r), now)}" for r in late)
        late_ranks = ", ".join(f"rank {r} ({devices[r]})" for r in late)
        assert self.first_error is not None
        error = WorkerError(
            f"{late_ranks} never reached {collective_text(group)}, in which rank {waiter} ({devices[waiter]}) "
            f"waited for it for the collective timeout ({self.liveness.watchdog.collective_timeout:g} s) while running "
            f"{self.method!r} ({doing}); the worker group was stopped (the next call starts it again)",
            late[0],
            self.first_error.error_type,
        )
        error.remote_traceback = self.first_error.traceback
        error.add_note(f"rank {waiter}'s own error: {self.first_error.error}")
        self.workers.kill(late)
        self._close()
        raise error

    def _close(self) -> None:
        self.workers.shutdown(grace=0.5)

    # ---------------------------------------------------------------- ending early

    def cancel(self, deadline: bool = False) -> None:
        """Ask every rank to stop at its next cancel point (a few blocks into a model call, a step's end, a
        tensor of a load). `deadline`: it must within `cancel_grace` seconds (a time limit); otherwise the
        ranks get as long as they stay healthy."""
        if deadline and self.cancel_deadline is None:
            self.cancel_deadline = time.monotonic() + self.cancel_grace
        self.workers.cancel(self.id)

    def stop(self, reason: BaseException) -> None:
        """After the caller's exception (Ctrl+C, an error while waiting): cancel and wait for every rank's
        reply, so nothing of this job reaches a later call and the group keeps its model. The ranks stop at
        their next cancel point (inside a model call: cancel_points.py), unless one hangs; a second Ctrl+C
        closes the group at once. A request that reached some ranks only (an exception from the send itself)
        is sent to the rest too, after the cancel: the ranks that have it would otherwise wait for the others
        in its first collective; all of them stop at the same point instead."""
        self.cancel()
        conns, hinted, since = self.workers.conns, False, time.monotonic()
        try:
            if self.sent and self.request is not None:
                self.send(self.request)
            while not self.settled and self.workers.running:
                for conn in wait([conns[r] for r in self.pending], timeout=POLL):
                    with uninterrupted():
                        record = recv(conn)
                        if isinstance(record, Reply) and record.job == self.id:
                            self.replies[conns.index(conn)] = record
                now = time.monotonic()
                if self.settled or self._replied_unseen(now):
                    break
                hang = self.workers.watch(self.pending, list(self.replies), now)
                if hang is not None:
                    self.workers.kill(hang.kill)
                    break
                if not hinted and isinstance(reason, KeyboardInterrupt) and now - since > HINT_AFTER:
                    hinted = True
                    print(
                        f"[ROCm Parallel] cancelling {self.method!r}: every rank stops at its next cancel point "
                        f"({self.where(now)}); press Ctrl+C again to stop the workers now (the next call "
                        "starts them again and reloads the model)",
                        file=sys.stderr,
                        flush=True,
                    )
        except BaseException:  # a second interrupt, a lost connection: no time for manners
            pass
        if not self.settled:
            self._close()

    def _replied_unseen(self, now: float) -> bool:
        """Every pending rank reports it has finished this job for a while: its reply was lost on the way
        (the stream is out of step), so the group cannot be trusted with another job."""
        finished = all(
            (s := self.liveness.state(r)) is not None and s.doing == "idle" and s.job == self.id
            for r in self.pending
        )
        return finished and now - self.started > self.liveness.watchdog.grace

    def lost(self, rank: int) -> NoReturn:
        """Rank's connection closed: report its exit status (give the OS a moment to reap it)."""
        doing = f"running {self.method!r}"
        self.workers.wait_for_exit(rank, 2.0)
        self.workers.raise_if_exited(doing)
        self.workers.shutdown(grace=1.0)
        raise WorkerError(
            f"worker rank {rank} ({self.workers.devices[rank]}) closed its connection while {doing}", rank
        )
