"""The liveness rules alone (backend/runtime/liveness.py): reports and OS views fed at made-up times, the way
`Workers.watch` feeds them. Each rule was broken on purpose once; the mutation is named in its test.

A rank's job "does no work" here when its main thread's CPU time stands still and it is not runnable;
it "works" when that thread is runnable (`working`: on a starved machine that is all a computing rank
shows) or uses CPU (`busy`). Its other threads (gloo's: `threads`, `ticking`) count only where a rank is
inside a collective (they move its data) or its reports are late (where it is is not known). The traces
recorded under real contention and real hangs are replayed in test_contention.py.
"""

from __future__ import annotations

import re

import pytest

from rocm_parallel.backend.runtime.liveness import Hang, Liveness, Process, Watchdog, same_collective
from rocm_parallel.backend.runtime.messages import GroupState, RankState


def _group(
    name: str, ranks: tuple[int, ...], issued: int, completed: int, since: float = 0.0, answer: str = ""
) -> GroupState:
    """Rank's view of a group; `answer`: its recorder's signature of the collective it was asked about
    (the pending one, #completed + 1)."""
    pending = issued > completed
    asked = completed + 1 if answer else 0
    return GroupState(name, ranks, issued, completed, "all_reduce" if pending else "", since, asked, answer)


class Ranks:
    """`world` ranks' reports and OS views fed to a `Liveness` at made-up times."""

    def __init__(
        self, world: int = 3, method: str = "steps", job: int = 5, device: str = "cpu", **watchdog: float
    ) -> None:
        self.world, self.method, self.job = world, method, job
        pids = tuple(100 + r for r in range(world))
        self.live = Liveness((device,) * world, pids, Watchdog(**watchdog), 0.0, method, job)
        self.beat = 0
        self.cpu = dict.fromkeys(range(world), 0.0)  # every thread's (the reporter's aside)
        self.job_cpu = dict.fromkeys(range(world), 0.0)  # the main thread's
        self.io = dict.fromkeys(range(world), 0)

    def at(
        self,
        now: float,
        groups: dict[int, tuple[GroupState, ...]],
        done: tuple[int, ...] = (),
        *,
        working: tuple[int, ...] = (),
        busy: tuple[int, ...] = (),
        threads: tuple[int, ...] = (),
        ticking: tuple[int, ...] = (),
        in_d: tuple[int, ...] = (),
        reading: tuple[int, ...] = (),
        stopped: tuple[int, ...] = (),
        frozen: tuple[int, ...] = (),
        silent: tuple[int, ...] = (),
        starving: tuple[int, ...] = (),
        gpu: tuple[int, ...] = (),
        doing: dict[int, tuple[str, int, str]] | None = None,
        failed: bool = False,
    ) -> Hang | None:
        """One look at `now`. The job's (main) thread: `working`, runnable; `busy`, its CPU time grows (0.5 s
        per look); `in_d`, in uninterruptible sleep (D) with no progress; `reading`, in D reading pages from
        a disk. Its other threads (gloo's): `threads`, runnable and using CPU while the main thread sleeps;
        `ticking`, three ticks of CPU every fifth look (gloo's threads on an idle machine). Any other rank's
        process does no work. `frozen`: its cgroup frozen. `silent`: no new report; `starving`: the
        reporting thread waits for a core; `gpu`: GPU work queued; `doing`: (doing, job, detail) by rank
        (default: computing this job)."""
        self.beat += 1
        pending = [r for r in range(self.world) if r not in done]
        for rank in range(self.world):
            what, job, detail = (doing or {}).get(rank, ("computing", self.job, ""))
            state = RankState(
                rank, 100 + rank, self.beat, what, job, self.method if job == self.job else "", 0, 0, 0.0,
                detail, groups.get(rank, ()), gpu=rank in gpu,
            )  # fmt: skip
            if rank in busy:
                self.cpu[rank] += 0.5
                self.job_cpu[rank] += 0.5
            if rank in threads or (rank in ticking and self.beat % 5 == 0):
                self.cpu[rank] += 0.5 if rank in threads else 0.03
            if rank in reading:
                self.io[rank] += 4096
            process = Process(
                stopped=rank in stopped, cpu_seconds=self.cpu[rank],
                working=bool({rank} & {*working, *threads, *in_d, *reading}),
                reporter_runnable=rank in starving,
                main_state="D" if rank in in_d or rank in reading else "R" if rank in working else "S",
                job_cpu=self.job_cpu[rank], job_working=rank in working, main_io=self.io[rank],
                main_wait="fuse_wait" if rank in in_d else "", frozen=f"/cg/rank{rank}" if rank in frozen else "",
            )  # fmt: skip
            self.live.observe(
                rank, now, None if rank in silent else state, process if rank in pending else None
            )
        return self.live.verdict(now, pending, done, failed)

    def until(
        self, end: float, groups: dict, start: float = 0.5, step: float = 0.5, **kw
    ) -> tuple[float, Hang] | None:
        """Looks every `step` s from `start` to `end`; the first (time, hang), or None."""
        now = start
        while now <= end + 1e-9:
            hang = self.at(now, groups, **kw)
            if hang is not None:
                return now, hang
            now += step
        return None


