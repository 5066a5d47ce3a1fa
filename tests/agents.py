"""Another "host" on this machine for the tests: an agent (`worker --join`) on a loopback address of its own
(127.0.0.2, 127.0.0.3, ...: the whole 127/8 is this machine's), with its own models folder, joining this
process's hub (or a ComfyUI server's). Nothing is sent to any address that is not loopback."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

PACK_ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_key(path: Path) -> Path:
    """A group key file as the first host creates one (64 hex digits, mode 600)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o600)
    return path


def agent_command(
    hub: str, key: Path, address: str, devices: str = "cpu x2", models: Path | None = None
) -> list[str]:
    """The one command a host joins with, as the pack's folder runs it (python <pack> worker --join ...)."""
    command = [sys.executable, str(PACK_ROOT), "worker", "--join", hub, "--key-file", str(key)]
    command += ["--devices", devices, "--address", address, "--threads", "1"]
    return command + (["--models", str(models)] if models is not None else [])


@contextmanager
def running_agent(
    hub: str, key: Path, address: str, log: Path, devices: str = "cpu x2", models: Path | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[subprocess.Popen[bytes]]:  # fmt: skip
    """An agent for `address`, stopped (SIGTERM: it stops its ranks first) when the block ends; nothing it
    started may outlive it."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            agent_command(hub, key, address, devices, models), stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        )  # fmt: skip
    try:
        yield proc
    finally:
        family = descendants(proc.pid)
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        assert_gone(family, "the agent's ranks")


def descendants(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_gone(pids: list[int], what: str, seconds: float = 15.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    left = [p for p in pids if alive(p)]
    assert not left, f"{what} left running: {left}"


def wait_joined(address: str, seconds: float = 120.0) -> None:
    """Until this process's hub lists an agent for `address`."""
    from rocm_parallel.backend.runtime.hub import hub

    deadline = time.monotonic() + seconds
    while hub().find(address) is None:
        assert time.monotonic() < deadline, f"no agent for {address} joined within {seconds:g} s"
        time.sleep(0.2)
