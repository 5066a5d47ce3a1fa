"""Where this host listens for the other hosts' agents, the group's key, and the model folders they mirror.

Torch-free and cheap: the nodes configure it (ComfyUI's user folder for the key, its model folders for the
names), the agent (agent.py) and the coordinator's hub (hub.py) read it. Nothing listens until a group names
a device of another host (docs/hosts.md).

- The address: `ROCM_PARALLEL_LISTEN=ADDRESS:PORT`, the address of this host on the network the other hosts
  reach it by. Never a wildcard (0.0.0.0, ::): the hub binds only the address the user names.
- The key: 32 random bytes, hex, in a file only its owner may read (`ROCM_PARALLEL_KEY_FILE`; in ComfyUI
  `<user folder>/rocm_parallel/hosts.key`, created on first use). Copied once to each host that joins, which
  passes it with `--key-file`: every connection is authenticated with it (HMAC challenge, both ways) before
  anything it sends is read; it never travels itself.
- The model folders: each host reads its ranks' shards from its own copy of a file, found under its own
  models folder by the same name (`relative_name`).
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ..config import ConfigError

LISTEN_ENV = "ROCM_PARALLEL_LISTEN"
KEY_FILE_ENV = "ROCM_PARALLEL_KEY_FILE"
DEFAULT_PORT = 8190
DOCS = "docs/hosts.md"


@dataclass(frozen=True)
class HostSettings:
    """`listen`: (address, port) the hub binds, or None; `key_file`: the group's key; `folders`: this host's
    model folders as (folder, the name its files have on every host), longest first."""

    listen: tuple[str, int] | None = None
    key_file: Path | None = None
    folders: tuple[tuple[str, str], ...] = field(default_factory=tuple)


_configured = HostSettings()


def configure(
    listen: str | None = None, key_file: str | Path | None = None, folders: dict[str, str] | None = None
) -> None:
    """Set this process's defaults (the environment still wins): the nodes call it with ComfyUI's user
    folder and model folders (`folders`: folder -> its name on every host, e.g. '.../models' -> '')."""
    global _configured
    _configured = HostSettings(
        listen=parse_address(listen, "listen") if listen else _configured.listen,
        key_file=Path(key_file) if key_file else _configured.key_file,
        folders=_longest_first(folders) if folders is not None else _configured.folders,
    )


def settings() -> HostSettings:
    """The settings now: the environment's `ROCM_PARALLEL_LISTEN` / `ROCM_PARALLEL_KEY_FILE` over `configure`'s."""
    listen = os.environ.get(LISTEN_ENV, "").strip()
    key_file = os.environ.get(KEY_FILE_ENV, "").strip()
    return HostSettings(
        listen=parse_address(listen, LISTEN_ENV) if listen else _configured.listen,
        key_file=Path(key_file) if key_file else _configured.key_file,
        folders=_configured.folders,
    )


def _longest_first(folders: dict[str, str]) -> tuple[tuple[str, str], ...]:
    pairs = {os.path.normpath(os.path.abspath(folder)): name.strip("/") for folder, name in folders.items()}
    return tuple(sorted(pairs.items(), key=lambda item: -len(item[0])))


def parse_address(text: str, what: str, default_port: int | None = DEFAULT_PORT) -> tuple[str, int]:
    """'192.168.1.10:8190', '[fe80::1]:8190' or a name ('host1:8190'; without a port: `default_port`) ->
    (address, port). A wildcard address is refused: it would listen on every network of the host."""
    text = text.strip()
    host, port = text, str(default_port) if default_port else ""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":") or port
    elif text.count(":") == 1:
        host, port = text.split(":")
    if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ConfigError(
            f"{what}={text!r} is not ADDRESS:PORT; use e.g. '192.168.1.10:{DEFAULT_PORT}' (this host's address "
            f"on the network the other hosts reach it by; {DOCS})"
        )
    if _wildcard(host):
        raise ConfigError(
            f"{what}={text!r} would listen on every network of this host; name the one address the other hosts "
            f"reach it by, e.g. '192.168.1.10:{port}' ({DOCS})"
        )
    return host, int(port)


def _wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


# --------------------------------------------------------------------------------------------------
# The key


def read_key(path: Path | str, create: bool = False) -> bytes:
    """The group's key from `path` (64 hex digits); `create`: write a new one there when there is none.
    A key file others may read is refused: whoever holds the key can run the group's workers."""
    path = Path(path).expanduser()
    if create and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(
            f"the group's key file {path} cannot be read ({exc.strerror or exc}); copy it from the first host "
            f"(where ComfyUI created it) or give its path with --key-file ({DOCS})"
        ) from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"the group's key file {path} may be read by other users (mode {stat.S_IMODE(mode):o}); whoever "
            f"holds the key can run the group's workers: chmod 600 {path}"
        )
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) < 16:
        raise ConfigError(
            f"the group's key file {path} does not hold a key (64 hex digits); copy it again from the first host"
        )
    return key


@functools.cache
def code_fingerprint() -> str:
    """A hash of the pack's backend sources: every host of a group must run the same (the records on the wire,
    the sharding, the sampling). Hosts of one checkout, or of one release, agree."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------------
# Names and interfaces


def relative_name(path: str, folders: tuple[tuple[str, str], ...]) -> str | None:
    """The name a file has on every host: its path under the first of `folders` that holds it, prefixed with
    that folder's name ('diffusion_models/flux.safetensors'); None when no folder holds it."""
    full = os.path.normpath(path)
    for folder, name in folders:
        if full == folder or full.startswith(folder + os.sep):
            inner = os.path.relpath(full, folder)
            return inner if not name else os.path.join(name, inner)
    return None


def interface_of(address: str) -> str | None:
    """The network interface holding `address` ('lo' for 127.0.0.2, 'eth0' for this host's LAN address), for
    GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME: gloo and NCCL otherwise pick the interface the hostname
    resolves to. None when no interface holds it."""
    import psutil

    try:
        wanted = ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        return None
    for name, addresses in psutil.net_if_addrs().items():
        for entry in addresses:
            try:
                if ipaddress.ip_address(entry.address.split("%")[0]) == wanted:
                    return name
            except ValueError:
                continue
        # loopback: 127.0.0.2 is lo's though lo lists 127.0.0.1 only (the whole 127/8 is routed there)
        if wanted.is_loopback and any(
            e.address == ("127.0.0.1" if wanted.version == 4 else "::1") for e in addresses
        ):
            return name
    return None
