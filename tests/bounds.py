"""Time bounds and watchdog windows the liveness tests share, and why they are what they are.

A rank that blocks is named once it has done no work for the watchdog's `idle` (5 s) while a peer waits for
it (backend/runtime/liveness.py). The seconds between the block and the error the caller sees add the caller's own
looks, the kill and the group's clean-up, all of which wait for a core: on 2 cores at load 13-16 (several
suites at once) a hang while loading was named after 22 s, at load ~2 after 6-9 s. The failures these tests
guard against take far longer: the process groups' 600 s collective timeout (naming the wrong rank), or no
answer at all (41 s, when the caller's own `timeout=30` ended it before the rule existed; 50-70 s for a rank
hung in `time.sleep` while gloo's threads ticked, issue 56). So the bound leaves room for a starved machine
and still fails each of those. `python -m rocm_parallel bench hangs` measures the default windows' times,
idle and beside CPU burners.

`SCALED` (issue 49): the same rules with every window at 0.4 of the default (`Watchdog.scaled`), for the
tests that need a rank to outlast a window (a slow step, every rank asleep, a slow read: 5 windows instead
of 25-40 s of real time) or to be named after one. What they exercise does not depend on the window's
length: a rank that works is never idle however long it works, and a hang is named once its sign has held
for the window. The reports (5 a second) and the caller's looks (5 a second) are not scaled; 0.4 keeps the
`idle` window (2 s) longer than a report may lag (`liveness.FRESH`, 1.5 s).
"""

from rocm_parallel.backend.runtime.liveness import Watchdog

HANG_NAMED_WITHIN = 30.0  # seconds from the block to the caller's error
SCALED = Watchdog().scaled(0.4)  # stopped 0.8 s, idle 2 s, grace 1.2 s, uninterruptible 12 s
OUTLAST = 5  # a slow but healthy rank works (or every rank sleeps) this many `SCALED` windows
CLOSE_WITHIN = 10.0  # seconds `WorkerGroup.close()` may take, whatever state its workers are in (issue 56)