# ------------------------------------------------------------------------------------------ slow is not hung


def test_a_rank_waiting_for_a_computing_peer_is_never_hung() -> None:
    """Rank 0 waits in collective #5 of [0, 1]; rank 1 has issued 4 and computes (runnable, however long);
    rank 2 is in another group."""
    groups = {0: (_group("a", (0, 1), 5, 4),), 1: (_group("a", (0, 1), 4, 4),), 2: ()}
    assert Ranks().until(1000.0, groups, step=5.0, working=(1, 2)) is None


def test_a_starved_rank_still_in_a_collective_its_peer_left_is_not_a_hang() -> None:
    """The false verdict seen three times at load 7-12: rank 1 still shows collective #2 pending (its data
    was sent; its gloo thread waits for a core to finish) while rank 0 completed #2 and issued later ones.
    Rank 1 is runnable: starvation, never a hang. Mutation tried: the old rule (a peer that completed #n
    proves a mismatch, after the grace) failed this at 3.5 s."""
    groups = {0: (_group("a", (0, 1), 4, 3, since=0.5),), 1: (_group("a", (0, 1), 2, 1, since=0.5),), 2: ()}
    assert Ranks().until(300.0, groups, working=(1,), busy=(0, 2)) is None


def test_a_blocked_rank_in_a_collective_its_peer_left_and_went_past_is_stuck() -> None:
    """The same picture with rank 1 blocked (no thread runnable, no CPU): evidence that cannot come from
    slowness. Rank 1 is named after the grace, with what rank 0 did meanwhile."""
    groups = {0: (_group("a", (0, 1), 4, 3, since=0.5),), 1: (_group("a", (0, 1), 2, 1, since=0.5),), 2: ()}
    found = Ranks().until(30.0, groups, working=(2,))
    assert found is not None
    when, hang = found
    assert 3.5 <= when <= 4.5 and hang.ranks == (1,) and hang.waiting, (when, hang)
    assert hang.why == (
        "rank 1 (cpu) has been waiting in collective #2 (all_reduce over ranks 0, 1) for "
        f"{when - 0.5:.0f} s while running 'steps', which rank 0 has left (it completed it and issued 2 more "
        f"on that group; it is waiting in collective #4 (all_reduce over ranks 0, 1) for {when - 0.5:.0f} s) "
        "while this rank does no work: the ranks issued their collectives in different orders"
    )


def test_a_rank_whose_recorder_lags_behind_its_own_later_collectives_is_not_stuck() -> None:
    """Four ranks; rank 1 blocks after collective #27. Ranks 0 and 3 wait in #28 for it; rank 2 waits there too,
    but its recorder still shows #27 not completed (issued 28, completed 26), which rank 0 has left. Rank 2
    has moved past #27 itself: rank 1 is named (after the 5 s hold), not rank 2 (seen in `bench hangs`).
    Mutation tried: without the `group.issued > n` guard in `_peers`, rank 2 was named at 4.5 s."""
    waiting = _group("a", (0, 1, 2, 3), 28, 27, since=0.5)
    groups = {
        0: (waiting,),
        1: (_group("a", (0, 1, 2, 3), 27, 27),),
        2: (_group("a", (0, 1, 2, 3), 28, 26, since=0.5),),
        3: (waiting,),
    }
    found = Ranks(world=4).until(30.0, groups)
    assert found is not None and found[1].ranks == (1,) and found[0] >= 6.0, found
    assert "rank 0 waits for it in collective #28" in found[1].why


def test_a_peer_that_left_without_issuing_more_is_no_evidence() -> None:
    """Rank 0 completed #5 and computes (issued nothing after it); rank 1, blocked, still shows #5: not
    proof (the issue's rule asks for the peer past #n *and* later collectives)."""
    groups = {0: (_group("a", (0, 1), 5, 5),), 1: (_group("a", (0, 1), 5, 4, since=0.5),), 2: ()}
    assert Ranks().until(60.0, groups, working=(0, 2)) is None


