"""Time bounds the liveness tests share, and why they are what they are.

A rank that blocks is named once it has done no work for the watchdog's `idle` (5 s) while a peer waits for
it (backend/runtime/liveness.py). The seconds between the block and the error the caller sees add the caller's own
looks, the kill and the group's clean-up, all of which wait for a core: on 2 cores at load 13-16 (several
suites at once) a hang while loading was named after 22 s, at load ~2 after 6-9 s. The failures these tests
guard against take far longer: the process groups' 600 s collective timeout (naming the wrong rank), or no
answer at all (41 s, when the caller's own `timeout=30` ended it before the rule existed). So the bound
leaves room for a starved machine and still fails each of those.
"""

HANG_NAMED_WITHIN = 30.0  # seconds from the block to the caller's error
