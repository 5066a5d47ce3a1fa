"""The first host's end of a group across hosts: one TCP listener for the other hosts' agents and ranks.

A host joins with one command (agent.py: `worker --join ADDRESS:PORT --key-file ... --devices ...`); its
agent connects here and stays connected, and a group that names that host's devices (`'cpu x2,
127.0.0.2:cpu x2'`) asks it to start its ranks (remote.py). Those ranks connect here too, and are handed to
the group start that expects them (`expect`). One port for everything the first host is asked for, besides
the rendezvous store and gloo/NCCL's own connections (docs/hosts.md: the ports to open).

Every connection proves it holds the group's key before anything it sends is read (tcp.py), and then speaks
typed records only (transport.py). An agent is gone when its connection closes (its process died: the kernel
closes it even on SIGKILL) or when it has been silent for `SILENCE` seconds (a frozen host, a cable pulled):
every group using it fails naming the host (remote.py), and its ranks end with it (their death pipe is the
agent's), or, if it is alive but cut off, when it notices the hub's silence.

The hub starts on the first group that names another host and lives as long as the process; nothing listens
before (hostsettings.py: the address and key the user configured).
"""

from __future__ import annotations

import contextlib
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from ..config import ConfigError
from .hostsettings import DOCS, KEY_FILE_ENV, LISTEN_ENV, code_fingerprint, read_key, settings
from .messages import AgentHello, AgentWelcome, FilesChecked, HostReport, Ping, Spawned, Stopped
from .tcp import accept_authenticated
from .transport import Hello, recv_any, send_record

PING = 1.0  # seconds between the hub's pings to each agent (and the agents' reports come 5 x a second)
SILENCE = 10.0  # seconds: an agent (or hub) heard nothing from this long is gone
AGENT_WAIT = 30.0  # seconds a group start waits for a named host's agent to join


class HostGone(RuntimeError):
    """The agent of a host the caller was talking to is gone (its `why`)."""


class AgentLink:
    """One connected agent: what it offers, its reports, and requests to it (thread-safe)."""

    def __init__(self, conn: Connection, hello: AgentHello, on_gone: Callable[[AgentLink], None]) -> None:
        self.conn, self.hello, self._on_gone = conn, hello, on_gone
        self.gone: str | None = None  # why it is gone, once it is
        self.heard = time.monotonic()
        self.offset: float | None = (
            None  # this host's clock minus the agent's (the least seen: least latency)
        )
        self._send_lock = threading.Lock()
        self._waiting: dict[tuple[str, Any], queue.Queue[Any]] = {}
        self._sinks: dict[str, Callable[[HostReport, float], None]] = {}  # launch -> its reports' reader
        threading.Thread(target=self._read, name=f"rp-agent-{hello.address}", daemon=True).start()

    @property
    def name(self) -> str:
        """'host 127.0.0.2 (agent pid 4242)'."""
        return f"host {self.hello.address} (agent pid {self.hello.pid})"

    def send(self, record: Any) -> None:
        """One record to the agent; HostGone when it is gone or the send fails."""
        if self.gone is not None:
            raise HostGone(self.gone)
        try:
            with self._send_lock:
                send_record(self.conn, record)
        except OSError as exc:
            self.lose(f"its connection failed ({exc.strerror or exc})")
            raise HostGone(self.gone) from None

    def ask(self, record: Any, answer: tuple[str, Any], seconds: float) -> Any:
        """Send `record` and wait up to `seconds` for the answer keyed `answer` (kind, id); HostGone when the
        agent goes meanwhile, TimeoutError when it does not answer."""
        self.expect(answer)
        try:
            self.send(record)
        except HostGone:
            self._waiting.pop(answer, None)
            raise
        return self.answer(answer, seconds)

    def expect(self, answer: tuple[str, Any]) -> None:
        """Keep the answer keyed `answer` when it comes (call before sending what it answers)."""
        self._waiting[answer] = queue.Queue()

    def answer(self, answer: tuple[str, Any], seconds: float) -> Any:
        """The answer `expect`ed, waited for up to `seconds` (HostGone, TimeoutError)."""
        box = self._waiting[answer]
        deadline = time.monotonic() + seconds
        try:
            while True:
                with contextlib.suppress(queue.Empty):
                    return box.get(timeout=0.1)
                if self.gone is not None:
                    raise HostGone(self.gone)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name} did not answer within {seconds:g} s")
        finally:
            self._waiting.pop(answer, None)

    def follow(self, launch: str, sink: Callable[[HostReport, float], None] | None) -> None:
        """Hand launch `launch`'s reports to `sink(report, offset)` (None: no longer)."""
        if sink is None:
            self._sinks.pop(launch, None)
        else:
            self._sinks[launch] = sink

    def lose(self, why: str) -> None:
        """Mark the agent gone (the first reason stays) and close its connection."""
        if self.gone is None:
            self.gone = why
            print(f"[ROCm Parallel] {self.name} is gone: {why}", file=sys.stderr, flush=True)
            with contextlib.suppress(OSError):
                self.conn.close()
            self._on_gone(self)

    def _read(self) -> None:
        try:
            while self.gone is None:
                if not self.conn.poll(0.5):
                    continue
                record = recv_any(self.conn)
                now = time.monotonic()
                self.heard = now
                self._take(record, now)
        except (EOFError, OSError):
            self.lose("its connection closed (the agent exited or was killed, or its host went down)")
        except Exception as exc:  # a record this side cannot read: the two sides disagree
            self.lose(f"it sent what this host cannot read ({type(exc).__name__}: {exc})")

    def _take(self, record: Any, now: float) -> None:
        if isinstance(record, HostReport):
            offset = now - record.now
            self.offset = offset if self.offset is None else min(self.offset, offset)
            sink = self._sinks.get(record.launch)
            if sink is not None:
                sink(record, self.offset)
        elif isinstance(record, FilesChecked):
            self._answer(("files", record.request), record)
        elif isinstance(record, Spawned | Stopped):
            self._answer((type(record).__name__, record.launch), record)

    def _answer(self, key: tuple[str, Any], record: Any) -> None:
        box = self._waiting.get(key)
        if box is not None:
            box.put(record)