def test_ranks_sleeping_in_the_same_call_are_never_hung() -> None:
    """Every rank does no work, none waits in a collective: nobody waits for anybody (both ranks sleeping
    40 s in one call, a native call that holds the GIL on every rank: the issue-44 boundary)."""
    assert Ranks().until(120.0, {}) is None
    assert Ranks().until(120.0, {}, silent=(0, 1, 2)) is None


def test_a_rank_that_works_is_never_hung_whatever_its_peers_wait() -> None:
    """Rank 1 is waited for and works: by CPU time, by a runnable thread, by a GPU queue (its host thread
    waiting for the kernels). A GPU rank whose reporting thread waits for a core (late reports) may have
    kernels queued: not judged; a CPU rank has no queue, so its threads alone say."""
    groups = {0: (_group("a", (0, 1), 5, 4, since=0.5),), 1: (_group("a", (0, 1), 4, 4),), 2: ()}
    for how in ({"busy": (1, 2)}, {"working": (1, 2)}, {"gpu": (1,), "working": (2,)}):
        assert Ranks().until(100.0, groups, **how) is None, how
    for device, named in (("cuda:0", False), ("cpu", True)):
        ranks = Ranks(device=device)
        ranks.at(0.5, groups, working=(2,), gpu=(1,))
        found = ranks.until(100.0, groups, start=1.0, silent=(1,), starving=(1,), working=(2,))
        assert (found is not None) == named, (device, found)


# ------------------------------------------------------------------------------------------ blocked ranks


def test_a_waited_for_rank_that_does_no_work_is_named_whatever_it_reports() -> None:
    """Rank 1 reports 'computing' (its reporting thread is fine) but does no work while rank 0 waits for it:
    named and killed after the 5 s hold, rank 0 not named. Mutation tried: without the rule the verdict
    never came (before: only the 600 s collective timeout, naming rank 0)."""
    groups = {0: (_group("a", (0, 1), 5, 4, since=0.5),), 1: (_group("a", (0, 1), 4, 4),), 2: ()}
    found = Ranks().until(30.0, groups, working=(2,))
    assert found is not None
    when, hang = found
    assert 6.0 <= when <= 6.5 and hang.ranks == hang.kill == (1,) and not hang.waiting, (when, hang)
    assert hang.why == (
        "worker rank 1 (cpu, pid 101) does no work while running 'steps': it reports computing 'steps' "
        f"({when:.0f} s so far), but for {when - 1.0:.0f} s it has used no CPU, waited for no disk and queued "
        "no GPU work, and rank 0 waits for it in collective #5 (all_reduce over ranks 0, 1): it is blocked "
        "(a lock, a sleep, a native call that never returns)"
    )


def test_a_silent_rank_that_does_no_work_is_named_as_stopped_reporting() -> None:
    """Its reports stopped (a native call holds the interpreter) and rank 0 waits for it."""
    groups = {0: (_group("a", (0, 1), 5, 4, since=0.5),), 1: (_group("a", (0, 1), 4, 4),), 2: ()}
    ranks = Ranks()
    ranks.at(0.5, groups, working=(2,))
    found = ranks.until(30.0, groups, start=1.0, silent=(1,), working=(2,))
    assert found is not None and found[1].ranks == (1,)
    assert found[1].why.startswith(
        "worker rank 1 (cpu, pid 101) stopped reporting 6 s ago while running 'steps' (its last report: "
        "computing 'steps' (0 s so far)); its process is alive but does no work: stuck in a native call or "
        "deadlocked (rank 0 waits for it in collective #5 (all_reduce over ranks 0, 1))"
    ), found


def test_a_waiting_rank_whose_reports_are_late_still_waits_while_it_does_no_work() -> None:
    """On a loaded machine the waiting rank's reporting thread may wait seconds for a core: its last report
    still says where it is as long as it has done no work since (it cannot have left the collective).
    Mutation tried: trusting only fresh reports (`_current` without the idle clause) never named rank 1."""
    groups = {0: (_group("a", (0, 1), 5, 4, since=0.5),), 1: (_group("a", (0, 1), 4, 4),), 2: ()}
    ranks = Ranks()
    ranks.at(0.5, groups, working=(2,))
    ranks.at(1.0, groups, working=(2,))
    found = ranks.until(30.0, groups, start=1.5, silent=(0,), working=(2,))
    assert found is not None and found[1].ranks == (1,) and found[0] <= 7.0, found


