"""The web extension in a real browser: headless Chromium opens the real ComfyUI and reads what a user
sees: the loader's panel after a prompt, while a checkpoint loads, after a Cancel and after a rejected
checkpoint; the Status node's report drawn on the node after it runs; the shipped workflows in the
editor. Screenshots are kept in the ComfyUI base directory (printed by the fixture).

Chromium is driven through the DevTools protocol over a websocket (aiohttp's client, which ComfyUI
needs anyway). Skipped without COMFYUI_PATH or a `chromium` binary (Debian: apt-get install chromium).
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from comfy_server import (
    PACK_DIR_NAME,
    PACK_ROOT,
    REJECTED,
    Comfy,
    absolute_paths,
    loader_node,
    rejected_checkpoint,
    sampling_prompt,
    status_prompt,
)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.comfy,
    pytest.mark.timeout(900),
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (Debian: apt-get install chromium)"),
]
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-extensions",
    "--disable-sync",
    "--no-first-run",
    "--mute-audio",
    "--window-size=1400,900",
    "--remote-debugging-address=127.0.0.1",
    "--remote-debugging-port=0",
]


# DevTools answers to an evaluation the page dropped (a collected promise, a context replaced under it)
_LOST_POLLS = (
    "Promise was collected",
    "Execution context was destroyed",
    "Cannot find context with specified id",
)


class DevTools:
    """The smallest DevTools-protocol client: one page, commands by id, events ignored."""

    def __init__(self, ws: Any) -> None:
        self.ws, self.next_id = ws, 0

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        await self.ws.send_json({"id": self.next_id, "method": method, "params": params})
        while True:
            message = json.loads((await self.ws.receive()).data)
            if message.get("id") == self.next_id:
                assert "error" not in message, message
                return message["result"]

    async def evaluate(self, expression: str) -> Any:
        result = await self.send(
            "Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True
        )
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = await self.evaluate(expression)
            except AssertionError as error:
                # a poll lost by the page, not an answer ("Promise was collected": seen once on a loaded
                # 2-core machine, the same test passing on its rerun): the next poll asks again
                if not any(text in str(error) for text in _LOST_POLLS):
                    raise
                value = None
            if value:
                return value
            assert time.monotonic() < deadline, f"timed out waiting for {expression}"
            await asyncio.sleep(0.5)


def _devtools_url(profile: Path, proc: subprocess.Popen[bytes]) -> str:
    deadline = time.monotonic() + 60
    port_file = profile / "DevToolsActivePort"
    while not port_file.exists():
        assert proc.poll() is None, "chromium exited at start"
        assert time.monotonic() < deadline, "chromium did not open its DevTools port"
        time.sleep(0.2)
    port = port_file.read_text().split()[0]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list") as r:
        pages = [t for t in json.loads(r.read()) if t["type"] == "page"]
    return pages[0]["webSocketDebuggerUrl"]


LOADER, STATUS = "RocmParallelLoader", "RocmParallelStatus"
READY = "!!(!window.__rpOldPage && window.app && window.app.graph && window.__rocmParallel)"


def node_js(node_type: str) -> str:
    return f"app.graph._nodes.find(n => n.type === {json.dumps(node_type)})"


def lines_when(node_type: str, condition: str) -> str:
    """JS: the node's drawn lines (`l`) once `condition` holds for them, else null."""
    return f"(() => {{ const n = {node_js(node_type)}; const l = n && n.rocmParallelLines; return l && ({condition}) ? l : null; }})()"


def loader_workflow(name: str = "flux1_dev_tp4.json") -> dict[str, Any]:
    """A shared workflow with its loader pointed at the test model and CPU workers."""
    workflow = json.loads((PACK_ROOT / "workflows" / name).read_text())
    loader = next(n for n in workflow["nodes"] if n["type"] == LOADER)
    loader["widgets_values"][:2] = ["tiny-flux-dev.safetensors", "cpu x2"]
    return workflow


