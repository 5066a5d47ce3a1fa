"""Telling a hung rank from a slow one, in the caller: by what the ranks report, never by a clock.

Every rank reports several times a second what it is doing and where it is in its collectives
(heartbeat.py). `Liveness` reads those reports and what the OS says about each process, and finds a
hang only in one of these, each held for a few seconds (`Watchdog`):

- a rank is stopped by the OS (SIGSTOP, a debugger): `stopped` seconds;
- a rank stops reporting while its process does no work (no CPU time, no disk wait): its interpreter is
  stuck in a native call or deadlocked: `silent` seconds;
- a rank waits in a collective that cannot complete: a peer it waits for has finished the job, has
  left that collective (completed it: the ranks issued their collectives in different orders), or is
  itself stuck waiting; `grace` seconds. Peers that have not reached the collective yet but are
  computing or loading are simply slower: the rank waits for them.

A rank that reports computing or loading is never taken for hung, however long a step or a tensor read
takes: a first step that compiles kernels, a bigger image, a checkpoint on a network share. The user's
own `timeout=` and Cancel still bound a job. The one clock left is the process group's collective
timeout (`collective_timeout`, set on every rank's gloo/NCCL group): a rank that waits longer than that
in one collective fails from inside, and after a failure a rank that has not moved for that long counts
as stuck too.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

from .messages import GroupState, RankState


@dataclass(frozen=True)
class Watchdog:
    """How long each sign of a hang must hold before the job fails (seconds)."""

    stopped: float = 2.0  # the OS reports the process stopped
    silent: float = 5.0  # no report while the process does no work
    grace: float = 3.0  # a rank waits in a collective that cannot complete
    collective_timeout: float = 600.0  # the process groups' own timeout (set on the workers at start)


DEFAULT_WATCHDOG = Watchdog()
BUSY_CPU = 0.1  # a process using at least this share of a core between two looks is working
FRESH = 1.5  # seconds: a report older than this does not show where a rank is now


@dataclass(frozen=True)
class Process:
    """What the OS says about a rank's process (its main thread's state, the whole process's CPU time)."""

    stopped: bool  # SIGSTOP, a debugger
    cpu_seconds: float  # user + system time so far
    working: bool = False  # running or waiting for a disk (a slow read, a network share): not hung


@dataclass(frozen=True)
class Hang:
    """The ranks actually stuck, those to kill outright (a stopped process ignores SIGTERM), and why."""

    ranks: tuple[int, ...]
    kill: tuple[int, ...]
    why: str
    waiting: bool = False  # stuck in a collective (rather than stopped or silent)


@dataclass
class _Seen:
    state: RankState | None = None
    reported: float = 0.0  # caller time the report last changed
    heard: float = 0.0  # ... or the process was last seen working (silent but busy in native code)
    cpu: float = 0.0  # the process's CPU seconds at the last look
    looked: float = 0.0
    stopped_since: float | None = None
    own_since: float = 0.0  # when the rank's current activity began, by its own report


def describe(state: RankState | None, now: float) -> str:
    """'computing step 3 of 20 (41 s so far)', 'reading tensor 7 of 112 (20 s on it)', 'waiting in
    collective #12 (all_reduce over ranks 0, 1) for 4 s', 'idle', 'starting (joining the process group)'."""
    if state is None:
        return "not reporting yet"
    waiting = _waiting(state)
    if waiting is not None and now - waiting.pending_since >= 1.0:
        return f"waiting in {_collective(waiting)} for {now - waiting.pending_since:.0f} s"
    took = now - state.since
    if state.doing == "loading":
        return f"reading tensor {state.step} of {state.total} ({took:.0f} s on it)"
    if state.doing == "computing":
        what = f"step {state.step} of {state.total}" if state.total else repr(state.method)
        return f"computing {what} ({took:.0f} s so far)"
    if state.doing == "starting":
        return f"starting ({state.detail}, {took:.0f} s so far)"
    return state.doing


def _collective(group: GroupState) -> str:
    op = f"{group.op} " if group.op and group.op != "?" else ""
    over = f"over ranks {', '.join(map(str, group.ranks))}" if group.ranks else f"of group {group.name}"
    return f"collective #{group.pending} ({op}{over})"


def _waiting(state: RankState) -> GroupState | None:
    """The collective the rank has been in the longest, if any."""
    pending = list(_blocking(state.groups, state.since))
    return min(pending, key=lambda g: g.pending_since) if pending else None


def _blocking(groups: Sequence[GroupState], since: float) -> list[GroupState]:
    """The pending collectives that may hold the rank: those seen pending since its current activity
    began (`since`, the rank's own clock, as `pending_since`). One seen pending before that is not where
    the rank is: it has moved on since (reported a new job, step or tensor), so the recorder has not
    marked that collective completed (gloo can leave the start-up health check's all-gather so) or it
    was asynchronous; taking it for a wait failed healthy loads as 'waiting in collective #2'."""
    return [g for g in groups if g.pending and g.pending_since >= since]


