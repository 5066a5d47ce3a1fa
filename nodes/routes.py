"""The web panel's data: GET /rocm_parallel/status answers the registry's snapshot as JSON; with a loader's
widgets as query parameters (`checkpoint`, `devices`, `preload`) it adds `mismatch`, the notice that the
running group is not what that loader asks for (None when it is).

Registered only inside ComfyUI (its `server.PromptServer` exists and has an instance). The handler reads
the snapshot the nodes keep up to date; it never calls the workers, which may be running a job.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from . import registry

ROUTE = "/rocm_parallel/status"


def answer(query: Mapping[str, str]) -> dict[str, Any]:
    """The route's JSON: the snapshot, plus `mismatch` when the query names a loader's widgets."""
    state = registry.REGISTRY.snapshot()  # looked up here: the tests swap the registry
    if "devices" in query:
        widgets = {k: query.get(k, "") for k in ("checkpoint", "devices", "preload")}
        state["mismatch"] = registry.mismatch(state, registry.loader_request(**widgets))
    return state


def register_routes() -> bool:
    """Add the route to ComfyUI's server; False (and nothing done) outside ComfyUI."""
    server = sys.modules.get("server")  # ComfyUI imports its server module before loading custom nodes
    prompt_server = getattr(getattr(server, "PromptServer", None), "instance", None)
    if prompt_server is None:
        return False
    from aiohttp import web

    @prompt_server.routes.get(ROUTE)
    async def status(request: web.Request) -> web.Response:
        return web.json_response(answer(request.query))

    return True