def test_a_rank_left_working_when_its_peers_finished_is_waited_for() -> None:
    """A load (no collectives): ranks 0 and 2 answered; rank 1 reads a tensor and does no work: named after
    the hold. While it works (a slow read: disk wait) it is never named."""
    reading = {1: ("loading", 5, "")}
    assert Ranks(method="load").until(100.0, {}, done=(0, 2), working=(1,), doing=reading) is None
    found = Ranks(method="load").until(30.0, {}, done=(0, 2), doing=reading)
    assert found is not None and found[1].ranks == (1,) and 6.0 <= found[0] <= 6.5
    assert "and ranks 0, 2 finished the job: it is blocked" in found[1].why


def test_a_chain_of_waits_that_ends_at_a_blocked_rank_names_that_rank() -> None:
    """0 waits for 1 (group a), 1 waits for 2 (group b), 2 does no work: rank 2 is named, not the waiters."""
    groups = {
        0: (_group("a", (0, 1), 5, 4, since=0.5),),
        1: (_group("a", (0, 1), 4, 4), _group("b", (1, 2), 3, 2, since=0.5)),
        2: (_group("b", (1, 2), 2, 2),),
    }
    found = Ranks().until(30.0, groups)
    assert found is not None and found[1].ranks == (2,), found
    assert "rank 1 waits for it in collective #3 (all_reduce over ranks 1, 2)" in found[1].why


def test_a_new_job_starts_with_no_idleness_carried_over() -> None:
    """A rank idle between jobs is judged in the new job from the moment a peer waits for it, and the
    message counts its idleness in this job (its report of the new job is a sign of work). Mutation tried:
    a new report's activity not counting as work (`moved` left out) said 'for 56 s it has used no CPU'."""
    ranks = Ranks()
    ranks.until(50.0, {})
    fresh = Liveness(("cpu",) * 3, (100, 101, 102), Watchdog(), 50.0, "steps", 6)
    fresh.carry(ranks.live.seen)
    ranks.live, ranks.job = fresh, 6
    groups = {0: (_group("a", (0, 1), 5, 4, since=50.5),), 1: (_group("a", (0, 1), 4, 4),), 2: ()}
    found = ranks.until(70.0, groups, start=50.5, working=(2,))
    assert found is not None and found[0] >= 55.5, found
    assert re.search(r"but for [56] s it has used no CPU", found[1].why), found[1].why


def test_a_waited_for_rank_whose_other_threads_work_is_named() -> None:
    """Issue 56: rank 1 sleeps in Python while gloo's threads (or any other of its threads) use CPU and are
    runnable now and then; rank 0 waits for it. The job's thread alone says whether it works: named after
    the 5 s hold. Mutation tried: counting every thread's ticks and states again (`job = whole` in
    `Liveness.observe`) never named it (None at 60 s), the caller's own timeout naming rank 0 instead."""
    groups = {0: (_group("a", (0, 1), 5, 4, since=0.5),), 1: (_group("a", (0, 1), 4, 4),), 2: ()}
    for noise in ({"threads": (1,)}, {"ticking": (1,)}):
        found = Ranks().until(60.0, groups, working=(2,), **noise)
        assert found is not None and found[1].ranks == (1,) and 6.0 <= found[0] <= 6.5, (noise, found)
        assert "does no work while running 'steps'" in found[1].why


def test_a_rank_inside_a_collective_whose_threads_move_its_data_is_not_idle() -> None:
    """Rank 1 still shows collective #2 pending while rank 0 has left it and issued more (the starved-rank
    picture): its main thread waits, gloo's threads are runnable, finishing the transfer. Its whole process
    counts there, not its job's thread: no verdict. A rank whose late report comes from a starved reporting
    thread is judged by its whole process too (it may have entered a collective since). Mutation tried:
    judging the collective rules by the job's thread (`quiet_since` from the job's view) named rank 1 at
    4.5 s."""
    left = {0: (_group("a", (0, 1), 4, 3, since=0.5),), 1: (_group("a", (0, 1), 2, 1, since=0.5),), 2: ()}
    assert Ranks().until(300.0, left, threads=(1,), busy=(0, 2)) is None
    waits = {0: (_group("a", (0, 1), 5, 4, since=0.5),), 1: (_group("a", (0, 1), 4, 4),), 2: ()}
    ranks = Ranks()
    ranks.at(0.5, waits, working=(2,))
    assert (
        ranks.until(100.0, waits, start=1.0, silent=(1,), starving=(1,), threads=(1,), working=(2,)) is None
    )


