"""The worker protocol: typed records over an authenticated socket, big tensors through tmpfs files.

Two kinds of record, both frozen dataclasses:

- envelopes (`Request`, `Progress`, `Reply` and the start-up `Hello` / `StorePort` / `Ready`): how a job
  travels. Every job envelope carries the job id, so a reply from another job is never taken for this one's.
- payloads (runtime/messages.py and each model's messages.py, and the tests' own in their worker
  modules): what a job carries. A `Request` holds one payload record or none, a `Reply` one or none. A payload class is registered with
  `@record`; on arrival only registered classes are rebuilt, by name, and a name this process does not
  know is refused (`UnknownRecord`). The client (inside ComfyUI the pack's modules have other names) and
  the workers never need to share class identities, only names.

On the wire everything is plain data: `pack` turns records into tagged dicts and tensors into raw bytes,
and `recv` unpickles with an unpickler that refuses every class, so no bytes from a peer can name code to
run (and the peer is authenticated by the HMAC challenge before anything is read at all).

Tensors above a few KiB are written as raw bytes into files in a private directory on tmpfs
(/dev/shm: shared memory, no disk I/O) and replaced in the message by a small reference naming the
file, the dtype (from a fixed list) and the shape; smaller ones travel inline as bytes. A file holds
only the tensor's bytes, so reading it never runs code. (Raw bytes rather than safetensors: a sampler
step sends a latent and gets one back, and the header and the extra copy cost about a millisecond per
tensor on each side.)
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import os
import pickle
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import torch

from ..config import package_named
from ..dtypes import DTYPES

INLINE_LIMIT = 64 * 1024  # bytes; smaller tensors travel inside the message
PREFIX = "rocm-parallel-"
_REF = "__rocm_parallel_tensor__"  # a tensor in a file: {_REF: path, "dtype": name, "shape": [...]}
_BYTES = "__rocm_parallel_bytes__"  # a small tensor inline: {_BYTES: raw bytes, "dtype": ..., "shape": ...}
_RECORD = "__rocm_parallel_record__"  # a payload record: {_RECORD: class name, "fields": {...}}
# The dtypes a tensor may cross the wire in, by name (the one table, backend/dtypes.py); a reference naming
# anything else is refused.
_DTYPES = {d.name: d.torch for d in DTYPES}
_counter = itertools.count()
R = TypeVar("R")


# --------------------------------------------------------------------------------------------------
# Envelopes


@dataclass(frozen=True)
class Hello:
    """A worker's first message after the authenticated connect (`launch`: which group start it belongs to,
    for a rank on another host, whose connection arrives at the hub: hub.py)."""

    rank: int
    pid: int
    launch: str = ""


@dataclass(frozen=True)
class StorePort:
    """Rank 0's TCPStore port, relayed by the client to the other ranks."""

    port: int


@dataclass(frozen=True)
class Ready:
    """A worker joined the process group and serves requests."""

    rank: int
    device: str
    pid: int


@dataclass(frozen=True)
class Request:
    """Run `method(payload)` on a rank (`payload`: one packed record, or None). `method == "shutdown"`
    leaves the group. `reuse_files`: tensor files in the request and the reply keep fixed names and are
    rewritten in place (see `pack`)."""

    job: int
    method: str
    payload: Any = None
    reuse_files: bool = False


@dataclass(frozen=True)
class Progress:
    """Rank `rank` finished `step` of `total` of job `job` (`phase`: 'load' or 'step')."""

    job: int
    rank: int
    step: int
    total: int
    phase: str = "step"


@dataclass(frozen=True)
class Reply:
    """The end of a job on one rank: its result (one packed record, or None), or its error with the
    worker's traceback."""

    job: int
    rank: int
    ok: bool
    result: Any = None
    error: str = ""
    error_type: str = ""
    traceback: str = ""
    seconds: float = 0.0


ENVELOPES = {cls.__name__: cls for cls in (Hello, StorePort, Ready, Request, Progress, Reply)}
Envelope = Hello | StorePort | Ready | Request | Progress | Reply