class Hub:
    """The listener on the configured address, the agents connected to it, and the ranks it hands over."""

    def __init__(self, address: tuple[str, int], key: bytes) -> None:
        self.address, self._key = address, key
        try:
            self._server = socket.create_server(address, backlog=64)
        except OSError as exc:
            raise ConfigError(
                f"{LISTEN_ENV}={address[0]}:{address[1]}: cannot listen there ({exc.strerror or exc}); name an "
                f"address of this host and a free port ({DOCS})"
            ) from None
        self.address = self._server.getsockname()[:2]  # port 0: the one the OS chose
        self.agents: list[AgentLink] = []
        self._lock = threading.Lock()
        self._expected: dict[str, queue.Queue[tuple[Connection, Hello]]] = {}
        self._closed = False
        threading.Thread(target=self._accept, name="rp-hub", daemon=True).start()
        threading.Thread(target=self._ping, name="rp-hub-ping", daemon=True).start()

    # ---------------------------------------------------------------- for group starts

    def agent(self, host: str, seconds: float, check: Callable[[], None] | None = None) -> AgentLink:
        """The agent connected for `host` (its address or name), waiting up to `seconds` for it to join."""
        deadline = time.monotonic() + seconds
        while True:
            found = self.find(host)
            if found is not None:
                return found
            if check is not None:
                check()
            if time.monotonic() > deadline:
                raise TimeoutError(host)
            time.sleep(0.1)

    def find(self, host: str) -> AgentLink | None:
        with self._lock:
            live = [a for a in self.agents if a.gone is None]
        return next((a for a in live if a.hello.address == host), None) or next(
            (a for a in live if host in a.hello.names), None
        )

    def expect(self, launch: str) -> queue.Queue[tuple[Connection, Hello]]:
        """Where the ranks of launch `launch` that connect here are put (authenticated, their Hello read)."""
        box: queue.Queue[tuple[Connection, Hello]] = queue.Queue()
        self._expected[launch] = box
        return box

    def forget(self, launch: str) -> None:
        self._expected.pop(launch, None)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._server.close()
        for agent in list(self.agents):
            agent.lose("the hub closed")

    # ---------------------------------------------------------------- threads

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._admit, args=(sock,), name="rp-hub-admit", daemon=True).start()

    def _admit(self, sock: socket.socket) -> None:
        """Authenticate a connection, read its first record: an agent joins, a rank goes to its launch."""
        try:
            conn = accept_authenticated(sock, self._key)
        except Exception:  # a wrong key, a silent or broken peer: dropped, never read
            with contextlib.suppress(OSError):
                sock.close()
            return
        try:
            first = recv_any(conn) if conn.poll(10.0) else None
        except Exception:
            first = None
        if isinstance(first, Hello) and first.launch in self._expected:
            self._expected[first.launch].put((conn, first))
        elif isinstance(first, AgentHello):
            self._join(conn, first)
        else:
            conn.close()

    def _join(self, conn: Connection, hello: AgentHello) -> None:
        why, final = self._refusal(hello)
        with contextlib.suppress(OSError):
            send_record(conn, AgentWelcome(ok=not why, why=why, final=final))
        if why:
            conn.close()
            return
        link = AgentLink(conn, hello, self._drop)
        with self._lock:
            self.agents.append(link)
        print(
            f"[ROCm Parallel] {link.name} joined, offering {', '.join(hello.devices)}",
            file=sys.stderr,
            flush=True,
        )

    def _refusal(self, hello: AgentHello) -> tuple[str, bool]:
        """Why an agent cannot join ('' when it can), and whether that is final (it then exits)."""
        import torch

        if hello.torch != torch.__version__:
            return (
                f"host {hello.address} runs torch {hello.torch} and this host {torch.__version__}; a group "
                "across hosts needs the same torch on every host",
                True,
            )
        if hello.code != code_fingerprint():
            return (
                f"the pack's code on host {hello.address} differs from this host's (fingerprint "
                f"{hello.code[:12]} there, {code_fingerprint()[:12]} here); install the same version on every host",
                True,
            )
        other = self.find(hello.address)
        if other is not None:
            return f"an agent for {hello.address} is connected already (pid {other.hello.pid})", False
        return "", False

    def _drop(self, link: AgentLink) -> None:
        with self._lock:
            if link in self.agents:
                self.agents.remove(link)

    def _ping(self) -> None:
        while not self._closed:
            time.sleep(PING)
            now = time.monotonic()
            for agent in list(self.agents):
                if now - agent.heard > SILENCE:
                    agent.lose(
                        f"it has not been heard from for {SILENCE:g} s (the host froze or the network failed)"
                    )
                    continue
                with contextlib.suppress(HostGone):
                    agent.send(Ping(now=now))


