"""A transport pre-flight whose probe fails the way broken GPU links do, rung by rung (preflight.py).

Imported by the workers through `WorkerGroup(methods=["transport_checks"])`: it replaces the built-in
`probe_pairs` handler. `RP_TEST_TRANSPORT_FAULTS` (the group's env) says what happens on which rung of the
ladder, e.g. "nccl=hang,nccl-shm=wrong,nccl-shm-simple=error"; the rung is the worker's RP_TRANSPORT:
- hang: rank 0 never joins the exchange (the others wait in it forever, as on 4 x R9700 with P2P on);
- wrong: rank 1 receives wrong values (what a corrupting P2P path does);
- error: every rank raises, as NCCL does when a transport cannot be set up.
"""

from __future__ import annotations

import os
import time

from rocm_parallel.backend.runtime.messages import HealthRequest, PairReport
from rocm_parallel.backend.runtime.preflight import TRANSPORT_ENV
from rocm_parallel.backend.runtime.probe import probe_pairs
from rocm_parallel.backend.runtime.worker import WorkerContext, handler

FAULTS = "RP_TEST_TRANSPORT_FAULTS"


def fault() -> str:
    faults = dict(f.split("=") for f in os.environ.get(FAULTS, "").split(",") if f)
    return faults.get(os.environ.get(TRANSPORT_ENV, ""), "")


@handler("probe_pairs", HealthRequest)
def faulty_probe_pairs(ctx: WorkerContext, request: HealthRequest) -> PairReport:
    kind = fault()
    if kind == "hang" and ctx.rank == 0:
        time.sleep(3600)  # the others block in the exchange, waiting for rank 0
    if kind == "error":
        raise RuntimeError(
            "NCCL error in: ProcessGroupNCCL.cpp:2011, unhandled system error (run with NCCL_DEBUG=INFO)"
        )
    report = probe_pairs(ctx, request)
    if kind == "wrong" and ctx.rank == 1:
        return PairReport(ctx.rank, False, "from rank 0: 7 (expected 1)", report.pairs)
    return report