def test_a_look_at_which_the_waiter_is_not_seen_waiting_does_not_start_the_hold_over() -> None:
    """On a loaded machine the waiting rank's report is sometimes late while its gloo threads tick: at such
    a look nobody is seen waiting for rank 1. The hold goes on through gaps shorter than a late report
    (`FRESH`). Mutation tried: starting the hold over at every gap (as the old `_hold` did) never named
    rank 1 here (None at 30 s; the issue's probe saw 15.5-21.4 s at load 15)."""
    groups = {0: (_group("a", (0, 1), 5, 4, since=0.5),), 1: (_group("a", (0, 1), 4, 4),), 2: ()}
    ranks = Ranks()
    found, now = None, 0.5
    while found is None and now < 30:
        gap = int(now * 2) % 8 == 7  # every 4 s one look with rank 0's report late and not current
        ranks.live.seen[0].reported -= 2.0 if gap else 0.0
        found = ranks.at(now, groups, working=(2,), silent=(0,) if gap else (), threads=(0,) if gap else ())
        now += 0.5
    assert found is not None and found.ranks == (1,) and now - 0.5 <= 6.5, (now, found)


def test_a_waited_for_rank_in_uninterruptible_sleep_is_named_after_its_own_window() -> None:
    """Rank 1's job thread is in D with no page read and no tick (a stuck driver call, a frozen cgroup v1)
    while rank 0 waits: not hung after the 5 s of a Python hang (a slow disk waits in D too), named after
    `uninterruptible` (30 s), with where in the kernel it waits. A rank in D that reads pages (a slow network
    share) is never named; nor one nobody waits for. Mutation tried: without `_uninterruptible` the job never
    ended (None at 120 s); counting D as no work (`in_d` left out of the idle clock) named it at 6 s."""
    groups = {0: (_group("a", (0, 1), 5, 4, since=0.5),), 1: (_group("a", (0, 1), 4, 4),), 2: ()}
    found = Ranks().until(120.0, groups, working=(2,), in_d=(1,))
    assert found is not None and found[1].ranks == found[1].kill == (1,) and 31.0 <= found[0] <= 31.5, found
    assert found[1].why == (
        "worker rank 1 (cpu, pid 101) has been in uninterruptible sleep (D) for 30 s while running 'steps' "
        f"(it reports computing 'steps' ({found[0]:.0f} s so far); in the kernel at fuse_wait), with no CPU "
        "time or disk reads since, and rank 0 waits for it in collective #5 (all_reduce over ranks 0, 1): a "
        "stuck driver or disk call"
    )
    assert Ranks().until(300.0, groups, working=(2,), reading=(1,), step=2.0) is None
    assert Ranks().until(300.0, {}, working=(0, 2), in_d=(1,), step=2.0) is None
    assert Ranks(uninterruptible=3.0).until(10.0, groups, working=(2,), in_d=(1,))[0] <= 4.5  # scaled


def test_a_rank_whose_cgroup_is_frozen_is_named_like_a_stopped_one() -> None:
    """A frozen cgroup (v2: its threads asleep, S; v1: D) stops the rank as SIGSTOP does: named after the
    `stopped` window, with the cgroup. Mutation tried: without `frozen` in the stopped rule nothing was
    named at 3.1 s (a v2-frozen rank then waits for the 5 s rule, named as 'stuck in a native call')."""
    ranks = Ranks()
    assert ranks.at(0.5, {}, working=(0, 2)) is None
    assert ranks.at(1.0, {}, frozen=(1,), silent=(1,), working=(0, 2)) is None
    assert ranks.at(2.9, {}, frozen=(1,), silent=(1,), working=(0, 2)) is None
    hang = ranks.at(3.1, {}, frozen=(1,), silent=(1,), working=(0, 2))
    assert hang is not None and hang.ranks == hang.kill == (1,)
    assert hang.why == (
        "worker rank 1 (cpu, pid 101) is frozen by its cgroup's freezer (/cg/rank1) while running 'steps' "
        "(computing 'steps' (3 s so far))"
    )


def test_gloo_ticks_do_not_keep_ranks_waiting_for_each_other_from_being_stuck() -> None:
    """Two ranks blocked in collectives the other never enters (a cycle), their gloo threads using three
    ticks a second (0.03 of a core), which land in one look: over a window of a second that is no work.
    Mutation tried: comparing the CPU time look to look (`CPU_WINDOW` = 0: 0.03 s in 0.2 s reads as 0.15
    of a core) named nobody (None at 60 s)."""
    groups = {
        0: (_group("a", (0, 1), 5, 4, since=1.0), _group("b", (0, 1), 1, 1)),
        1: (_group("a", (0, 1), 4, 4), _group("b", (0, 1), 2, 1, since=1.0)),
        2: (),
    }
    found = Ranks().until(60.0, groups, start=1.0, step=0.2, working=(2,), ticking=(0, 1))
    assert found is not None and found[1].ranks == (0, 1) and found[0] <= 6.0, found


