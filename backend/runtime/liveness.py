"""Telling a hung rank from a slow one, in the caller: by what the ranks do, never by a clock.

Every rank reports several times a second what it is doing and where it is in its collectives
(heartbeat.py); the OS says, thread by thread, whether it runs, waits for a core or sleeps in the kernel,
and how much CPU it used (procstat.py); its report says whether work is queued on its GPU. A rank's job
**does no work** when the thread that runs it (the main thread) is not runnable and used no CPU, nothing
the rank started works and no GPU work is queued. Its other threads are left out there: gloo's wake a few
times a second and use a tick or three of CPU whatever the rank does (issue 56: a rank asleep in Python
was never named for them). They count where they do the job's work: a rank inside a collective, whose
data gloo's threads move (the collective rules and whether a late report still says where a rank is, by
the rank's whole process, `quiet_since`), and a rank whose reports lag behind a starved reporting thread
(where it is is not known). A rank **is waited for** when a peer waits in a collective it has not
reached, or when every other rank has finished the job (at start-up: when a rank further along waits
for it). `Liveness` finds a hang only in one of these, each held for a few seconds (`Watchdog`):

- a rank is stopped by the OS (SIGSTOP, a debugger) or its cgroup frozen: `stopped` seconds;
- a rank that is waited for does no work: `idle` seconds. It is blocked (a lock, a sleep, a native call
  that never returns), whatever its reporting thread says; named, and killed;
- a rank that is waited for sleeps in the kernel uninterruptibly (`D`) with no progress (no CPU, no page
  or byte read): `uninterruptible` seconds, longer than `idle` (a slow network share waits in `D` between
  pages). A driver or disk call that does not return (a frozen cgroup v1 shows the same); named, killed;
- a rank waits in a collective that cannot complete, `grace` seconds: a peer that finished the job never
  issued it; the ranks' recorders disagree on what collective #n was (op, or shapes where they must
  match); or the rank does no work while a peer has left #n and issued later collectives on that group;
  or ranks that do no work wait for each other in a cycle.

What is never a hang: a rank that works, however long (a first step that compiles kernels, a bigger image,
a checkpoint on a network share: `D` with pages read); a rank that is runnable but gets no CPU on a busy
machine (starvation: its reports may lag by seconds, its collectives complete late, but it is `R`); ranks
that all sleep in the same call (nobody waits for anybody); a peer having left collective #n while the
rank still works in it (a starved rank finishes #n seconds after its peer: its data was sent long ago).

The boundary (issue 44): a native call that holds the GIL stops the reports. Silence alone is no sign:
such a rank is judged by the OS like any other, and with its reports stopped its GPU queue cannot be
asked, so it counts as doing no work when it uses no CPU and waits for no disk. Held `idle` seconds while
a peer waits for it, it is hung; on every rank at once (nobody waits), it is left to the one clock below.
torch's own calls release the GIL while they wait for a GPU, so a GPU wait never stops the reports.

The one clock left is the process group's collective timeout (`collective_timeout`, set on every rank's
gloo/NCCL group): a rank that waits longer than that in one collective fails from inside (then the rank
it waited for is named, `waited_for`), a rank silent and idle that long is hung, and after a failure a
rank that has not moved for that long counts as stuck.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

from .messages import GroupState, RankState
from .procstat import ProcSample as Process


@dataclass(frozen=True)
class Watchdog:
    """How long each sign of a hang must hold before the job fails (seconds).

    `scaled(factor)` multiplies the four windows of the rules (not the collective timeout, which the workers'
    process groups enforce themselves): the suite exercises the same rules in less time (tests/bounds.py),
    a slow but healthy rank outlasting each window by the same ratio."""

    stopped: float = 2.0  # the OS reports the process stopped, or its cgroup frozen
    idle: float = 5.0  # a rank that is waited for does no work (its job's thread used no CPU, no GPU work)
    grace: float = 3.0  # a rank waits in a collective that cannot complete
    # a rank that is waited for stays in uninterruptible sleep (D) with no disk progress: a stuck driver or
    # disk call. Longer than `idle`: a read from a slow network share waits in D for seconds between pages.
    uninterruptible: float = 30.0
    collective_timeout: float = 600.0  # the process groups' own timeout (set on the workers at start)

    def scaled(self, factor: float) -> Watchdog:
        """The same rules with every window but the collective timeout multiplied by `factor`."""
        return replace(
            self,
            stopped=self.stopped * factor,
            idle=self.idle * factor,
            grace=self.grace * factor,
            uninterruptible=self.uninterruptible * factor,
        )


DEFAULT_WATCHDOG = Watchdog()
BUSY_CPU = 0.1  # a process whose threads use at least this share of a core over `CPU_WINDOW` is working
CPU_WINDOW = 1.0  # seconds: CPU time is counted in ticks (10 ms); a shorter span is too coarse to judge
FRESH = 1.5  # seconds: a report older than this does not show where a rank is now
ASK_AFTER = 1.0  # seconds a rank waits in a collective before its group's ranks are asked what it was
# Ops whose input shapes must be the same on every rank (others may differ legitimately: uneven
# all-to-all splits, a gather's root).
SAME_SHAPES = frozenset({"all_reduce", "allreduce", "broadcast"})
# Start-up stages in order (a rank's `detail` while 'starting'); ranks at a waiting stage wait for the rest.
_STAGES = {"connecting": 1, "joining the process group": 2, "importing its methods": 3}
_READY = 4
_WAITING_STAGES = (2, _READY)

__all__ = ["DEFAULT_WATCHDOG", "Hang", "Liveness", "Process", "Watchdog", "collective_text", "describe"]


@dataclass(frozen=True)
class Hang:
    """The ranks actually stuck, those to kill outright (a stopped process ignores SIGTERM), and why."""

    ranks: tuple[int, ...]
    kill: tuple[int, ...]
    why: str
    waiting: bool = False  # stuck in a collective (rather than stopped or blocked)


@dataclass
class _Seen:
    state: RankState | None = None
    reported: float = 0.0  # caller time the report last changed
    sampled: bool = False  # the readings below hold a look (a first look has nothing to compare with)
    job_cpu: float = 0.0  # the job's thread's (and its descendants') CPU seconds at the last look
    main_io: int = 0  # the job's thread's disk progress at the last look
    cpu_mark: tuple[float, float] = (0.0, 0.0)  # (caller time, the whole process's CPU seconds): a window
    busy: bool = False  # the whole process used `BUSY_CPU` of a core over the last full window
    stopped_since: float | None = None
    frozen: str = ""  # the frozen cgroup that holds it, when stopped that way
    own_since: float = 0.0  # when the rank's current activity began, by its own report
    idle_since: float | None = None  # caller time since the rank's job has done no work, look after look
    quiet_since: float | None = None  # ... since no thread of it (its reporter aside) has worked
    stuck_since: float | None = None  # ... since its job's thread has been in D with no disk progress
    wait: str = ""  # where in the kernel that thread waits, then
    report: RankState | None = None  # its last report as written (`state` may hold a progress record's news)


def describe(state: RankState | None, now: float) -> str:
    """'computing step 3 of 20 (41 s so far)', 'reading tensor 7 of 112 (20 s on it)', 'waiting in
    collective #12 (all_reduce over ranks 0, 1) for 4 s', 'idle', 'starting (joining the process group)'."""
    if state is None:
        return "not reporting yet"
    waiting = _waiting(state)
    if waiting is not None and now - waiting.pending_since >= 1.0:
        return f"waiting in {collective_text(waiting)} for {now - waiting.pending_since:.0f} s"
    took = now - state.since
    if state.doing == "loading":
        return f"reading tensor {state.step} of {state.total} ({took:.0f} s on it)"
    if state.doing == "computing":
        what = f"step {state.step} of {state.total}" if state.total else repr(state.method)
        return f"computing {what} ({took:.0f} s so far)"
    if state.doing == "starting":
        return f"starting ({state.detail}, {took:.0f} s so far)"
    return state.doing