@package_named
class ProtocolError(RuntimeError):
    """A message that is not what the protocol allows (a class named in a pickle, an unknown envelope)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        package_named(cls)  # UnknownRecord: named by the package in ComfyUI's error dialog too


class _PlainUnpickler(pickle.Unpickler):
    """Plain data only (dicts, lists, tuples, strings, bytes, numbers, None): every class is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise ProtocolError(f"a worker message names {module}.{name}; only plain data is accepted")


@contextmanager
def uninterrupted() -> Iterator[None]:
    """Hold Ctrl+C (SIGINT) until the block ends, then raise it as usual.

    A message half written or half read leaves the byte stream out of step for every later message, and
    a request that reached some ranks and not others leaves the first waiting in a collective for the
    rest: sends and receives must happen whole. Python runs signal handlers in the main thread only, so
    elsewhere (ComfyUI's execution thread) there is nothing to hold.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[tuple[int, object]] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            if callable(previous):
                previous(*held[0])  # Python's default handler raises KeyboardInterrupt here
            elif previous == signal.SIG_DFL:
                signal.raise_signal(signal.SIGINT)


def send(conn: Connection, envelope: Envelope) -> None:
    """An envelope as (kind, fields) of plain data; its payload is packed already (see `pack`)."""
    data = {f.name: getattr(envelope, f.name) for f in dataclasses.fields(envelope)}
    conn.send_bytes(pickle.dumps((type(envelope).__name__, data), protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn: Connection) -> Envelope:
    """The next envelope; only ever called on connections authenticated by the HMAC challenge."""
    return _envelope(_PlainUnpickler(io.BytesIO(conn.recv_bytes())).load())


def _envelope(plain: Any) -> Envelope:
    kind, data = plain
    if kind not in ENVELOPES:
        raise ProtocolError(f"a worker sent a {kind!r} envelope; known: {', '.join(ENVELOPES)}")
    return ENVELOPES[kind](**data)


def send_record(conn: Connection, obj: Any) -> None:
    """One payload record on its own (the hub and the agents speak in records, hub.py): packed inline."""
    conn.send_bytes(pickle.dumps(pack(obj, "", "", inline=True), protocol=pickle.HIGHEST_PROTOCOL))


def recv_any(conn: Connection) -> Any:
    """The next envelope or record (`send` / `send_record`) on an authenticated connection."""
    plain = _PlainUnpickler(io.BytesIO(conn.recv_bytes())).load()
    if isinstance(plain, tuple):
        return _envelope(plain)
    found = unpack(plain)
    if not is_record(found):
        raise ProtocolError(f"a peer sent a {type(found).__name__}; expected a record")
    return found


# --------------------------------------------------------------------------------------------------
# Payload records

_RECORDS: dict[str, type] = {}


class UnknownRecord(ProtocolError):
    """A message names a payload record this process has not registered: it is refused, not guessed."""


def record(cls: type[R]) -> type[R]:
    """Class decorator (over `@dataclass(frozen=True)`): register `cls` as a payload record.

    The registry is keyed by the class name, so names must be unique among the records a process
    imports (a second class of the same name is refused at import time)."""
    register(cls)
    return cls


def register(*classes: type) -> None:
    """Register frozen dataclasses defined elsewhere (ParallelLayout, CheckpointInfo) as payload records."""
    for cls in classes:
        if not (dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen):
            raise TypeError(f"{cls.__qualname__} must be a frozen dataclass to travel to the workers")
        held = _RECORDS.get(cls.__name__)
        # The same class imported again (a module reloaded) replaces itself; another class may not.
        if held is not None and (held.__module__, held.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(
                f"two payload records are named {cls.__name__}: {held.__module__}.{held.__qualname__} "
                f"and {cls.__module__}.{cls.__qualname__}; rename one"
            )
        _RECORDS[cls.__name__] = cls


def is_record(obj: Any) -> bool:
    """`obj` is an instance of a registered payload record."""
    return _RECORDS.get(type(obj).__name__) is type(obj)


def _record_class(name: str) -> type:
    cls = _RECORDS.get(name)
    if cls is None:
        raise UnknownRecord(
            f"a worker message carries a {name!r} record, which this process does not know; import the "
            "module that defines it (e.g. the test module named in WorkerGroup(methods=...))"
        )
    return cls


# --------------------------------------------------------------------------------------------------
# Private directories


def private_dir(kind: str, owner: int | None = None, tmpfs: bool = False) -> str:
    """A 0700 directory named after its owner's pid (so stale ones can be found once the owner is gone).

    `tmpfs` puts it on /dev/shm (shared memory) when there is one, for tensor files.
    """
    base = None
    if tmpfs and os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        base = "/dev/shm"
    return tempfile.mkdtemp(prefix=f"{PREFIX}{kind}-{owner or os.getpid()}-", dir=base)


def _owner_pid(name: str) -> int | None:
    parts = name.removeprefix(PREFIX).split("-")
    return int(parts[1]) if len(parts) >= 3 and parts[1].isdigit() else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_dirs() -> list[str]:
    """Remove this user's private directories whose owner process is gone (killed parents leave them).

    Only directories named by `private_dir` with a dead owner pid and owned by this user are touched.
    """
    removed = []
    bases = {tempfile.gettempdir()} | ({"/dev/shm"} if os.path.isdir("/dev/shm") else set())
    for base in bases:
        try:
            entries = list(os.scandir(base))
        except OSError:
            continue
        for entry in entries:
            pid = _owner_pid(entry.name) if entry.name.startswith(PREFIX) else None
            if pid is None or _pid_alive(pid):
                continue
            try:
                if entry.is_dir(follow_symlinks=False) and entry.stat().st_uid == os.getuid():
                    shutil.rmtree(entry.path, ignore_errors=True)
                    removed.append(entry.path)
            except OSError:
                continue
    return removed


# --------------------------------------------------------------------------------------------------
# Payloads as plain data, tensors through files


def pack(obj: Any, directory: str, tag: str, *, reuse: bool = False, inline: bool = False) -> Any:
    """`obj` (a payload record, or plain data holding records and tensors) as plain data for `send`.

    Records become tagged dicts, tensors above INLINE_LIMIT files in `directory`, smaller ones inline
    bytes; anything else but plain data (numbers, strings, bytes, None, lists, tuples, dicts) is refused.
    `reuse`: the files are named `tag` plus the tensor's position in `obj` and rewritten in place on the
    next call with the same tag (the forward service sends a latent of the same size every step, and
    rewriting tmpfs pages costs a quarter of creating and removing a file). The reader then must not
    remove them; they go with the directory. `inline`: every tensor inside the message (a peer on another
    host shares no tmpfs with this one).
    """
    limit = float("inf") if inline else INLINE_LIMIT
    return _pack(obj, directory, tag, reuse, itertools.count(), limit)


_PLAIN = (bool, int, float, str, bytes, type(None))  # bool first: it is an int too


def _pack(obj: Any, directory: str, tag: str, reuse: bool, position: itertools.count, limit: float) -> Any:
    if type(obj) in _PLAIN:
        return obj
    if isinstance(obj, _PLAIN):  # numpy's float64, an IntEnum...: their pickles name a class
        return next(base(obj) for base in _PLAIN if isinstance(obj, base))
    if isinstance(obj, torch.Tensor):
        return _pack_tensor(obj, directory, tag, reuse, position, limit)
    if isinstance(obj, dict):
        bad = [k for k in obj if not isinstance(k, str | int)]
        if bad:
            raise TypeError(f"cannot send a dict keyed by {type(bad[0]).__name__} to or from a worker")
        return {k: _pack(v, directory, tag, reuse, position, limit) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_pack(v, directory, tag, reuse, position, limit) for v in obj]
    if isinstance(obj, tuple):  # torch.Size and named tuples too, as plain tuples
        return tuple(_pack(v, directory, tag, reuse, position, limit) for v in obj)
    if is_record(obj):
        fields = {
            f.name: _pack(getattr(obj, f.name), directory, tag, reuse, position, limit)
            for f in dataclasses.fields(obj)
            if f.init
        }
        return {_RECORD: type(obj).__name__, "fields": fields}
    raise TypeError(
        f"cannot send a {type(obj).__qualname__} to or from a worker: payloads are registered records "
        "(transport.record) of plain data and tensors"
    )


def _pack_tensor(
    obj: torch.Tensor, directory: str, tag: str, reuse: bool, position: itertools.count, limit: float
) -> Any:
    if obj.is_meta:
        raise TypeError("cannot send a tensor on the meta device to or from a worker: it holds no values")
    tensor = obj.detach().to("cpu").contiguous()
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise TypeError(f"cannot send a {tensor.dtype} tensor to or from a worker")
    shape = list(tensor.shape)
    if tensor.numel() * tensor.element_size() <= limit:
        return {_BYTES: _bytes(tensor).numpy().tobytes(), "dtype": name, "shape": shape}
    if reuse:
        path = os.path.join(directory, f"{tag}-{next(position)}.bin")
        _rewrite(path, _bytes(tensor).numpy())
    else:
        path = os.path.join(directory, f"{tag}-{os.getpid()}-{next(_counter)}.bin")
        with open(path, "wb") as f:
            f.write(_bytes(tensor).numpy().data)
    return {_REF: path, "dtype": name, "shape": shape}


def _rewrite(path: str, data: Any) -> None:
    """Overwrite the file at `path` (created 0600 if new) with `data`, in place."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        view, offset = memoryview(data).cast("B"), 0
        while offset < len(view):  # one pwrite moves at most ~2 GiB
            offset += os.pwrite(fd, view[offset:], offset)
        os.ftruncate(fd, len(view))
    finally:
        os.close(fd)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor, as a flat uint8 view of the same memory."""
    return tensor.reshape(-1).view(torch.uint8)


def _empty(ref: dict[str, Any]) -> torch.Tensor:
    if ref["dtype"] not in _DTYPES:
        raise ProtocolError(
            f"a worker message holds a tensor of dtype {ref['dtype']!r}; known: {', '.join(_DTYPES)}"
        )
    return torch.empty([int(n) for n in ref["shape"]], dtype=_DTYPES[ref["dtype"]])


READ_CHUNK = 1 << 30  # bytes per read() of a tensor file


def _read_tensor(ref: dict[str, Any]) -> torch.Tensor:
    out = _empty(ref)
    view, got = memoryview(_bytes(out).numpy()).cast("B"), 0
    with open(ref[_REF], "rb", buffering=0) as f:
        while got < view.nbytes:  # one read moves at most ~2 GiB (a 4 GiB latent arrived half-read)
            n = f.readinto(view[got : got + READ_CHUNK])
            if not n:
                break
            got += n
    if got != view.nbytes:
        raise OSError(f"tensor file {ref[_REF]} holds {got} bytes; expected {view.nbytes}")
    return out


def _inline_tensor(ref: dict[str, Any]) -> torch.Tensor:
    out = _empty(ref)
    view = _bytes(out).numpy()
    if len(ref[_BYTES]) != view.nbytes:
        raise ProtocolError(f"an inline tensor holds {len(ref[_BYTES])} bytes; expected {view.nbytes}")
    view[:] = memoryview(ref[_BYTES])
    return out


def unpack(obj: Any, remove: bool = True) -> Any:
    """Inverse of `pack`: registered records rebuilt by name (UnknownRecord for any other name), tensors
    read back; deletes each tensor file once read unless `remove` is False."""
    if isinstance(obj, dict):
        if _REF in obj:
            tensor = _read_tensor(obj)
            if remove:
                os.unlink(obj[_REF])
            return tensor
        if _BYTES in obj:
            return _inline_tensor(obj)
        if _RECORD in obj:
            cls = _record_class(obj[_RECORD])
            return cls(**{k: unpack(v, remove) for k, v in obj["fields"].items()})
        return {k: unpack(v, remove) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(unpack(v, remove) for v in obj)
    return obj


def inlined(obj: Any) -> Any:
    """A packed structure with every tensor file's bytes inside it (for a peer on another host); the files
    stay where they are."""
    if isinstance(obj, dict):
        if _REF in obj:
            return {
                _BYTES: _bytes(_read_tensor(obj)).numpy().tobytes(),
                "dtype": obj["dtype"],
                "shape": obj["shape"],
            }
        return {k: inlined(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(inlined(v) for v in obj)
    return obj


def files_in(obj: Any) -> list[str]:
    """Paths referenced by a packed structure (to clean up after a call)."""
    if isinstance(obj, dict):
        if _REF in obj:
            return [obj[_REF]]
        return [p for v in obj.values() for p in files_in(v)]
    if isinstance(obj, list | tuple):
        return [p for v in obj for p in files_in(v)]
    return []