# ------------------------------------------------------------------------------------------ collectives


def test_a_rank_waiting_for_a_finished_peer_is_stuck_after_the_grace() -> None:
    ranks = Ranks()
    groups = {0: (_group("a", (0, 1), 5, 4, since=1.0),), 1: (_group("a", (0, 1), 4, 4),), 2: ()}
    assert ranks.at(1.0, groups, done=(1,), working=(0, 2)) is None
    assert ranks.at(3.9, groups, done=(1,), working=(0, 2)) is None  # 2.9 s: within the grace
    hang = ranks.at(4.1, groups, done=(1,), working=(0, 2))
    assert hang is not None and hang.ranks == (0,) and hang.waiting
    assert hang.why == (
        "rank 0 (cpu) has been waiting in collective #5 (all_reduce over ranks 0, 1) for 3 s while running "
        "'steps', which rank 1 will never enter: it has finished the job"
    )


def test_a_peer_reporting_idle_in_this_job_has_finished_it() -> None:
    """Rank 1's reply has not arrived yet, but it reports idle after this job (5) with 4 collectives: it
    will never enter #5. Mutation tried: `_finished` without the idle report left rank 0 waiting until
    the 5 s hold named rank 1 instead (None at 4.5 s)."""
    groups = {0: (_group("a", (0, 1), 5, 4, since=0.5),), 1: (_group("a", (0, 1), 4, 4),), 2: ()}
    idle = {1: ("idle", 5, "")}
    found = Ranks().until(4.5, groups, working=(0, 2), doing=idle)
    assert found is not None and found[1].ranks == (0,), found
    assert found[1].why.endswith("which rank 1 will never enter: it has finished the job")
    # idle after an earlier job is no such thing: it has not started this one
    assert Ranks().until(4.5, groups, working=(0, 1, 2), doing={1: ("idle", 4, "")}) is None


def test_a_finished_peer_that_went_through_the_collective_is_evidence_only_while_the_rank_is_blocked() -> (
    None
):
    """Rank 1 answered after completing #5 (its last collective); rank 0 still shows #5. A finished peer
    issues nothing more: while rank 0 works (starved) it waits; blocked, it is stuck."""
    groups = {0: (_group("a", (0, 1), 5, 4, since=0.5),), 1: (_group("a", (0, 1), 5, 5),), 2: ()}
    assert Ranks().until(60.0, groups, done=(1,), working=(0,)) is None
    found = Ranks().until(60.0, groups, done=(1,), working=(2,))
    assert found is not None and found[1].ranks == (0,)
    assert "which rank 1 has left: it completed it and has finished the job" in found[1].why


def test_ranks_that_issued_collectives_in_different_orders_are_all_named() -> None:
    """Rank 0 waits in #5 of group a, which rank 1 has not reached; rank 1 waits in #2 of group b, which
    rank 0 has not reached: neither can go on (both blocked). Rank 2, computing, is not named; while one
    of the two works (an asynchronous collective it will wait for later), it is no cycle yet."""
    groups = {
        0: (_group("a", (0, 1), 5, 4, since=1.0), _group("b", (0, 1), 1, 1)),
        1: (_group("a", (0, 1), 4, 4), _group("b", (0, 1), 2, 1, since=1.0)),
        2: (),
    }
    assert Ranks().until(60.0, groups, working=(1, 2)) is None
    found = Ranks().until(60.0, groups, start=1.0, working=(2,))
    assert found is not None and found[1].ranks == (0, 1), found
    assert "rank 1 (cpu) has been waiting in collective #2 (all_reduce over ranks 0, 1)" in found[1].why


def test_a_chain_of_waits_that_ends_at_a_computing_rank_is_not_a_hang() -> None:
    """0 waits for 1 (group a), 1 waits for 2 (group b), 2 computes: everyone will go on."""
    groups = {
        0: (_group("a", (0, 1), 5, 4, since=1.0),),
        1: (_group("a", (0, 1), 4, 4), _group("b", (1, 2), 3, 2, since=1.0)),
        2: (_group("b", (1, 2), 2, 2),),
    }
    assert Ranks().until(60.0, groups, working=(2,)) is None


