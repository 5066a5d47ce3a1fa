"""A start-up health check that hangs like a broken GPU peer-to-peer path: until the group runs with
NCCL_P2P_DISABLE=1, rank 0 never joins the collective and the other ranks wait in it forever.

Imported by the workers through `WorkerGroup(methods=["hang_checks"])`: it replaces the built-in
`health_check` handler (methods the group names are imported after the built-in ones).
"""

from __future__ import annotations

import os
import time

from rocm_parallel.backend.runtime.messages import HealthReport, HealthRequest
from rocm_parallel.backend.runtime.probe import health_check
from rocm_parallel.backend.runtime.worker import WorkerContext, handler


@handler("health_check", HealthRequest)
def hangs_unless_p2p_disabled(ctx: WorkerContext, request: HealthRequest) -> HealthReport:
    if os.environ.get("NCCL_P2P_DISABLE") != "1" and ctx.rank == 0:
        time.sleep(3600)  # the others block in health_check's all-reduce, waiting for rank 0
    return health_check(ctx, request)