class Liveness:
    """The reports of one group's ranks over one job (or the start-up), and the verdict on them."""

    def __init__(
        self,
        devices: Sequence[str],
        pids: Sequence[int],
        watchdog: Watchdog,
        now: float,
        method: str = "",
        job: int = 0,
    ) -> None:
        """`method`: the job's (none: the start-up); `job`: its id (0 at start-up): a rank reporting idle
        after this job has finished it."""
        self.devices, self.pids, self.watchdog, self.job = tuple(devices), tuple(pids), watchdog, job
        self.method = method
        self.what = f"running {method!r}" if method else "starting"  # completes messages
        self.started = now
        self.seen = {rank: _Seen(reported=now, heard=now, looked=now) for rank in range(len(devices))}
        self._stuck_since: dict[tuple[int, str, int], float] = {}

    # ---------------------------------------------------------------- input

    def observe(self, rank: int, now: float, state: RankState | None, process: Process | None) -> None:
        seen = self.seen[rank]
        if state is not None and (seen.state is None or state.beat != seen.state.beat):
            held, seen.own_since = seen.state, state.since
            if held is not None and state.since < held.since:  # a progress record told us more already
                state = replace(
                    state, doing=held.doing, job=held.job, method=held.method, step=held.step,
                    total=held.total, since=held.since, detail=held.detail,
                )  # fmt: skip
            seen.state, seen.reported, seen.heard = state, now, now
        if process is None:
            return
        if process.stopped:
            seen.stopped_since = seen.stopped_since if seen.stopped_since is not None else now
        else:
            seen.stopped_since = None
        # A process that runs (or reads a disk) is working even when its reports are late: a native call
        # that keeps the interpreter, or a machine so loaded that the reporting thread rarely runs.
        used = process.cpu_seconds - seen.cpu
        if not process.stopped and (process.working or used >= BUSY_CPU * max(now - seen.looked, 0.01)):
            seen.heard = now
        seen.cpu, seen.looked = process.cpu_seconds, now

    def progressed(self, rank: int, now: float, done: int, total: int, loading: bool) -> None:
        """A progress record from `rank` (sent by its main thread after each step or tensor: exact where
        the reports, a few per second, may lag): it works on the next one now."""
        seen = self.seen[rank]
        if seen.state is not None:
            doing = "loading" if loading else "computing"
            step = min(done + 1, total)
            seen.state = replace(
                seen.state, doing=doing, job=self.job, method=self.method, step=step, total=total, since=now
            )
        seen.reported = seen.heard = now

    def state(self, rank: int) -> RankState | None:
        return self.seen[rank].state

    # ---------------------------------------------------------------- verdict

    def verdict(
        self, now: float, pending: Sequence[int], done: Collection[int], failed: bool = False
    ) -> Hang | None:
        """A hang among the `pending` ranks (`done`: those that answered the job), or None."""
        w = self.watchdog
        for rank in pending:
            seen = self.seen[rank]
            if seen.stopped_since is not None and now - seen.stopped_since > w.stopped:
                return Hang(
                    (rank,), (rank,),
                    f"{self._who(rank)} is stopped (SIGSTOP or a debugger) while {self.what} "
                    f"({describe(seen.state, now)})",
                )  # fmt: skip
        for rank in pending:
            seen = self.seen[rank]
            # Before its first report a rank is importing torch: only its exit or a stop can tell then.
            if seen.state is not None and now - seen.heard > w.silent and seen.stopped_since is None:
                last = describe(seen.state, seen.reported)
                if seen.state.job != self.job:
                    last += ", before this job reached it"
                return Hang(
                    (rank,), (rank,),
                    f"{self._who(rank)} stopped reporting {now - seen.reported:.0f} s ago while {self.what} "
                    f"(its last report: {last}); its process is alive but does no work: stuck in a native "
                    "call or deadlocked",
                )  # fmt: skip
        return self._stuck(now, pending, done, failed)

    def _who(self, rank: int) -> str:
        return f"worker rank {rank} ({self.devices[rank]}, pid {self.pids[rank]})"

    def _stuck(self, now: float, pending: Sequence[int], done: Collection[int], failed: bool) -> Hang | None:
        """Ranks waiting in a collective that cannot complete, held for `grace` seconds."""
        reasons: dict[int, tuple[GroupState, str]] = {}  # a rank that certainly cannot go on, and why
        blockers: dict[int, tuple[GroupState, list[int]]] = {}  # a rank waiting for peers still to come
        for rank in pending:
            state = self.seen[rank].state
            if state is None or now - self.seen[rank].reported > FRESH:
                continue  # an old report does not say where the rank is now (the silent rule covers it)
            for group in (g for g in _blocking(state.groups, self.seen[rank].own_since) if g.ranks):
                reason, waits_for = self._peers(rank, group, done, now)
                if reason:
                    reasons.setdefault(rank, (group, reason))
                elif waits_for:
                    blockers.setdefault(rank, (group, waits_for))
        # A waiting rank can go on if a peer it waits for can: computing, loading, or waiting itself for
        # one that can. What is left waits only for stuck ranks (a cycle, or a chain ending at one).
        can_go = {r for r in pending if r not in reasons and r not in blockers}
        changed = True
        while changed:
            changed = False
            for rank, (_, waits_for) in blockers.items():
                if rank not in can_go and rank not in reasons and any(p in can_go for p in waits_for):
                    can_go.add(rank)
                    changed = True
        for rank, (group, waits_for) in blockers.items():
            if rank not in can_go and rank not in reasons:
                others = ", ".join(f"rank {p} ({describe(self.seen[p].state, now)})" for p in waits_for)
                reasons[rank] = (group, f"which {others} cannot reach: they wait themselves")
        if failed:
            for rank in pending:
                state = self.seen[rank].state
                if (
                    rank not in reasons
                    and state is not None
                    and now - state.since > self.watchdog.collective_timeout
                ):
                    reasons[rank] = (GroupState("", (), 0, 0), "")
        return self._held(now, reasons)

    def _peers(
        self, rank: int, group: GroupState, done: Collection[int], now: float
    ) -> tuple[str, list[int]]:
        """Why `rank` cannot complete collective #n of `group` (or ''), and the peers not there yet."""
        n, waits_for = group.pending, []
        for peer in group.ranks:
            if peer == rank:
                continue
            state = self.seen[peer].state
            if peer in done or (state is not None and state.doing == "idle" and state.job == self.job):
                return f"which rank {peer} will never enter: it has finished the job", []
            if state is None:
                continue  # not known: it may well be on its way
            theirs = next((g for g in state.groups if g.name == group.name), None)
            if theirs is not None and theirs.completed >= n:
                return (
                    f"which rank {peer} has left (it completed it and is {describe(state, now)}): "
                    "the ranks issued their collectives in different orders",
                    [],
                )
            if theirs is None or theirs.issued < n:
                waits_for.append(peer)
        return "", waits_for

    def _held(self, now: float, reasons: dict[int, tuple[GroupState, str]]) -> Hang | None:
        keys = {(rank, group.name, group.pending) for rank, (group, _) in reasons.items()}
        for key in list(self._stuck_since):
            if key not in keys:
                del self._stuck_since[key]
        for key in keys:
            self._stuck_since.setdefault(key, now)
        held = sorted(r for r, g, n in keys if now - self._stuck_since[(r, g, n)] > self.watchdog.grace)
        if not held:
            return None
        lines = []
        for rank in held:
            group, reason = reasons[rank]
            if not group.name:
                lines.append(
                    f"rank {rank} ({self.devices[rank]}) has been {describe(self.seen[rank].state, now)} "
                    f"since its peer failed, longer than the collective timeout "
                    f"({self.watchdog.collective_timeout:g} s)"
                )
            else:
                lines.append(
                    f"rank {rank} ({self.devices[rank]}) has been waiting in {_collective(group)} for "
                    f"{now - group.pending_since:.0f} s while {self.what}, {reason}"
                )
        return Hang(tuple(held), (), "; ".join(lines), waiting=True)

    # ---------------------------------------------------------------- what the ranks are doing

    def summary(self, now: float, pending: Sequence[int], label: str) -> str:
        """'step 3 of 20: 41 s so far, still computing' (the panel, `WorkerGroup.activity`); the ranks that
        wait for a slower one are named with where they wait."""
        took = now - self.started
        working: dict[str, list[int]] = {}
        waiting: list[tuple[int, GroupState]] = []
        for rank in pending:
            state = self.seen[rank].state
            group = _waiting(state) if state is not None else None
            if group is not None and now - group.pending_since >= 1.0:
                waiting.append((rank, group))
            else:
                working.setdefault(describe(state, now) if state is not None else "", []).append(rank)
        if not working:
            where = "; ".join(f"rank {r} waits in {_collective(g)}" for r, g in waiting)
            return f"{label}: {took:.0f} s so far; {where}"
        doing = {"computing" if text.startswith("computing") else text for text in working}
        what = (
            "still computing"
            if doing == {"computing"}
            else "still "
            + ", ".join(
                f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))} {text}"
                for text, r in working.items()
            )
        )
        if waiting:
            busy = ", ".join(str(r) for ranks in working.values() for r in ranks)
            waits = "; ".join(f"rank {r} waits for it in {_collective(g)}" for r, g in waiting)
            what += f" (rank {busy}; {waits})" if doing == {"computing"} else f" ({waits})"
        return f"{label}: {took:.0f} s so far, {what}"