def test_a_rank_waiting_for_a_computing_and_a_cycling_peer_is_not_named() -> None:
    """Four ranks: 0 waits in group a (0, 1, 2) for 1 (computing) and 2; 2 and 3 wait for each other in a
    cycle. Only 2 and 3 are named: 0 waits for a rank that can go on. Mutation tried: `any` for `all` in
    the wait chain named rank 0 too ((0, 2, 3))."""
    groups = {
        0: (_group("a", (0, 1, 2), 7, 6, since=1.0),),
        1: (_group("a", (0, 1, 2), 6, 6),),
        2: (_group("a", (0, 1, 2), 6, 6), _group("c", (2, 3), 3, 2, since=1.0), _group("d", (2, 3), 1, 1)),
        3: (_group("c", (2, 3), 2, 2), _group("d", (2, 3), 2, 1, since=1.0)),
    }
    found = Ranks(world=4).until(60.0, groups, start=1.0, working=(1,))
    assert found is not None and found[1].ranks == (2, 3), found
    # the same cycle over three ranks: 0 -> 1 -> 2 -> 0
    cycle = {
        0: (_group("a", (0, 1), 5, 4, since=1.0), _group("c", (0, 2), 1, 1)),
        1: (_group("a", (0, 1), 4, 4), _group("b", (1, 2), 3, 2, since=1.0)),
        2: (_group("b", (1, 2), 2, 2), _group("c", (0, 2), 2, 1, since=1.0)),
    }
    found = Ranks().until(60.0, cycle, start=1.0)
    assert found is not None and found[1].ranks == (0, 1, 2), found


def test_recorders_that_disagree_on_a_collective_are_a_mismatch_at_once() -> None:
    """Both ranks are in #5, rank 0's recorder says all_reduce, rank 1's broadcast: a mismatch, whatever
    they do (no idleness needed). Shapes count for all_reduce; an all-to-all may split unevenly."""
    mine = "all_reduce [[4,3]]"
    for theirs, stuck in (
        ("broadcast [[4,3]]", True),
        ("all_reduce [[4,2]]", True),
        ("all_reduce [[4,3]]", False),
    ):
        groups = {
            0: (_group("a", (0, 1), 5, 4, since=0.5, answer=mine),),
            1: (_group("a", (0, 1), 5, 4, since=0.5, answer=theirs),),
            2: (),
        }
        found = Ranks().until(20.0, groups, working=(0, 1, 2))
        assert (found is not None) == stuck, (theirs, found)
        if stuck:
            assert found[0] <= 4.0 and 0 in found[1].ranks
            assert f"which rank 1 issued as {theirs.replace(' ', ' of ')} where it issued all_reduce of " in (
                found[1].why
            )
    assert same_collective("all_to_all [[8,2]]", "all_to_all [[6,2]]")
    assert not same_collective("all_gather [[1]]", "all_reduce [[1]]")


def test_the_ranks_are_asked_about_the_collective_one_waits_in() -> None:
    ranks = Ranks()
    groups = {0: (_group("a", (0, 1), 5, 4, since=0.5),), 1: (_group("a", (0, 1), 4, 4),), 2: ()}
    ranks.at(1.0, groups, working=(1, 2))
    assert ranks.live.questions == {}
    ranks.at(1.6, groups, working=(1, 2))
    assert ranks.live.questions == {"a": 5}


def test_the_rank_a_timed_out_collective_waited_for_is_the_one_named() -> None:
    """Rank 0 waited in #5 for rank 1, which computes: at the collective timeout rank 0 fails from inside;
    the rank it waited for is rank 1."""
    ranks = Ranks(collective_timeout=20.0)
    groups = {0: (_group("a", (0, 1), 5, 4, since=0.5),), 1: (_group("a", (0, 1), 4, 4),), 2: ()}
    ranks.until(15.0, groups, working=(1, 2))
    assert ranks.live.waited_for(0, 15.0) is None
    ranks.until(19.0, groups, start=15.5, working=(1, 2))
    group, late = ranks.live.waited_for(0, 19.0)
    assert (group.name, group.pending, late) == ("a", 5, [1])


def test_a_stale_report_does_not_say_where_a_rank_waits() -> None:
    """Rank 0's last report (2 s old) has it in #5, which finished rank 1 never issued; since then its
    reporting thread has been starved (runnable) and it may well have moved on. Mutation tried: without
    the FRESH check the stale report failed the job at 4.5 s."""
    ranks = Ranks()
    groups = {0: (_group("a", (0, 1), 5, 4, since=0.5),), 1: (_group("a", (0, 1), 4, 4),), 2: ()}
    ranks.at(0.5, groups, done=(1,), working=(0, 2))
    assert ranks.until(60.0, groups, start=1.0, done=(1,), silent=(0,), starving=(0,), busy=(0,)) is None


