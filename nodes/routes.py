"""The web panel's data: GET /rocm_parallel/status answers the registry's snapshot as JSON; with a loader's
widgets as query parameters (`checkpoint`, `devices`, `preload`) it adds `mismatch`, the notice that the
running group is not what that loader asks for (None when it is).

Registered only inside ComfyUI (its `server.PromptServer` exists and has an instance). The handler reads
the snapshot the nodes keep up to date; it never calls the workers, which may be running a job.

The route is as open as ComfyUI's port and runs on ComfyUI's event loop: each query value is bounded
before any work (HTTP 400 naming it otherwise, never a 5xx), and the answer is computed on a thread of
the loop's executor, so a slow device check (the first torch.cuda call of the process) stalls nobody.
Everything the answer needs is imported with the pack, not on the first query (`platforms` is cheap).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Mapping
from typing import Any

from ..backend import platforms  # imported with the pack, never on the event loop
from ..backend.config import ConfigError
from ..backend.echo import echo
from . import registry
from .inputs import PRELOAD_LAYOUTS

ROUTE = "/rocm_parallel/status"
# The longest checkpoint a loader's list holds (PATH_MAX): the panel sends the widget's value.
MAX_CHECKPOINT_CHARS = 4096


def loader_widgets(query: Mapping[str, str]) -> dict[str, str] | None:
    """A loader's widgets from the query, each bounded and checked before any work (ConfigError naming the
    value, the limit and the fix); None for the plain snapshot (no `devices`). The device text itself is
    `platforms.parse_devices`'s to bound: it refuses a long one at once."""
    if "devices" not in query:
        return None
    widgets = {k: str(query.get(k, "")) for k in ("checkpoint", "devices", "preload")}
    if len(widgets["checkpoint"]) > MAX_CHECKPOINT_CHARS:
        raise ConfigError(
            f"checkpoint={echo(widgets['checkpoint'])} is longer than {MAX_CHECKPOINT_CHARS} characters, the "
            "longest path a loader's list holds; send the loader's checkpoint widget"
        )
    if widgets["preload"] not in ("", *PRELOAD_LAYOUTS):
        raise ConfigError(
            f"preload={echo(widgets['preload'])} is not offered; use one of {', '.join(PRELOAD_LAYOUTS)}"
        )
    if len(widgets["devices"]) > platforms.MAX_DEVICE_TEXT:
        platforms.parse_devices(widgets["devices"])  # its message names the limit and the fix
    return widgets


def answer(query: Mapping[str, str]) -> dict[str, Any]:
    """The route's JSON: the snapshot, plus `mismatch` when the query names a loader's widgets."""
    return answer_widgets(loader_widgets(query))


def answer_widgets(widgets: Mapping[str, str] | None) -> dict[str, Any]:
    state = registry.REGISTRY.snapshot()  # looked up here: the tests swap the registry
    if widgets is not None:
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
        try:
            widgets = loader_widgets(request.query)
        except ConfigError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        state = await asyncio.get_running_loop().run_in_executor(None, answer_widgets, widgets)
        return web.json_response(state)

    return True
