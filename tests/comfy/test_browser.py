"""The web panel in a real browser: headless Chromium opens the real ComfyUI, loads a workflow with the
loader node, and the panel shows the worker group that just ran a prompt. A screenshot is kept.

Chromium is driven through the DevTools protocol over a websocket (aiohttp's client, which ComfyUI
needs anyway). Skipped without COMFYUI_PATH or a `chromium` binary (Debian: apt-get install chromium).
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from comfy_server import PACK_ROOT, Comfy, sampling_prompt

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
            value = await self.evaluate(expression)
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


def loader_workflow() -> dict[str, Any]:
    """The shared TP workflow with its loader pointed at the test model and CPU workers."""
    workflow = json.loads((PACK_ROOT / "workflows" / "flux1_dev_tp4.json").read_text())
    loader = next(n for n in workflow["nodes"] if n["type"] == "RocmParallelLoader")
    loader["widgets_values"][:2] = ["tiny-flux-dev.safetensors", "cpu x2"]
    return workflow


async def _panel(url: str, server: str, screenshot: Path) -> list[str]:
    import aiohttp

    async with aiohttp.ClientSession() as session, session.ws_connect(url, max_msg_size=0) as ws:
        tools = DevTools(ws)
        await tools.send("Page.enable")
        await tools.send("Page.navigate", url=f"http://{server}/")
        await tools.wait_for("!!(window.app && window.app.graph && window.__rocmParallel)", timeout=240)
        await tools.evaluate(f"app.loadGraphData({json.dumps(loader_workflow())})")
        # Close whatever dialog the frontend opened (e.g. missing text encoders), then show the loader.
        await tools.evaluate(
            "document.querySelectorAll('.p-dialog-close-button').forEach(b => b.click());"
            "(() => { const n = app.graph._nodes.find(n => n.type === 'RocmParallelLoader');"
            " app.canvas.ds.scale = 1.3; app.canvas.ds.offset = [40 - n.pos[0], 60 - n.pos[1]];"
            " app.graph.setDirtyCanvas(true, true); })()"
        )
        lines = await tools.wait_for(
            "(() => { const n = app.graph._nodes.find(n => n.type === 'RocmParallelLoader');"
            " const l = n && n.rocmParallelLines;"
            " return l && l[0].startsWith('2 workers') ? l : null; })()",
            timeout=60,
        )
        await asyncio.sleep(1.0)
        shot = await tools.send("Page.captureScreenshot", format="png")
        screenshot.write_bytes(base64.b64decode(shot["data"]))
        return lines


def test_panel_shows_the_worker_group(comfy: Comfy) -> None:
    reply = comfy.post("/prompt", {"prompt": sampling_prompt(prefix="browser"), "client_id": "rp-test"})
    assert comfy.wait_done(reply["prompt_id"])["status"]["status_str"] == "success"

    # A fresh user: skip the first-run template browser that would cover the canvas.
    comfy.post("/settings/Comfy.TutorialCompleted", True)
    shots = comfy.base / "screenshots"
    shots.mkdir(exist_ok=True)
    profile = Path(tempfile.mkdtemp(prefix="rp-chromium-"))
    proc = subprocess.Popen(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        lines = asyncio.run(_panel(_devtools_url(profile, proc), comfy.server, shots / "loader_panel.png"))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(profile, ignore_errors=True)
    print(f"\nscreenshot: {shots / 'loader_panel.png'}")
    assert lines[0] == "2 workers: cpu, cpu (idle)"
    assert lines[1] == "model: tiny-flux-dev.safetensors"
    assert lines[2] in ("layout: tensor parallel tp=2", "layout: context parallel ring=2 x ulysses=1")
    # the prompt's Ring Attention Sampler has degrees 0/0: the planner chose, and the panel says why
    assert lines[3].startswith("auto: ") and " — fits " in lines[3]
    assert lines[4].startswith("predicted ") and "measured" in lines[4]
    assert [line.split(":")[0] for line in lines[5:7]] == ["rank 0 cpu", "rank 1 cpu"]
    assert (shots / "loader_panel.png").stat().st_size > 10_000