def test_after_a_failure_a_rank_that_has_not_moved_for_the_collective_timeout_is_stuck() -> None:
    """Rank 1 failed; rank 0 computes and never reaches the collective its failed peer left: past the
    collective timeout it counts as stuck, so the job ends. Mutation tried: without the `failed` branch
    the job never ended (None at 60 s)."""
    found = Ranks(world=2, collective_timeout=20.0).until(60.0, {}, done=(1,), working=(0,), failed=True)
    assert found is not None and found[1].ranks == (0,) and 23.0 <= found[0] <= 24.0, found
    assert found[1].why == (
        "rank 0 (cpu) has been computing 'steps' (23 s so far) since its peer failed, longer than the "
        "collective timeout (20 s)"
    ).replace("(23 s", f"({found[0]:.0f} s")


def test_a_silent_idle_rank_nobody_waits_for_ends_at_the_collective_timeout() -> None:
    """Every rank in a native call that holds the interpreter (nobody waits for anybody): left to the last
    clock, the collective timeout; an 8 s one completes (the issue-44 boundary)."""
    ranks = Ranks(collective_timeout=20.0)
    ranks.at(0.5, {})
    assert ranks.until(20.0, {}, start=1.0, silent=(0, 1, 2)) is None
    found = ranks.until(40.0, {}, start=20.5, silent=(0, 1, 2))
    assert found is not None and found[1].ranks == (0, 1, 2)
    assert (
        "has reported nothing and done no work for longer than the collective timeout (20 s" in found[1].why
    )


def test_a_stopped_process_is_a_hang_after_two_seconds() -> None:
    ranks = Ranks()
    assert ranks.at(1.0, {}, stopped=(1,), working=(0, 2)) is None
    assert ranks.at(2.9, {}, stopped=(1,), working=(0, 2)) is None
    hang = ranks.at(3.1, {}, stopped=(1,), working=(0, 2))
    assert hang is not None and hang.ranks == hang.kill == (1,)
    assert hang.why.startswith("worker rank 1 (cpu, pid 101) is stopped (SIGSTOP or a debugger)")


def test_a_collective_left_pending_before_the_ranks_current_work_is_no_wait() -> None:
    """Rank 0's recorder still shows the start-up health check's all-gather (#2) pending, though rank 0
    has since started a load and reports reading tensors; rank 1 completed #2. Rank 0 is not waiting
    there. Mutation tried: without `_blocking`'s `pending_since >= since` this test failed."""
    live = Liveness(("cpu",) * 2, (100, 101), Watchdog(), 0.0, "load", job=5)
    stale = (_group("WORLD", (0, 1), 2, 1, since=0.5),)
    moved = (_group("WORLD", (0, 1), 3, 3),)
    for beat, now in enumerate((1.0, 2.0, 4.5, 9.0, 12.0), 1):
        for rank, groups in ((0, stale), (1, moved)):
            state = RankState(rank, 100 + rank, beat, "loading", 5, "load", beat, 112, 1.0, "", groups)
            live.observe(rank, now, state, Process(stopped=False, cpu_seconds=0.0))
        assert live.verdict(now, [0, 1], ()) is None, now


# ------------------------------------------------------------------------------------------ start-up


@pytest.mark.parametrize(
    ("behind", "ahead", "named"),
    [
        (("starting", 0, "importing its methods"), ("idle", 0, ""), "rank 0 is ready"),
        (None, ("starting", 0, "joining the process group"), "rank 0 waits for it to join the group"),
    ],
    ids=["importing its methods", "importing torch"],
)
def test_a_rank_blocked_while_starting_is_named_when_a_rank_further_along_waits(behind, ahead, named) -> None:
    """At start-up a rank further along waits for the others (joining the process group, or ready): one
    that is behind and does no work is named after the hold, before any start timeout. Ranks at the same
    stage wait for nobody; one that works (a slow import) is never named."""
    ranks = Ranks(world=2, method="", job=0)
    silent = (1,) if behind is None else ()
    doing = {0: ahead, 1: behind or ("starting", 0, "")}
    found = ranks.until(30.0, {}, doing=doing, silent=silent)
    assert found is not None and found[1].ranks == (1,) and 5.5 <= found[0] <= 6.5, found
    assert named in found[1].why and "does no work while starting" in found[1].why, found[1].why
    assert Ranks(world=2, method="", job=0).until(100.0, {}, doing=doing, silent=silent, working=(1,)) is None
    same = {0: doing[1], 1: doing[1]}
    assert Ranks(world=2, method="", job=0).until(100.0, {}, doing=same, silent=silent) is None