_hub: Hub | None = None
_hub_listen: tuple[str, int] | None = None  # the address the hub was started on (its port may be 0)
_hub_lock = threading.Lock()


def hub() -> Hub:
    """This process's hub, started on first use on the configured address (ConfigError when none is); a
    changed address starts a new one."""
    global _hub, _hub_listen
    config = settings()
    with _hub_lock:
        if _hub is not None and config.listen == _hub_listen:
            return _hub
        if config.listen is None:
            raise ConfigError(
                f"the devices name another host, but this process listens for no agents: set {LISTEN_ENV}="
                f"ADDRESS:PORT (this host's address on the network the other hosts reach it by) before starting "
                f"it ({DOCS})"
            )
        if config.key_file is None:
            raise ConfigError(
                f"the devices name another host, but no key file is set for the group: set {KEY_FILE_ENV} ({DOCS})"
            )
        key = read_key(config.key_file, create=True)
        if _hub is not None:
            _hub.close()
        _hub, _hub_listen = Hub(config.listen, key), config.listen
        print(
            f"[ROCm Parallel] listening for other hosts' agents on {_hub.address[0]}:{_hub.address[1]} (the "
            f"group's key: {config.key_file}, copy it to each host that joins)",
            file=sys.stderr,
            flush=True,
        )
        return _hub
