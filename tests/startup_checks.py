"""Imported by the workers while they start (`WorkerGroup(methods=["startup_checks"])`, after they joined
the process group): what `RP_TEST_IMPORT` says one rank does while importing its methods.

'block:<rank>:<stamp file>': the rank blocks in Python for ever (its reports go on; it does no work), after
writing time.monotonic() to the stamp file (the same clock in every process on Linux); 'work:<rank>:<s>':
the rank works for <s> seconds (a slow import that completes).
"""

from __future__ import annotations

import os
import time

from worker_jobs import block_in_python, work_for

_WHAT = os.environ.get("RP_TEST_IMPORT", "")
if _WHAT:
    _KIND, _RANK, _ARG = _WHAT.split(":", 2)
    if os.environ["RP_RANK"] == _RANK:
        if _KIND == "block":
            with open(_ARG, "w") as stamp:
                stamp.write(repr(time.monotonic()))
            block_in_python()
        elif _KIND == "work":
            work_for(float(_ARG))
