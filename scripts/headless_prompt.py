#!/usr/bin/env python3
"""Queue an API-format workflow on a running ComfyUI, follow it to the end, download what it saved.

    python scripts/headless_prompt.py workflows/api/flux1_dev_tp4.json --seed 7 --out renders/

Progress comes over ComfyUI's websocket when `websocket-client` is installed (pip install
websocket-client); without it the script polls GET /history/{prompt_id} over plain HTTP once a second
(no step-by-step progress then). Only the standard library is needed otherwise. Files the prompt saved
(SaveImage images, SaveLatent latents) are fetched through GET /view into --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any

try:
    import websocket  # websocket-client
except ImportError:
    websocket = None


def post_json(server: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        f"http://{server}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request) as response:
        text = response.read()
    return json.loads(text) if text else {}


def get_json(server: str, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{server}{path}") as response:
        return json.loads(response.read())


def queue_prompt(server: str, prompt: dict[str, Any], client_id: str) -> str:
    """POST /prompt; ComfyUI validates the whole graph first and answers 400 with node errors if it is bad."""
    try:
        reply = post_json(server, "/prompt", {"prompt": prompt, "client_id": client_id})
    except urllib.error.HTTPError as err:
        raise SystemExit(f"ComfyUI refused the prompt ({err.code}): {err.read().decode()}") from None
    return reply["prompt_id"]


def follow_websocket(server: str, prompt_id: str, client_id: str) -> None:
    """Print progress until the prompt finishes (or fails)."""
    ws = websocket.create_connection(f"ws://{server}/ws?clientId={client_id}")
    try:
        while True:
            message = ws.recv()
            if not isinstance(message, str):
                continue  # binary frames are previews
            event = json.loads(message)
            data = event.get("data", {})
            if data.get("prompt_id") not in (None, prompt_id):
                continue
            if event["type"] == "progress":
                print(f"  node {data['node']}: step {data['value']}/{data['max']}", flush=True)
            elif (
                event["type"] == "executing"
                and data.get("node") is None
                and data.get("prompt_id") == prompt_id
            ):
                return
            elif event["type"] in ("execution_error", "execution_interrupted"):
                return  # the history says what happened
    finally:
        ws.close()


def wait_history(server: str, prompt_id: str, timeout: float) -> dict[str, Any]:
    """Poll GET /history/{id} until ComfyUI has recorded the prompt's end."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        history = get_json(server, f"/history/{prompt_id}")
        if prompt_id in history and history[prompt_id].get("status", {}).get("completed") is not None:
            return history[prompt_id]
        time.sleep(1.0)
    raise SystemExit(f"prompt {prompt_id} did not finish within {timeout:g} s")


def saved_files(entry: dict[str, Any]) -> list[dict[str, str]]:
    """Every file the prompt's output nodes report (images, latents, ...) as /view locators."""
    return [
        item
        for output in entry.get("outputs", {}).values()
        for items in output.values()
        if isinstance(items, list)
        for item in items
        if isinstance(item, dict) and "filename" in item
    ]


def download(server: str, item: dict[str, str], out: Path) -> Path:
    query = urllib.parse.urlencode(
        {
            "filename": item["filename"],
            "subfolder": item.get("subfolder", ""),
            "type": item.get("type", "output"),
        }
    )
    target = out / item["filename"]
    with urllib.request.urlopen(f"http://{server}/view?{query}") as response:
        target.write_bytes(response.read())
    return target


def run(server: str, prompt: dict[str, Any], out: Path, timeout: float = 3600.0) -> list[Path]:
    client_id = uuid.uuid4().hex
    prompt_id = queue_prompt(server, prompt, client_id)
    print(f"queued {prompt_id} on {server} ({'websocket' if websocket else 'polling /history'})", flush=True)
    if websocket is not None:
        follow_websocket(server, prompt_id, client_id)
    entry = wait_history(server, prompt_id, timeout)
    status = entry["status"]
    if status.get("status_str") != "success":
        errors = [
            m for m in status.get("messages", []) if m[0] in ("execution_error", "execution_interrupted")
        ]
        raise SystemExit(f"prompt {prompt_id} ended with {status.get('status_str')}: {json.dumps(errors)}")
    out.mkdir(parents=True, exist_ok=True)
    files = [download(server, item, out) for item in saved_files(entry)]
    for path in files:
        print(f"saved {path}")
    return files


SEED_INPUTS = ("seed", "noise_seed")  # KSampler / the pack's samplers; RandomNoise, KSamplerAdvanced


def set_seed(prompt: dict[str, Any], seed: int) -> list[str]:
    """Set every seed input the workflow has (`seed`, `noise_seed`) that is a value, not a link from
    another node; returns 'node id (class).input' for each one changed (empty: nothing was changed)."""
    changed = []
    for node_id, node in prompt.items():
        inputs = node.get("inputs", {}) if isinstance(node, dict) else {}
        for name in SEED_INPUTS:
            if name in inputs and not isinstance(inputs[name], list):
                inputs[name] = seed
                changed.append(f"{node_id} ({node.get('class_type', '?')}).{name}")
    return changed


def load_workflow(path: Path) -> dict[str, Any]:
    """The API-format workflow in `path`, or SystemExit with one line saying what is wrong."""
    try:
        prompt = json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"error: {path}: no such file (the API workflows are in workflows/api/)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SystemExit(f"error: {path} is not a readable JSON workflow: {err}") from None
    if not isinstance(prompt, dict) or not all(
        isinstance(n, dict) and "class_type" in n for n in prompt.values()
    ):
        raise SystemExit(
            f"error: {path} is not in ComfyUI's API format (node id -> {{class_type, inputs}}); export it "
            "with Workflow -> Export (API), or use a file from workflows/api/"
        )
    return prompt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workflow", type=Path, help="an API-format workflow (workflows/api/*.json)")
    parser.add_argument(
        "--server", default="127.0.0.1:8188", help="ComfyUI's host:port (default %(default)s)"
    )
    parser.add_argument("--seed", type=int, help="set every seed / noise_seed input of the workflow")
    parser.add_argument("--out", type=Path, default=Path("."), help="where to put the saved files")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the result")
    args = parser.parse_args(argv)
    prompt = load_workflow(args.workflow)
    if args.seed is not None:
        changed = set_seed(prompt, args.seed)
        if changed:
            print(f"seed {args.seed} set on {', '.join(changed)}", flush=True)
        else:
            print(
                f"--seed {args.seed} changed nothing: no node of {args.workflow.name} has a seed or noise_seed "
                "value (a seed may come from another node's output)",
                flush=True,
            )
    try:
        run(args.server, prompt, args.out, args.timeout)
    except urllib.error.HTTPError:
        raise  # ComfyUI answered: its own error, with its traceback
    except urllib.error.URLError as err:
        raise SystemExit(
            f"error: no ComfyUI answers at http://{args.server} ({err.reason}); start it (python main.py "
            "--listen 127.0.0.1 --port 8188) or pass --server host:port"
        ) from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