@pytest.fixture(scope="module")
def browser(comfy: Comfy) -> Iterator[str]:
    """One headless Chromium for the module; yields its page's DevTools websocket URL."""
    comfy.post("/settings/Comfy.TutorialCompleted", True)  # no first-run template browser over the canvas
    profile = Path(tempfile.mkdtemp(prefix="rp-chromium-"))
    proc = subprocess.Popen(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield _devtools_url(profile, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(profile, ignore_errors=True)


def in_page(url: str, comfy: Comfy, scenario: Callable[[DevTools], Awaitable[Any]]) -> Any:
    """Open ComfyUI afresh in the page and run `scenario` there."""
    import aiohttp

    async def run() -> Any:
        async with aiohttp.ClientSession() as session, session.ws_connect(url, max_msg_size=0) as ws:
            tools = DevTools(ws)
            await tools.send("Page.enable")
            await tools.evaluate("window.__rpOldPage = true")
            await tools.send("Page.navigate", url=f"http://{comfy.server}/")
            await tools.wait_for(READY, timeout=240)
            return await scenario(tools)

    return asyncio.run(run())


async def close_dialogs(tools: DevTools) -> None:
    """Close whatever dialog the frontend opened (e.g. missing text encoders)."""
    await asyncio.sleep(1.0)
    await tools.evaluate("document.querySelectorAll('.p-dialog-close-button').forEach(b => b.click())")


async def load_graph(tools: DevTools, workflow: dict[str, Any]) -> None:
    """Load `workflow` into the editor and wait until the canvas holds its nodes.

    Frontend 1.49 (ComfyUI 0.33) opens each loaded workflow in a new tab asynchronously, and right after a
    page load (the previous test's tabs restored) it can drop a load: load again when the canvas does not
    hold the workflow's node types within 10 s.
    """
    types = sorted(n["type"] for n in workflow["nodes"])
    drawn = json.dumps(json.dumps(types, separators=(",", ":")))
    for attempt in range(4):
        await tools.evaluate(f"app.loadGraphData({json.dumps(workflow)})")
        await close_dialogs(tools)
        try:
            await tools.wait_for(
                f"JSON.stringify(app.canvas.graph._nodes.map(n => n.type).sort()) === {drawn}", timeout=10
            )
            return
        except AssertionError:
            if attempt == 3:
                raise


async def show(tools: DevTools, node_type: str, scale: float = 1.3) -> None:
    """`node_type` near the top left, clear of the frontend's side bar and graph menu (both versions)."""
    await tools.evaluate(
        f"(() => {{ const n = {node_js(node_type)}; app.canvas.ds.scale = {scale};"
        f" app.canvas.ds.offset = [120 / {scale} - n.pos[0], 170 / {scale} - n.pos[1]];"
        " app.graph.setDirtyCanvas(true, true); })()"
    )


async def screenshot(tools: DevTools, comfy: Comfy, name: str) -> Path:
    await asyncio.sleep(1.0)  # a frame or two
    shots = comfy.base / "screenshots"
    shots.mkdir(exist_ok=True)
    shot = await tools.send("Page.captureScreenshot", format="png")
    path = shots / name
    path.write_bytes(base64.b64decode(shot["data"]))
    print(f"\nscreenshot: {path}")
    assert path.stat().st_size > 10_000
    return path


def test_panel_shows_the_worker_group(comfy: Comfy, browser: str) -> None:
    # The Ring Attention Sampler with degrees 0/0 runs last: the planner chose, and the panel says why.
    prompt = sampling_prompt(prefix="browser", seed=4242, samplers=("ring",))
    assert comfy.wait_done(comfy.post("/prompt", {"prompt": prompt})["prompt_id"])["status"][
        "status_str"
    ] == ("success")

    async def scenario(tools: DevTools) -> list[str]:
        await load_graph(tools, loader_workflow())
        await show(tools, LOADER)
        lines = await tools.wait_for(lines_when(LOADER, "l.some(x => x.startsWith('2 workers'))"), 60)
        await screenshot(tools, comfy, "loader_panel.png")
        return lines

    notice, *lines = in_page(browser, comfy, scenario)
    # The shipped workflow's loader preloads tp; the Ring Attention Sampler's planner left ring 2 resident.
    layout = lines[2].removeprefix("layout: ")
    assert notice == (
        f"showing the running group of tiny-flux-dev.safetensors on cpu, cpu ({layout}); this loader asks "
        "for tiny-flux-dev.safetensors on cpu, cpu (tp 2); it will load when queued"
    )
    assert lines[0] == "2 workers: cpu, cpu (idle)"
    assert lines[1] == "model: tiny-flux-dev.safetensors"
    assert lines[2].startswith("layout: ring 2")
    assert lines[3].startswith("auto: ") and " — fits " in lines[3]
    assert lines[4].startswith("predicted ") and "measured" in lines[4]
    assert [line.split(":")[0] for line in lines[5:]] == ["rank 0 cpu", "rank 1 cpu"]


def test_loading_line_then_the_status_node_draws_its_report(comfy: Comfy, browser: str) -> None:
    """Run from the editor (Queue): a loader on fresh workers, then the Status node after it."""
    close = comfy.post("/prompt", {"prompt": status_prompt("close")})["prompt_id"]
    assert comfy.wait_done(close)["status"]["status_str"] == "success"
    assert comfy.get("/rocm_parallel/status")["phase"] == "stopped"
    before = set(comfy.get("/history"))

    async def scenario(tools: DevTools) -> tuple[list[str], list[str], list[str], int]:
        await close_dialogs(tools)
        stopped = await tools.evaluate(
            "(async () => { app.graph.clear();"
            f" const l = LiteGraph.createNode('{LOADER}'); l.pos = [60, 80]; app.graph.add(l);"
            f" const s = LiteGraph.createNode('{STATUS}'); s.pos = [520, 80]; app.graph.add(s);"
            " l.connect(0, s, 0);"
            " const set = (k, v) => { l.widgets.find(w => w.name === k).value = v; };"
            # another spelling of 'cpu x2': ComfyUI runs the loader again instead of using its cache
            " set('checkpoint', 'tiny-flux-dev.safetensors'); set('devices', 'cpu, cpu'); set('preload', 'tp');"
            " app.graph.setDirtyCanvas(true, true); await new Promise(r => setTimeout(r, 1500));"
            " const lines = l.rocmParallelLines; await app.queuePrompt(0, 1); return lines; })()"
        )
        await show(tools, LOADER, scale=1.2)
        loading = await tools.wait_for(lines_when(LOADER, "l.some(x => x.startsWith('loading: '))"), 300)
        await screenshot(tools, comfy, "loader_loading.png")
        status = await tools.wait_for(lines_when(STATUS, "true"), timeout=600)
        panel = await tools.wait_for(lines_when(LOADER, "l.some(x => x.startsWith('rank 1 '))"), 60)
        await screenshot(tools, comfy, "status_node.png")
        rows = await tools.evaluate(f"{node_js(STATUS)}.rocmParallelRows")
        return stopped, loading, status, rows, panel

    stopped, loading, status, rows, panel = in_page(browser, comfy, scenario)
    assert stopped == ["ROCm Parallel: workers not started"]
    # While the workers start and load, the file being loaded is named as such, never as the model.
    assert loading[0].startswith("2 workers: cpu, cpu (")
    assert loading[1] == "model: none loaded"
    assert "loading: tiny-flux-dev.safetensors" in loading
    # The Status node draws exactly its ui text, the text /history holds for that run.
    (prompt_id,) = set(comfy.get("/history")) - before
    entry = comfy.get(f"/history/{prompt_id}")[prompt_id]
    assert entry["status"]["status_str"] == "success"
    text = entry["outputs"]["2"]["text"][0]
    assert status == text.split("\n")
    assert status[0] == "ROCm Parallel: 2 workers on cpu, cpu (idle)"
    assert status[1] == "model: tiny-flux-dev.safetensors, tp 2"
    assert [line.split(":")[0] for line in status[2:]] == ["  rank 0 cpu", "  rank 1 cpu"]
    # One unit style: the panel under the loader says exactly what the Status node says about each rank.
    assert [line for line in panel if line.startswith("rank ")] == [line.strip() for line in status[2:]]
    assert re.fullmatch(r"rank 0 cpu: \d+\.\d MB weights", status[2].strip()), status
    assert rows > len(status)  # the long model line wraps at the node's width


def test_panel_after_a_cancel_and_a_rejected_checkpoint(comfy: Comfy, browser: str) -> None:
    async def scenario(tools: DevTools) -> tuple[list[str], list[str], dict[str, Any]]:
        await load_graph(tools, loader_workflow())
        await show(tools, LOADER)
        # Cancel a long run the way ComfyUI's Cancel button does (/interrupt) after a few steps.
        prompt = sampling_prompt(steps=5000, prefix="browser_cancelled", seed=77, samplers=("ring",))
        prompt_id = comfy.post("/prompt", {"prompt": prompt})["prompt_id"]
        await tools.wait_for(
            lines_when(LOADER, r"l.some(x => /\(sampling ([3-9]|\d\d+)\/5000\)/.test(x))"), 300
        )
        comfy.post("/interrupt", {"prompt_id": prompt_id})
        assert comfy.wait_done(prompt_id, timeout=120)["status"]["status_str"] == "error"
        cancelled = await tools.wait_for(lines_when(LOADER, "l.some(x => x.startsWith('last job: '))"), 60)
        await screenshot(tools, comfy, "loader_cancelled.png")
        # A file that is no FLUX checkpoint: rejected before any worker sees it.
        with rejected_checkpoint(comfy) as name:
            rejected = comfy.post("/prompt", {"prompt": status_prompt("report", loader_node(name))})
            assert comfy.wait_done(rejected["prompt_id"])["status"]["status_str"] == "error"
            state = comfy.get("/rocm_parallel/status")
            failed = await tools.wait_for(lines_when(LOADER, "l.some(x => x.startsWith('last error: '))"), 60)
            await screenshot(tools, comfy, "loader_rejected.png")
        return cancelled, failed, state

    cancelled, failed, state = in_page(browser, comfy, scenario)
    # this loader preloads tp, the group holds the sampler's ring 2: said first (test above), then the group
    assert cancelled[0].startswith("showing the running group") and failed[0] == cancelled[0]
    cancelled, failed = cancelled[1:], failed[1:]
    assert cancelled[0] == "2 workers: cpu, cpu (idle)"
    assert cancelled[-1] == "last job: sampling cancelled by the user"
    assert not [line for line in cancelled if line.startswith("last error")]
    assert failed[0] == "2 workers: cpu, cpu (idle)"
    assert failed[1] == "model: tiny-flux-dev.safetensors"  # what the workers hold, not the rejected file
    assert not [line for line in failed if "not-a-flux" in line and not line.startswith("last error: ")]
    assert failed[-1].startswith("last error: ") and "not-a-flux.safetensors" in failed[-1]
    assert state["checkpoint"] == "tiny-flux-dev.safetensors" and state["last"] is None
    assert absolute_paths(state["error"]) == [] and str(comfy.base) not in state["error"]


def _error_shown(word: str) -> str:
    """JS: the text of the innermost elements showing `word` once ComfyUI shows its execution error report
    (frontend 1.32: the error dialog's 'Show Report'; 1.49: the toast's 'View details', its Errors panel;
    1.58: the toast's 'View details', the Issues panel's error log)."""
    return (
        "(() => { const more = [...document.querySelectorAll('button')]"
        ".find(b => ['View details', 'Show Report'].includes(b.innerText.trim())); if (more) more.click();"
        f" const has = e => e.innerText && e.innerText.includes({json.dumps(word)});"
        " const hits = [...document.querySelectorAll('body *')]"
        ".filter(e => has(e) && ![...e.children].some(has));"
        " return hits.length ? hits.map(e => e.innerText).join('\\n') : null; })()"
    )


def test_a_refusal_before_any_worker_starts_and_a_loader_that_asks_for_another_group(
    comfy: Comfy, browser: str
) -> None:
    """Queued from the editor: a loader whose file is no checkpoint ('auto' reads its header before
    anything else) while the running group holds the test model. ComfyUI's error dialog (frontend 1.58:
    its Issues panel) names the error by its class without the install path; the panel shows it as the last error and says that the group
    it shows is not the one this loader asks for; then a loader asking for 3 devices says so too."""
    ready = comfy.post("/prompt", {"prompt": status_prompt("report", loader_node())})["prompt_id"]
    assert comfy.wait_done(ready)["status"]["status_str"] == "success"
    # cpu x2 and tiny-flux-dev; the layout is tp 2, or the ring sampler's when ComfyUI cached this loader
    running = comfy.get("/rocm_parallel/status")
    assert (running["devices"], running["checkpoint"]) == (["cpu", "cpu"], "tiny-flux-dev.safetensors")
    group = f"tiny-flux-dev.safetensors on cpu, cpu ({running['layout']})"
    before = set(comfy.get("/history"))

    async def scenario(tools: DevTools) -> dict[str, Any]:
        await close_dialogs(tools)
        await tools.evaluate(
            "(async () => { app.graph.clear();"
            f" const l = LiteGraph.createNode('{LOADER}'); l.pos = [60, 80]; app.graph.add(l);"
            f" const s = LiteGraph.createNode('{STATUS}'); s.pos = [560, 80]; app.graph.add(s);"
            " l.connect(0, s, 0); l.size[0] = 460;"
            " const set = (k, v) => { l.widgets.find(w => w.name === k).value = v; };"
            f" set('checkpoint', {json.dumps(REJECTED)}); set('devices', 'cpu x2'); set('preload', 'auto');"
            " app.graph.setDirtyCanvas(true, true); await app.queuePrompt(0, 1); })()"
        )
        seen: dict[str, Any] = {"dialog": await tools.wait_for(_error_shown("CheckpointError"), 120)}
        await show(tools, LOADER, scale=1.0)  # the panel readable beside the dialog
        await screenshot(tools, comfy, "error_dialog.png")
        await close_dialogs(tools)
        await show(tools, LOADER, scale=1.1)
        seen["refused"] = await tools.wait_for(
            lines_when(LOADER, "l.some(x => x.startsWith('last error: ')) && l[0].startsWith('showing')"), 60
        )
        await screenshot(tools, comfy, "loader_refused_before_start.png")
        await tools.evaluate(
            f"(() => {{ const l = {node_js(LOADER)};"
            " const set = (k, v) => { l.widgets.find(w => w.name === k).value = v; };"
            " set('checkpoint', 'tiny-flux-dev.safetensors'); set('devices', 'cpu x3'); set('preload', 'tp');"
            " app.graph.setDirtyCanvas(true, true); })()"
        )
        seen["mismatch"] = await tools.wait_for(lines_when(LOADER, "l[0].includes('cpu, cpu, cpu')"), 60)
        await screenshot(tools, comfy, "loader_mismatch.png")
        return seen

    with rejected_checkpoint(comfy):
        seen = in_page(browser, comfy, scenario)
    (prompt_id,) = set(comfy.get("/history")) - before
    messages = comfy.get(f"/history/{prompt_id}")[prompt_id]["status"]["messages"]
    error = next(data for kind, data in messages if kind == "execution_error")
    print(
        "\ndialog:",
        seen["dialog"],
        "\nerror:",
        {k: error[k] for k in ("exception_type", "exception_message")},
    )
    print("refused:", seen["refused"], "\nmismatch:", seen["mismatch"])
    assert error["exception_type"] == "rocm_parallel.backend.checkpoint.files.CheckpointError"
    message = error["exception_message"].strip()
    assert message.startswith(f"'{comfy.base}/models/diffusion_models/{REJECTED}' is not a FLUX.1")
    # ComfyUI's report (frontend 1.32's dialog, 1.49's Errors panel, 1.58's when it opens one) names the
    # class as /history does; frontend 1.58's Issues panel shows its error log instead: the traceback down
    # to the pack's own `raise CheckpointError(`. The pack's folder appears only as file paths in the stack
    # trace, never as a module name (what ComfyUI showed: '<install path>.backend.config.ConfigError').
    dialog, short = seen["dialog"], error["exception_type"].rsplit(".", 1)[1]
    assert error["exception_type"] in dialog or (
        "/backend/checkpoint/info.py" in dialog and dialog.rstrip().endswith(f"raise {short}(")
    )
    assert f"{PACK_DIR_NAME}.backend" not in seen["dialog"] and f"{PACK_DIR_NAME}.backend" not in str(error)
    refused = seen["refused"]
    assert refused[0] == (
        f"showing the running group of {group}; this loader asks for {REJECTED} on cpu, cpu; it will load when queued"
    )
    assert refused[1:3] == ["2 workers: cpu, cpu (idle)", "model: tiny-flux-dev.safetensors"]
    assert refused[3] == f"layout: {running['layout']}"
    # The panel: class name and file name only, cut visibly past 240 characters.
    shown = f"last error: CheckpointError: {message.replace(f'{comfy.base}/models/diffusion_models/', '')}"
    assert refused[-1] == (shown if len(shown) <= 240 else shown[:239] + "…")
    assert seen["mismatch"][0] == (
        f"showing the running group of {group}; this loader asks for "
        "tiny-flux-dev.safetensors on cpu, cpu, cpu (tp 3); it will load when queued"
    )
    assert seen["mismatch"][-1] == refused[-1]


def _overlaps(a: list[float], b: list[float]) -> bool:
    return a[0] < b[0] + b[2] and b[0] < a[0] + a[2] and a[1] < b[1] + b[3] and b[1] < a[1] + a[3]


# Workflows photographed whole (FLUX.1 TP 4, FLUX.2 [dev] TP 4, Qwen-Image batch 2 x tp 2) for a person to look at.
WIDE_SHOTS = (
    "flux1_dev_tp4.json",
    "flux2_dev_parallel_model_tp4.json",
    "qwen_image_parallel_model_batch2_tp2.json",
)


def test_shipped_workflows_load_without_overlapping_nodes(comfy: Comfy, browser: str) -> None:
    names = sorted(p.name for p in (PACK_ROOT / "workflows").glob("*.json"))

    async def scenario(tools: DevTools) -> dict[str, Any]:
        seen = {}
        for name in names:
            await load_graph(tools, loader_workflow(name))
            await asyncio.sleep(1.0)  # let it draw at least once (the loader's panel has its rows)
            # The graph on screen: the canvas's (each loadGraphData opens a workflow tab since frontend 1.49,
            # ComfyUI 0.33's).
            seen[name] = await tools.evaluate(
                "app.canvas.graph._nodes.map(n => ({id: n.id, type: n.type, box: Array.from(n.getBounding()),"
                " pos: Array.from(n.pos), size: Array.from(n.size), rows: n.rocmParallelRows || 0}))"
            )
            if name in WIDE_SHOTS:  # the whole graph on a wide screen, titles readable
                await tools.send(
                    "Emulation.setDeviceMetricsOverride",
                    width=2200,
                    height=1000,
                    deviceScaleFactor=1,
                    mobile=False,
                )
                await asyncio.sleep(1.0)
                await tools.evaluate(
                    "(() => { const b = app.canvas.graph._nodes.map(n => n.getBounding());"
                    " const x0 = Math.min(...b.map(r => r[0])), y0 = Math.min(...b.map(r => r[1]));"
                    " const x1 = Math.max(...b.map(r => r[0] + r[2])), y1 = Math.max(...b.map(r => r[1] + r[3]));"
                    " const s = Math.min(2100 / (x1 - x0 + 80), 800 / (y1 - y0 + 200));"
                    " app.canvas.ds.scale = s; app.canvas.ds.offset = [60 / s - x0, 100 / s - y0];"
                    " app.canvas.setDirty(true, true); })()"
                )
                await screenshot(tools, comfy, f"workflow_{name.removesuffix('.json')}.png")
                await tools.send("Emulation.clearDeviceMetricsOverride")
        return seen

    seen = in_page(browser, comfy, scenario)
    for name, nodes in seen.items():
        saved = json.loads((PACK_ROOT / "workflows" / name).read_text())["nodes"]
        # node ids as text: frontend 1.49 (ComfyUI 0.33) holds them as strings, 1.32 (0.3.75) as numbers
        drawn = sorted((str(n["id"]), n["type"]) for n in nodes)
        assert drawn == sorted((str(n["id"]), n["type"]) for n in saved), name
        for i, a in enumerate(nodes):
            for b in nodes[i + 1 :]:
                assert not _overlaps(a["box"], b["box"]), (name, a["type"], b["type"])
        # The loader's panel, drawn under it, covers no other node either.
        loader = next(n for n in nodes if n["type"] == LOADER)
        assert loader["rows"] >= 1, name  # drawn
        # Its height depends on the group's state (one line on a fresh server, more once workers run and
        # a model is resident, as after the other browser tests): check room for at least 3 lines, so
        # the result does not depend on which tests ran before.
        panel = [
            loader["pos"][0],
            loader["pos"][1] + loader["size"][1] + 8,
            loader["size"][0],
            max(loader["rows"], 3) * 15 + 8,
        ]
        for other in nodes:
            assert other is loader or not _overlaps(panel, other["box"]), (name, other["type"])
