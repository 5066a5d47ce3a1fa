"""The authenticated TCP connection between hosts: the agents' and the remote ranks' link to the first host.

Both ends prove they hold the group's key (multiprocessing's HMAC challenge, each way, as its Listener and
Client do over a Unix socket) before either reads anything else; a peer that stays silent through the
challenge is dropped after a few seconds. The connection is a `multiprocessing.connection.Connection`, so
`transport.send` / `recv` (plain data, nothing unpickled that names a class) run over it unchanged. Traffic
is authenticated, not encrypted: docs/hosts.md says to keep it on a network of the group's own (or a VPN).
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Callable
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

AUTH_SECONDS = 5.0  # a peer has this long to answer the challenge


def _receive_timeout(sock: socket.socket, seconds: float) -> None:
    # Connection reads the fd with os.read: a Python-level socket timeout would not apply, SO_RCVTIMEO does
    whole = int(seconds)
    sock.setsockopt(
        socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", whole, int((seconds - whole) * 1e6))
    )


def _keepalive(sock: socket.socket) -> None:
    """TCP keepalive after 5 s of silence, 3 probes 2 s apart: a host that vanishes (power, cable) ends the
    connection within about 11 s even when nothing is being sent."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a step's small records go out at once


def accept_authenticated(sock: socket.socket, key: bytes) -> Connection:
    """The server's end of a connection `accept` returned: challenge the peer, answer its challenge."""
    return _authenticated(sock, key, (deliver_challenge, answer_challenge))


def connect(
    address: tuple[str, int], key: bytes, source: str | None = None, seconds: float = 10.0
) -> Connection:
    """Connect to `address` (from `source`, this host's address the peer knows it by), answer its challenge
    and challenge it. OSError when nothing listens there; AuthenticationError when the keys differ."""
    sock = socket.create_connection(address, timeout=seconds, source_address=(source, 0) if source else None)
    sock.settimeout(None)
    return _authenticated(sock, key, (answer_challenge, deliver_challenge))


def _authenticated(
    sock: socket.socket, key: bytes, steps: tuple[Callable[[Connection, bytes], None], ...]
) -> Connection:
    """`sock` as a Connection once both HMAC challenges passed, in `steps`' order (the server challenges
    first); closed on any failure, and bounded by AUTH_SECONDS while nothing is authenticated yet."""
    _keepalive(sock)
    _receive_timeout(sock, AUTH_SECONDS)
    conn = Connection(sock.detach())
    try:
        for step in steps:
            step(conn, key)
        _clear_timeout(conn)
    except BaseException:
        conn.close()
        raise
    return conn


def _clear_timeout(conn: Connection) -> None:
    # a second socket object over a dup of the fd: the option is the socket's, shared by both
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        _receive_timeout(sock, 0.0)
