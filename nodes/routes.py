"""The web panel's data: GET /rocm_parallel/status answers the registry's snapshot as JSON.

Registered only inside ComfyUI (its `server.PromptServer` exists and has an instance). The handler reads
the snapshot the nodes keep up to date; it never calls the workers, which may be running a job.
"""

from __future__ import annotations

import sys

from .registry import REGISTRY

ROUTE = "/rocm_parallel/status"


def register_routes() -> bool:
    """Add the route to ComfyUI's server; False (and nothing done) outside ComfyUI."""
    server = sys.modules.get("server")  # ComfyUI imports its server module before loading custom nodes
    prompt_server = getattr(getattr(server, "PromptServer", None), "instance", None)
    if prompt_server is None:
        return False
    from aiohttp import web

    @prompt_server.routes.get(ROUTE)
    async def status(request: web.Request) -> web.Response:
        return web.json_response(REGISTRY.snapshot())

    return True
