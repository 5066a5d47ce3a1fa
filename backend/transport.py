"""The worker protocol: typed records over an authenticated socket, big tensors through tmpfs files.

Records (`Request`, `Progress`, `Reply` and the start-up `Hello` / `StorePort` / `Ready`) are frozen
dataclasses, sent as a kind tag plus plain data and rebuilt on arrival: the client (inside ComfyUI the
pack's modules have other names) and the workers never need to share class identities. Every job
record carries the job id, so a reply from another job is never taken for this one's.

Tensors above a few KiB are written as raw bytes into files in a private directory on tmpfs
(/dev/shm: shared memory, no disk I/O) and replaced in the message by a small reference naming the
file, the dtype (from a fixed list) and the shape. A file holds only the tensor's bytes, so reading it
never runs code. (Raw bytes rather than safetensors: a sampler step sends a latent and gets one back,
and the header and the extra copy cost about a millisecond per tensor on each side.)
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import pickle
import shutil
import tempfile
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch

INLINE_LIMIT = 64 * 1024  # bytes; smaller tensors are cheaper to pickle than to put in a file
PREFIX = "rocm-parallel-"
_REF = "__rocm_parallel_tensor__"
# The dtypes a tensor file may hold, by name (a reference names one of these; nothing else is accepted).
_DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}  # fmt: skip
_counter = itertools.count()


# --------------------------------------------------------------------------------------------------
# Records


@dataclass(frozen=True)
class Hello:
    """A worker's first message after the authenticated connect."""

    rank: int
    pid: int


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
    """Run `method(**kwargs)` on a rank. `method == "shutdown"` leaves the group. `reuse_files`: tensor
    files in the request and the reply keep fixed names and are rewritten in place (see `pack`)."""

    job: int
    method: str
    kwargs: dict[str, Any] = field(default_factory=dict)
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
    """The end of a job on one rank: its result, or its error with the worker's traceback."""

    job: int
    rank: int
    ok: bool
    result: Any = None
    error: str = ""
    error_type: str = ""
    traceback: str = ""
    seconds: float = 0.0


RECORDS = {cls.__name__: cls for cls in (Hello, StorePort, Ready, Request, Progress, Reply)}
Record = Hello | StorePort | Ready | Request | Progress | Reply


def send(conn: Connection, record: Record) -> None:
    """Plain pickle of plain data (a kind and a dict): never torch.multiprocessing's fd-passing reductions."""
    data = {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
    conn.send_bytes(pickle.dumps((type(record).__name__, data), protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn: Connection) -> Record:
    """The next record; only ever called on connections authenticated by the HMAC challenge."""
    kind, data = pickle.loads(conn.recv_bytes())
    return RECORDS[kind](**data)


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
# Tensors through files


def pack(obj: Any, directory: str, tag: str, *, reuse: bool = False) -> Any:
    """Replace large CPU-copyable tensors in a nested structure by references to files in `directory`.

    `reuse`: the files are named `tag` plus the tensor's position in `obj` and rewritten in place on the
    next call with the same tag (the forward service sends a latent of the same size every step, and
    rewriting tmpfs pages costs a quarter of creating and removing a file). The reader then must not
    remove them; they go with the directory.
    """
    return _pack(obj, directory, tag, reuse, itertools.count())


def _pack(obj: Any, directory: str, tag: str, reuse: bool, position: itertools.count) -> Any:
    if isinstance(obj, torch.Tensor) and obj.numel() * obj.element_size() > INLINE_LIMIT:
        tensor = obj.detach().to("cpu").contiguous()
        name = str(tensor.dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise TypeError(f"cannot send a {tensor.dtype} tensor to or from a worker")
        if reuse:
            path = os.path.join(directory, f"{tag}-{next(position)}.bin")
            _rewrite(path, _bytes(tensor).numpy())
        else:
            path = os.path.join(directory, f"{tag}-{os.getpid()}-{next(_counter)}.bin")
            with open(path, "wb") as f:
                f.write(_bytes(tensor).numpy().data)
        return {_REF: path, "dtype": name, "shape": list(tensor.shape)}
    if isinstance(obj, dict):
        return {k: _pack(v, directory, tag, reuse, position) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_pack(v, directory, tag, reuse, position) for v in obj)
    return obj


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


def _read_tensor(ref: dict[str, Any]) -> torch.Tensor:
    dtype = _DTYPES[ref["dtype"]]
    out = torch.empty([int(n) for n in ref["shape"]], dtype=dtype)
    view = _bytes(out).numpy()
    with open(ref[_REF], "rb", buffering=0) as f:
        got = f.readinto(view.data)
    if got != view.nbytes:
        raise OSError(f"tensor file {ref[_REF]} holds {got} bytes; expected {view.nbytes}")
    return out


def unpack(obj: Any, remove: bool = True) -> Any:
    """Inverse of `pack`; deletes each file once read unless `remove` is False."""
    if isinstance(obj, dict):
        if _REF in obj:
            tensor = _read_tensor(obj)
            if remove:
                os.unlink(obj[_REF])
            return tensor
        return {k: unpack(v, remove) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(unpack(v, remove) for v in obj)
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