def collective_text(group: GroupState) -> str:
    """'collective #12 (all_reduce over ranks 0, 1)': where a rank waits, in words."""
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


def _group(state: RankState | None, name: str) -> GroupState | None:
    return None if state is None else next((g for g in state.groups if g.name == name), None)


def _moved(old: RankState | None, new: RankState) -> bool:
    """The rank did something between two reports: a new activity, step or tensor, or a collective issued
    or completed (a report that only beat again is no sign of work)."""
    if old is None:
        return True
    before = (old.doing, old.job, old.step, old.since, {(g.name, g.issued, g.completed) for g in old.groups})
    after = (new.doing, new.job, new.step, new.since, {(g.name, g.issued, g.completed) for g in new.groups})
    return before != after


def same_collective(a: str, b: str) -> bool:
    """Two recorders' signatures of one collective ('all_reduce [[4,3]]') agree: the same op, and the same
    input shapes where the op needs them equal."""
    op_a, _, shapes_a = a.partition(" ")
    op_b, _, shapes_b = b.partition(" ")
    return op_a == op_b and (op_a not in SAME_SHAPES or shapes_a == shapes_b)


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
        self.seen = {rank: _Seen(reported=now) for rank in range(len(devices))}
        self._since: dict[str, dict[tuple, float]] = {}  # kind of sign -> each sign -> since when it holds
        self._waited_spans: dict[str, dict[int, tuple[float, float]]] = {}  # `_held_while_waited`
        self.questions: dict[str, int] = {}  # group -> the collective its ranks are asked about

    def carry(self, seen: dict[int, _Seen]) -> None:
        """Start from another judge's reports (the previous job's): a rank silent since then counts (one
        that starts the new job reports a new activity: that is work, `_moved`)."""
        self.seen = seen

    # ---------------------------------------------------------------- input

    def observe(self, rank: int, now: float, state: RankState | None, process: Process | None) -> None:
        seen, moved = self.seen[rank], False
        if state is not None and (seen.state is None or state.beat != seen.state.beat):
            held, seen.own_since = seen.state, state.since
            moved, seen.report = _moved(seen.report, state), state
            if held is not None and state.since < held.since:  # a progress record told us more already
                state = replace(
                    state, doing=held.doing, job=held.job, method=held.method, step=held.step,
                    total=held.total, since=held.since, detail=held.detail,
                )  # fmt: skip
            seen.state, seen.reported = state, now
        if process is None:
            return
        if not (process.stopped or process.frozen):
            seen.stopped_since = None
        elif seen.stopped_since is None:
            seen.stopped_since = now
        seen.frozen = process.frozen
        fresh = seen.state is not None and now - seen.reported <= FRESH
        gpu_rank = not self.devices[rank].startswith("cpu")
        # Signs that hold whichever view: a new step, tensor or collective since its last report; a process
        # judged by the stopped rule or by its exit; a first look (nothing to compare its CPU time with);
        # GPU work queued.
        sign = (
            moved
            or process.stopped
            or process.zombie
            or bool(process.frozen)
            or not seen.sampled
            or (fresh and seen.state is not None and seen.state.gpu)
        )
        # Late reports from a reporting thread that waits for a core: where the rank is now is not known
        # (it may have entered a collective since), nor its GPU queue. It is judged by its whole process
        # then, and a GPU rank counts as working.
        late = not fresh and process.reporter_runnable
        whole = sign or process.working or self._busy(seen, process.cpu_seconds, now) or (late and gpu_rank)
        if not process.main_state:  # no per-thread view (not Linux): the whole process is the job's
            job, in_d, progressed = whole, False, False
        else:
            in_d = process.main_state == "D"
            progressed = process.job_cpu > seen.job_cpu or process.main_io != seen.main_io
            job = sign or process.job_working or progressed or (late and whole)
        seen.quiet_since = None if whole else (seen.quiet_since if seen.quiet_since is not None else now)
        # Uninterruptible sleep is not idleness (a slow disk): it has its own, longer clock while no
        # page, byte or tick moves.
        seen.idle_since = None if job or in_d else (seen.idle_since if seen.idle_since is not None else now)
        stuck = in_d and not job
        seen.stuck_since = (seen.stuck_since if seen.stuck_since is not None else now) if stuck else None
        seen.wait = process.main_wait if stuck else ""
        seen.job_cpu, seen.main_io, seen.sampled = process.job_cpu, process.main_io, True

    @staticmethod
    def _busy(seen: _Seen, cpu: float, now: float) -> bool:
        """The whole process used `BUSY_CPU` of a core over the last full `CPU_WINDOW` (decided once per
        window; gloo's threads use a tick or three a second whatever the rank does, which a look-to-look
        comparison of a fifth of a second would take for a tenth of a core)."""
        since, before = seen.cpu_mark
        if not seen.sampled or cpu < before:
            seen.cpu_mark, seen.busy = (now, cpu), False
        elif now - since >= CPU_WINDOW:
            seen.busy = cpu - before >= BUSY_CPU * (now - since)
            seen.cpu_mark = (now, cpu)
        return seen.busy

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
        seen.reported, seen.idle_since, seen.quiet_since, seen.stuck_since = now, None, None, None

    def state(self, rank: int) -> RankState | None:
        return self.seen[rank].state

    # ---------------------------------------------------------------- verdict

    def verdict(
        self, now: float, pending: Sequence[int], done: Collection[int], failed: bool = False
    ) -> Hang | None:
        """A hang among the `pending` ranks (`done`: those that answered the job), or None."""
        for rank in pending:
            seen = self.seen[rank]
            if seen.stopped_since is not None and now - seen.stopped_since > self.watchdog.stopped:
                how = (
                    f"is frozen by its cgroup's freezer ({seen.frozen})"
                    if seen.frozen
                    else "is stopped (SIGSTOP or a debugger)"
                )
                return Hang(
                    (rank,),
                    (rank,),
                    f"{self._who(rank)} {how} while {self.what} ({describe(seen.state, now)})",
                )
        waits, reasons, idle_reasons = self._collectives(now, pending, done)
        waiting = set(waits) | set(reasons) | set(idle_reasons)
        waited = self._waited(pending, done, waits, waiting)
        blocked = self._blocked(now, waited) or self._uninterruptible(now, waited)
        if blocked is not None:
            return blocked
        return self._stuck(now, pending, failed, waits, reasons, idle_reasons)

    def waited_for_now(self, now: float, pending: Sequence[int], done: Collection[int]) -> dict[int, str]:
        """The pending ranks others wait for and do not wait themselves, each with who waits for it in
        words ('rank 0 waits for it in collective #12 (...)'): whom a time limit that ends the job names."""
        waits, reasons, idle_reasons = self._collectives(now, pending, done)
        return self._waited(pending, done, waits, set(waits) | set(reasons) | set(idle_reasons))

    def _current(self, rank: int, now: float) -> bool:
        """Rank's last report says where it is now: it is fresh, or no thread of the rank has worked since
        it was written (a rank blocked in a collective cannot have moved on; on a loaded machine its
        reporting thread may wait seconds for a core)."""
        seen = self.seen[rank]
        quiet_since_report = seen.quiet_since is not None and seen.quiet_since <= seen.reported
        return now - seen.reported <= FRESH or quiet_since_report

    def _who(self, rank: int) -> str:
        return f"worker rank {rank} ({self.devices[rank]}, pid {self.pids[rank]})"

    def _finished(self, rank: int, done: Collection[int]) -> bool:
        state = self.seen[rank].state
        return rank in done or (
            self.job > 0 and state is not None and state.doing == "idle" and state.job == self.job
        )

    def _collectives(
        self, now: float, pending: Sequence[int], done: Collection[int]
    ) -> tuple[
        dict[int, tuple[GroupState, list[int]]],
        dict[int, tuple[GroupState, str]],
        dict[int, tuple[GroupState, str]],
    ]:
        """Where each fresh pending rank waits: the peers not there yet, a reason it certainly cannot go
        on, or a reason that holds only while it does no work. Also sets `questions`."""
        waits: dict[int, tuple[GroupState, list[int]]] = {}  # rank -> (group, the peers it waits for)
        reasons: dict[int, tuple[GroupState, str]] = {}  # rank -> why it certainly cannot go on
        idle_reasons: dict[int, tuple[GroupState, str]] = {}  # ... why, if it does no work meanwhile
        questions: dict[str, int] = {}
        for rank in pending:
            seen = self.seen[rank]
            if seen.state is None or not self._current(rank, now):
                continue  # an old report does not say where the rank is now
            for group in (g for g in _blocking(seen.state.groups, seen.own_since) if g.ranks):
                if now - group.pending_since >= ASK_AFTER:
                    questions.setdefault(group.name, group.pending)
                certain, if_idle, waits_for = self._peers(rank, group, done, now)
                if certain:
                    reasons.setdefault(rank, (group, certain))
                elif if_idle:
                    idle_reasons.setdefault(rank, (group, if_idle))
                elif waits_for:
                    waits.setdefault(rank, (group, waits_for))
        self.questions = questions
        return waits, reasons, idle_reasons

    def _peers(
        self, rank: int, group: GroupState, done: Collection[int], now: float
    ) -> tuple[str, str, list[int]]:
        """Why `rank` certainly cannot complete collective #n of `group`, why it cannot if it does no work,
        and the peers that have not reached #n yet."""
        n, waits_for, if_idle = group.pending, [], ""
        mine = group.answer if group.asked == n else ""
        for peer in group.ranks:
            if peer == rank:
                continue
            state = self.seen[peer].state
            theirs = _group(state, group.name)
            if self._finished(peer, done):
                if theirs is None or theirs.issued < n:
                    return f"which rank {peer} will never enter: it has finished the job", "", []
                if_idle = if_idle or f"which rank {peer} has left: it completed it and has finished the job"
                continue
            if state is None:
                continue  # not known: it may well be on its way
            if theirs is None or theirs.issued < n:
                waits_for.append(peer)
                continue
            answer = theirs.answer if theirs.asked == n else ""
            if mine and answer and not same_collective(mine, answer):
                return (
                    f"which rank {peer} issued as {answer.replace(' ', ' of ', 1)} where it issued "
                    f"{mine.replace(' ', ' of ', 1)}: the ranks issued their collectives in different orders",
                    "",
                    [],
                )
            if theirs.completed >= n and theirs.issued > n:
                if_idle = if_idle or (
                    f"which rank {peer} has left (it completed it and issued {theirs.issued - n} more on that "
                    f"group; it is {describe(state, now)}) while this rank does no work: the ranks issued "
                    "their collectives in different orders"
                )
        # A rank that issued collectives after #n has moved past it (its recorder has not marked #n completed
        # yet: gloo runs a group's collectives on two threads) and waits in a later one. A peer having left #n
        # is then no evidence against it (seen in `bench hangs`: the rank waiting behind a blocked one was
        # named instead, 3-4 s in).
        return "", "" if group.issued > n else if_idle, waits_for

    def _waited(
        self,
        pending: Sequence[int],
        done: Collection[int],
        waits: dict[int, tuple[GroupState, list[int]]],
        waiting: set[int],
    ) -> dict[int, str]:
        """The pending ranks a peer waits for, each with who waits in words. A rank that waits in a
        collective itself is not one: the chain's end is."""
        waited: dict[int, str] = {}  # rank -> who waits for it, in words
        for rank, (group, peers) in waits.items():
            for peer in peers:
                if peer in pending and peer not in waiting:
                    waited.setdefault(peer, f"rank {rank} waits for it in {collective_text(group)}")
        for rank in pending:
            others = [r for r in range(len(self.devices)) if r != rank]
            if rank not in waited and rank not in waiting and others:
                if self.method and all(self._finished(r, done) for r in others):
                    waited[rank] = f"rank{'s' if len(others) > 1 else ''} {_ranks(others)} finished the job"
                elif not self.method:
                    ahead = self._waiting_ahead(rank)
                    if ahead:
                        waited[rank] = ahead
        return waited

    def _held_while_waited(self, kind: str, waited: dict[int, str], clock: str, now: float) -> list[int]:
        """The waited-for ranks whose `clock` (an `_Seen` field: since when the sign holds) has run for the
        `kind` window while a peer waited for them. A look at which no peer is seen waiting (its report late
        by less than `FRESH`) does not start the wait over; the sign's own clock must run unbroken."""
        seconds = getattr(self.watchdog, kind)
        spans = self._waited_spans.setdefault(kind, {})  # rank -> (first look waited for, last look)
        for rank in [r for r, (_, last) in spans.items() if r not in waited and now - last > FRESH]:
            del spans[rank]  # not waited for longer than a late report explains: it starts over
        held = []
        for rank in waited:
            start = getattr(self.seen[rank], clock)
            if start is None:
                spans.pop(rank, None)
                continue
            began = spans.get(rank, (now, now))[0]
            spans[rank] = (began, now)
            if now - max(began, start) > seconds:
                held.append(rank)
        return sorted(held)

    def _blocked(self, now: float, waited: dict[int, str]) -> Hang | None:
        """A rank that is waited for and whose job does no work, for `idle` seconds: named (and killed)."""
        held = self._held_while_waited("idle", waited, "idle_since", now)
        if not held:
            return None
        rank = held[0]
        seen = self.seen[rank]
        idle = now - (seen.idle_since or now)
        if seen.state is None:
            why = (
                f"{self._who(rank)} does no work while starting: it has not reported yet (importing torch, "
                f"{now - self.started:.0f} s so far), for {idle:.0f} s it has used no CPU and waited for no "
                f"disk, and {waited[rank]}: it is blocked"
            )
        elif now - seen.reported > self.watchdog.idle:
            last = describe(seen.state, seen.reported)
            if seen.state is not None and seen.state.job != self.job:
                last += ", before this job reached it"
            why = (
                f"{self._who(rank)} stopped reporting {now - seen.reported:.0f} s ago while {self.what} (its "
                f"last report: {last}); its process is alive but does no work: stuck in a native call or "
                f"deadlocked ({waited[rank]})"
            )
        else:
            why = (
                f"{self._who(rank)} does no work while {self.what}: it reports {describe(seen.state, now)}, "
                f"but for {idle:.0f} s it has used no CPU, waited for no disk and queued no GPU work, and "
                f"{waited[rank]}: it is blocked (a lock, a sleep, a native call that never returns)"
            )
        return Hang((rank,), (rank,), why)

    def _uninterruptible(self, now: float, waited: dict[int, str]) -> Hang | None:
        """A rank that is waited for and whose job's thread sleeps uninterruptibly (D) with no disk
        progress, for `uninterruptible` seconds: a stuck driver or disk call (or a frozen cgroup's, whose
        tasks show D). Named and killed (a kill ends it when the kernel lets it: killable waits at once,
        others when the call returns; closing does not wait for that, launch.py)."""
        held = self._held_while_waited("uninterruptible", waited, "stuck_since", now)
        if not held:
            return None
        rank = held[0]
        seen = self.seen[rank]
        where = f"; in the kernel at {seen.wait}" if seen.wait and seen.wait != "0" else ""
        reports = (
            f"it reports {describe(seen.state, now)}"
            if now - seen.reported <= FRESH
            else f"its last report, {now - seen.reported:.0f} s ago: {describe(seen.state, seen.reported)}"
        )
        return Hang(
            (rank,),
            (rank,),
            f"{self._who(rank)} has been in uninterruptible sleep (D) for {now - (seen.stuck_since or now):.0f} s "
            f"while {self.what} ({reports}{where}), with no CPU time or disk reads since, and "
            f"{waited[rank]}: a stuck driver or disk call",
        )

    def _waiting_ahead(self, rank: int) -> str:
        """At start-up: a rank further along that waits for this one ('rank 0 is ready'), or ''."""
        mine = _stage(self.seen[rank].state)
        for other in range(len(self.devices)):
            theirs = _stage(self.seen[other].state)
            if other != rank and theirs in _WAITING_STAGES and theirs > mine:
                return f"rank {other} " + (
                    "is ready" if theirs == _READY else "waits for it to join the group"
                )
        return ""

    def _stuck(
        self,
        now: float,
        pending: Sequence[int],
        failed: bool,
        waits: dict[int, tuple[GroupState, list[int]]],
        reasons: dict[int, tuple[GroupState, str]],
        idle_reasons: dict[int, tuple[GroupState, str]],
    ) -> Hang | None:
        """Ranks waiting in a collective that cannot complete: held `grace` seconds; those whose reason
        holds only while they do no work, held while they do none."""
        reasons = dict(reasons)
        conditional = {r: why for r, why in idle_reasons.items() if r not in reasons}
        # A waiting rank can go on if a peer it waits for can: computing, loading, waiting itself for one
        # that can, or stuck for a reason of its own (that one is named, not those behind it). What is
        # left waits only for waiting ranks: a cycle, stuck only when none of its ranks works (one that
        # works may be running an asynchronous collective it waits for later).
        can_go = {r for r in pending if r not in waits}
        changed = True
        while changed:
            changed = False
            for rank, (_, waits_for) in waits.items():
                if rank not in can_go and any(p in can_go for p in waits_for):
                    can_go.add(rank)
                    changed = True
        cycle = [r for r in waits if r not in can_go]
        if all(self.seen[r].quiet_since is not None for r in cycle):
            for rank in cycle:
                group, waits_for = waits[rank]
                others = ", ".join(f"rank {p} ({describe(self.seen[p].state, now)})" for p in waits_for)
                reasons[rank] = (group, f"which {others} cannot reach: they wait themselves")
        for rank, why in conditional.items():
            if self.seen[rank].quiet_since is not None:
                reasons[rank] = why
        if failed:
            for rank in pending:
                state = self.seen[rank].state
                timeout = self.watchdog.collective_timeout
                if rank not in reasons and state is not None and now - state.since > timeout:
                    reasons[rank] = (GroupState("", (), 0, 0), "")
        for rank in pending:  # silent and idle for as long as a collective may take: the last clock
            seen = self.seen[rank]
            if (
                rank not in reasons
                and seen.state is not None
                and now - seen.reported > self.watchdog.collective_timeout
                and now - (seen.idle_since or now) > self.watchdog.collective_timeout
            ):
                reasons[rank] = (GroupState("", (), 0, 0), "silent")
        keys = {(rank, group.name, group.pending) for rank, (group, _) in reasons.items()}
        held = sorted(r for r, _, _ in self._hold("stuck", keys, self.watchdog.grace, now))
        if not held:
            return None
        lines = []
        for rank in held:
            group, reason = reasons[rank]
            state = describe(self.seen[rank].state, now)
            if reason == "silent":
                lines.append(
                    f"rank {rank} ({self.devices[rank]}) has reported nothing and done no work for longer "
                    f"than the collective timeout ({self.watchdog.collective_timeout:g} s; its last report: "
                    f"{describe(self.seen[rank].state, self.seen[rank].reported)})"
                )
            elif not group.name:
                lines.append(
                    f"rank {rank} ({self.devices[rank]}) has been {state} since its peer failed, longer than "
                    f"the collective timeout ({self.watchdog.collective_timeout:g} s)"
                )
            else:
                lines.append(
                    f"rank {rank} ({self.devices[rank]}) has been waiting in {collective_text(group)} for "
                    f"{now - group.pending_since:.0f} s while {self.what}, {reason}"
                )
        return Hang(tuple(held), (), "; ".join(lines), waiting=True)

    def _hold(self, kind: str, keys: set[tuple], seconds: float, now: float) -> list[tuple]:
        """The signs of `kind` in `keys` that have held without a break for longer than `seconds` (a sign
        missing now starts again from zero when it comes back)."""
        since = self._since.setdefault(kind, {})
        for key in [k for k in since if k not in keys]:
            del since[key]
        for key in keys:
            since.setdefault(key, now)
        return sorted(k for k in keys if now - since[k] > seconds)

    def waited_for(self, rank: int, now: float) -> tuple[GroupState, list[int]] | None:
        """When `rank` has waited in one collective for about the collective timeout (it fails from inside
        then): that collective and the peers that never reached it, the ranks everyone waited for."""
        state = self.seen[rank].state
        if state is None:
            return None
        blocking = sorted(_blocking(state.groups, self.seen[rank].own_since), key=lambda g: g.pending_since)
        for group in blocking:
            if group.ranks and now - group.pending_since >= 0.9 * self.watchdog.collective_timeout:
                late = [p for p in group.ranks if p != rank and not _reached(self.seen[p].state, group)]
                if late:
                    return group, late
        return None

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
            where = "; ".join(f"rank {r} waits in {collective_text(g)}" for r, g in waiting)
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
            waits = "; ".join(f"rank {r} waits for it in {collective_text(g)}" for r, g in waiting)
            what += f" (rank {busy}; {waits})" if doing == {"computing"} else f" ({waits})"
        return f"{label}: {took:.0f} s so far, {what}"


def _stage(state: RankState | None) -> int:
    """How far a rank has started: 0 (importing torch, no report yet) .. 4 (ready)."""
    if state is None:
        return 0
    if state.doing == "starting":
        return _STAGES.get(state.detail, 0)
    return _READY


def _reached(state: RankState | None, group: GroupState) -> bool:
    """The rank whose report this is has issued the collective `group`'s rank waits in."""
    theirs = _group(state, group.name)
    return theirs is not None and theirs.issued >= group.pending


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))
