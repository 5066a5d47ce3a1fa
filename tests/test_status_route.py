"""The panel's route (GET /rocm_parallel/status) as ComfyUI's event loop runs it, on a fake ComfyUI server.

The route is as open as ComfyUI's port: every query value is bounded before any work, nothing slow runs on
the event loop, and no user input is answered with a 5xx. Before: `devices=cpu x20000000` built a list of
twenty million names on the loop (ComfyUI blocked 12-24 s, ~1.9 GB), `cpu x` with 25 digits raised an
OverflowError (HTTP 500), and the first query naming devices imported the worker-group client (and through
it torch's records) on the loop. The real-ComfyUI tier (tests/comfy/test_comfy_route.py) sends the same
queries to a running ComfyUI.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import types
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from rocm_parallel.nodes import registry as registry_module
from rocm_parallel.nodes import routes
from rocm_parallel.nodes.registry import Registry

# (query, HTTP status, what the body must say): every hostile value is answered at once, never a 5xx
HOSTILE = [
    ({"devices": "cpu x20000000"}, 200, None),
    ({"devices": "cpu x" + "9" * 25}, 200, None),
    ({"devices": "cpu x" + "9" * 40}, 200, None),
    ({"devices": "cpu x" + "9" * 900}, 200, None),
    ({"devices": "cuda:" + "9" * 25}, 200, None),
    ({"devices": "²"}, 200, None),
    ({"devices": "0," * 400}, 200, None),
    ({"devices": "cpu, " * 10000}, 400, "devices='" + "cpu, " * 11 + "...' (50000 characters) is longer than 1000 characters; a device list is short: 'all', '0,1,2,3', 'cuda:0,cuda:1' or 'cpu x2'"),
    ({"devices": "cpu x2", "checkpoint": "x" * 5000}, 400, "checkpoint='" + "x" * 55 + "...' (5000 characters) is longer than 4096 characters, the longest path a loader's list holds; send the loader's checkpoint widget"),
    ({"devices": "cpu x2", "preload": "tp" + "9" * 10000}, 400, "preload='tp" + "9" * 53 + "...' (10002 characters) is not offered; use one of none, tp, context, auto"),
]  # fmt: skip


class Routes:
    """ComfyUI's `PromptServer.instance.routes`: the handlers registered by path."""

    def __init__(self) -> None:
        self.handlers: dict[str, Callable[..., Coroutine[Any, Any, Any]]] = {}

    def get(self, path: str) -> Callable:
        def register(handler: Callable) -> Callable:
            self.handlers[path] = handler
            return handler

        return register


def _fake_comfy_server(monkeypatch: pytest.MonkeyPatch) -> Routes:
    """ComfyUI's `server` module and aiohttp's `web.json_response`, as the route uses them."""
    table = Routes()
    server = types.ModuleType("server")
    server.PromptServer = type("PromptServer", (), {"instance": types.SimpleNamespace(routes=table)})
    web = types.ModuleType("aiohttp.web")
    web.Request = object
    web.json_response = lambda data, status=200: (status, json.loads(json.dumps(data)))
    aiohttp = types.ModuleType("aiohttp")
    aiohttp.web = web
    for name, module in {"server": server, "aiohttp": aiohttp, "aiohttp.web": web}.items():
        monkeypatch.setitem(sys.modules, name, module)
    assert routes.register_routes()
    return table


async def _answer_while_ticking(handler: Callable, query: dict[str, str]) -> tuple[Any, float]:
    """The handler's response, and the longest the event loop went without running another task
    meanwhile (a tick every 5 ms)."""
    gaps: list[float] = []
    done = asyncio.Event()

    async def tick() -> None:
        last = time.monotonic()
        while not done.is_set():
            await asyncio.sleep(0.005)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.02)  # the ticker runs
    try:
        response = await handler(types.SimpleNamespace(query=query))
    finally:
        done.set()
        await ticker
    return response, max(gaps)


@pytest.fixture
def status_handler(monkeypatch: pytest.MonkeyPatch) -> Callable:
    registry = Registry(factory=lambda devices: None)
    registry.state = {**registry.state, "devices": ["cpu", "cpu"], "phase": "idle"}
    monkeypatch.setattr(registry_module, "REGISTRY", registry)
    return _fake_comfy_server(monkeypatch).handlers[routes.ROUTE]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("query", "status", "error"), HOSTILE, ids=range(len(HOSTILE)))
def test_a_hostile_query_is_answered_at_once_and_never_blocks_the_loop(
    status_handler: Callable, query: dict[str, str], status: int, error: str | None
) -> None:
    (got, body), longest = asyncio.run(_answer_while_ticking(status_handler, query))
    assert (got, body.get("error")) == (status, error)
    if status == 200:
        # the running group is shown, with why the query's devices would not be this loader's own
        assert body["devices"] == ["cpu", "cpu"]
        assert body["mismatch"].startswith(
            "showing the running group of no model on cpu, cpu, not this loader's: "
        )
    # the event loop ran other tasks meanwhile (the real-ComfyUI tier measures another request)
    assert longest < 0.1, f"the event loop was blocked {longest:.2f} s"


def test_a_loaders_query_still_gets_its_mismatch(status_handler: Callable) -> None:
    query = {"checkpoint": "sub/flux.safetensors", "devices": "cpu x3", "preload": "none"}
    (got, body), _ = asyncio.run(_answer_while_ticking(status_handler, query))
    assert got == 200
    assert body["mismatch"] == (
        "showing the running group of no model on cpu, cpu; this loader asks for flux.safetensors on cpu, cpu, "
        "cpu; it will load when queued"
    )


def test_a_slow_answer_runs_off_the_event_loop(
    status_handler: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever the answer costs (the first torch.cuda call of a process, a registry lock held by a load),
    the loop runs other tasks meanwhile: the answer is computed on the executor's thread. Mutation tried:
    the handler calling `answer_widgets` itself held the loop for the whole 0.5 s."""
    real = routes.answer_widgets

    def slow(widgets: Any) -> dict[str, Any]:
        time.sleep(0.5)  # a call that keeps this thread, not the loop's
        return real(widgets)

    monkeypatch.setattr(routes, "answer_widgets", slow)
    (got, body), longest = asyncio.run(_answer_while_ticking(status_handler, {"devices": "cpu x2"}))
    assert got == 200 and body["phase"] == "idle"
    assert longest < 0.1, f"the event loop was blocked {longest:.2f} s"


def test_the_first_query_naming_devices_imports_nothing_on_the_loop() -> None:
    """Inside ComfyUI torch is imported before the pack: the route's first `devices=` query imported the
    worker-group client (launch, liveness, messages, the checkpoint readers: 44 modules, 3.9 s seen under
    load) on the event loop. Now the device check is platforms.py's alone, imported with the nodes."""
    code = """
import sys, torch  # ComfyUI imports torch before any custom node
import rocm_parallel  # the pack's entry point, as ComfyUI loads it
from rocm_parallel.nodes import routes
before = set(sys.modules)
routes.answer({"devices": "cpu x2", "checkpoint": "a.safetensors", "preload": "tp"})
print(sorted(set(sys.modules) - before))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
