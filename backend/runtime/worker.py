"""Worker process: one per device. Owns the process group and the model; serves calls by method name.

Started by `client.WorkerGroup` (never imported by ComfyUI itself). Life of a worker:

1. read the control-channel key from stdin, then keep stdin open as the *death pipe*: when the parent
   dies, stdin reaches EOF and the worker exits at once (no orphan holding GPU memory);
2. connect to the parent's Unix socket (HMAC-authenticated before anything is unpickled);
3. rendezvous: rank 0 opens a TCPStore on 127.0.0.1 (free port), the parent relays the port;
   Meanwhile a thread of its own reports what the rank is doing (heartbeat.py), from the first line of
   `main` on: the caller tells a hung rank from a slow one by these reports;
4. report Ready, then serve `transport.Request` envelopes until "shutdown": `_run` finds the method
   (`HANDLERS`, filled by `@handler` in the `BUILTIN_METHODS` modules (probe.py; resident/, diffusion/,
   vae/ and encoders/ jobs) and the modules the group names),
   checks the request record's type and calls it; a `Reply` (and `Progress` on the way) carries the
   request's job id back;
5. leave the group cleanly (barrier, destroy_process_group, os._exit) — gloo can abort at interpreter
   exit after correct results otherwise.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Client, Connection
from typing import Any

import psutil
import torch
import torch.distributed as dist

from ..config import DEFAULT_SLOT
from .heartbeat import Heartbeat
from .messages import RankInfo
from .transport import Hello, Progress, Ready, Reply, Request, StorePort, is_record, pack, recv, send, unpack


def synchronize(device: torch.device) -> None:
    """Wait for `device` to finish queued work (for timings and results); CPU and meta need nothing."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Handler:
    """A worker method: `fn(ctx)` or `fn(ctx, request)` with `request` an instance of `request_type`."""

    fn: Callable[..., Any]
    request_type: type | None


HANDLERS: dict[str, Handler] = {}


def handler(name: str, request: type | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a worker method callable by name from the client. `request`: the payload record it takes
    (runtime/messages.py, a model's messages.py, or a test module's own), None when it takes none. It returns
    a payload record or None."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        HANDLERS[name] = Handler(fn, request)
        return fn

    return register


class JobCancelled(RuntimeError):
    """Every rank stopped a job at the same step because the caller cancelled it."""


@dataclass
class Resident:
    """The one owner of a model this rank keeps between jobs, and what it is (`key`: a record such as
    messages.Loaded, or a test's record describing random weights; `family`: the ModelFamily its load
    named, which runs its calls). Set and cleared only through `set`/`clear`, so the record can never
    describe another model than the one held."""

    model: torch.nn.Module | None = None
    key: Any = None
    family: Any = None
    # What jobs keep on the device for this model between calls (the forward service's conditioning);
    # emptied with the model, so nothing computed for one model is used with another.
    caches: dict[str, Any] = field(default_factory=dict)

    def set(self, model: torch.nn.Module, key: Any, family: Any = None) -> None:
        self.model, self.key, self.family = model, key, family
        self.caches.clear()

    def clear(self) -> bool:
        had = self.model is not None
        self.model, self.key, self.family = None, None, None
        self.caches.clear()
        return had

    def require(self) -> torch.nn.Module:
        if self.model is None:
            raise RuntimeError("no model is resident on this worker; load one first")
        return self.model


@dataclass
class WorkerContext:
    """What a handler may use: this rank's identity, device, process group and resident models (one per
    slot: a graph that uses two models keeps both; `resident` is the default slot's)."""

    rank: int
    world_size: int
    device: torch.device
    residents: dict[str, Resident] = field(default_factory=dict)
    conn: Connection | None = None
    shm_dir: str = ""
    job: int = 0
    heartbeat: Heartbeat | None = None  # what this rank reports it is doing (heartbeat.py)

    def model(self, slot: str = DEFAULT_SLOT) -> Resident:
        """The resident model of `slot` (an empty one when nothing was loaded there)."""
        return self.residents.setdefault(slot, Resident())

    @property
    def resident(self) -> Resident:
        return self.model(DEFAULT_SLOT)

    @property
    def backend(self) -> str:
        return dist.get_backend()

    def synchronize(self) -> None:
        """Wait for this rank's device to finish queued work (timings, results)."""
        synchronize(self.device)

    @property
    def cancel_path(self) -> str:
        return os.path.join(self.shm_dir, f"cancel-{self.job}")

    def step_done(self, step: int, total: int) -> None:
        """Call on every rank after each step of a long job: reports progress, honours cancel together.

        Rank 0 alone reads the cancel flag and broadcasts its decision, so all ranks stop after the same
        step; a rank that stopped alone would leave the others waiting in a collective forever.
        """
        flag = torch.zeros(1, dtype=torch.int32, device=self.device if self.device.type != "cpu" else "cpu")
        self._report(step, total, "step")
        if self.heartbeat is not None:
            self.heartbeat.update(min(step + 1, total), total)  # computing the next step from here on
        if self.rank == 0:
            flag[0] = int(self.cancel_requested())
        if self.world_size > 1:
            dist.broadcast(flag, src=0)
        if flag.item():
            raise JobCancelled(f"cancelled after step {step} of {total}")

    def load_progress(self, done: int, total: int) -> None:
        """Call between tensors of a load: reports progress (the caller's watchdog sees a live load) and
        stops at once on cancel. Loading has no collectives, so each rank decides alone."""
        self._report(done, total, "load")
        if self.heartbeat is not None:
            self.heartbeat.update(min(done + 1, total), total, "loading")  # reading the next tensor
        if self.cancel_requested():
            raise JobCancelled(f"load cancelled after {done} of {total} tensors")

    def cancel_requested(self) -> bool:
        return os.path.exists(self.cancel_path)

    def _report(self, step: int, total: int, phase: str) -> None:
        if self.conn is not None:
            send(self.conn, Progress(job=self.job, rank=self.rank, step=step, total=total, phase=phase))


# --------------------------------------------------------------------------------------------------
# Built-in methods


@handler("ping")
def _ping(ctx: WorkerContext) -> RankInfo:
    return RankInfo(rank=ctx.rank, pid=os.getpid(), device=str(ctx.device), backend=ctx.backend)


# The modules whose methods every worker serves, by name relative to this package: the runtime's own probes,
# and the models' jobs. Imported in the worker process only: the runtime's code imports no model code
# (tests/test_structure.py); the model side imports the runtime.
BUILTIN_METHODS = (
    ".probe",
    "..resident.jobs",
    "..diffusion.jobs",
    "..diffusion.serve",
    "..vae.jobs",
    "..encoders.jobs",
)


def _load_methods() -> None:
    """Import the modules that register handlers with @handler, so a worker knows every method.

    The built-in ones first, then the modules the group was started with (`WorkerGroup(methods=...)`,
    e.g. tests' and benchmarks' own methods): product code carries no method that only they use.
    """
    for module in BUILTIN_METHODS:
        importlib.import_module(module, __package__)
    for module in filter(None, os.environ.get("RP_METHODS", "").split(",")):
        importlib.import_module(module)


# --------------------------------------------------------------------------------------------------
# Process lifecycle


def _watch_parent() -> None:
    """Exit when the parent goes away (stdin closes), even while a job is running."""

    def watch() -> None:
        try:
            while sys.stdin.buffer.read(1 << 16):
                pass
        finally:
            os._exit(3)

    threading.Thread(target=watch, name="death-pipe", daemon=True).start()


def _configure_threads() -> None:
    threads = int(os.environ.get("RP_THREADS", "0"))
    if threads > 0:
        torch.set_num_threads(threads)
        torch.set_num_interop_threads(threads)


def _join_group(conn: Connection, rank: int, world_size: int, device: torch.device) -> None:
    timeout = timedelta(seconds=float(os.environ.get("RP_COLLECTIVE_TIMEOUT", "600")))
    # The rendezvous on loopback, or (a group across hosts) on the first host's address (RP_STORE_HOST)
    host = os.environ.get("RP_STORE_HOST", "127.0.0.1")
    if rank == 0:
        # Bind the store's socket ourselves: TCPStore given a host still listens on every interface.
        listener = socket.create_server((host, 0), backlog=128)
        store = dist.TCPStore(
            host,
            listener.getsockname()[1],
            world_size,
            is_master=True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=listener.fileno(),
        )
        send(conn, StorePort(port=store.port))
    else:
        reply = recv(conn)
        assert isinstance(reply, StorePort), reply
        port = reply.port
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    # gloo for CPU workers; NCCL/RCCL for GPUs unless the group chose gloo (WorkerGroup(backend=...)).
    backend = os.environ.get("RP_BACKEND") or ("gloo" if device.type == "cpu" else "nccl")
    if device.type != "cpu":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def _leave_group(clean: bool) -> None:
    if dist.is_initialized():
        try:
            if clean and dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=timedelta(seconds=10))
            elif clean:
                dist.barrier()
            dist.destroy_process_group()
        except Exception:  # a peer is gone: nothing left to synchronise with
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _describe_failure(ctx: WorkerContext, exc: BaseException) -> str:
    if isinstance(exc, torch.OutOfMemoryError):
        where = f"{ctx.device} (rank {ctx.rank} of {ctx.world_size})"
        if ctx.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(ctx.device)
            where += f", {free / 2**30:.1f} of {total / 2**30:.1f} GiB free"
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else "out of memory"
        return (
            f"out of memory on {where}: {first_line}. To fit: use more GPUs, use tensor parallelism "
            "(it splits the weights; context parallelism keeps a full copy per GPU), or lower the resolution"
        )
    if isinstance(exc, MemoryError):  # Python's own allocator: host memory, whatever the device
        return host_memory_message(ctx.rank, ctx.world_size, str(ctx.device), exc)
    return f"{type(exc).__name__}: {exc}"


def host_memory_message(rank: int, world_size: int, device: str, exc: MemoryError) -> str:
    """A MemoryError said nothing ('MemoryError: '): what ran out, how much is left, and the fix."""
    memory = psutil.virtual_memory()
    detail = str(exc).strip() or "an allocation failed"
    return (
        f"out of host memory on rank {rank} of {world_size} ({device}): MemoryError ({detail}); "
        f"{memory.available / 1e9:.1f} of {memory.total / 1e9:.1f} GB of host memory are available now. To fit: "
        "close other programs, use fewer CPU workers, lower the resolution or the batch, or keep the weights in "
        "fp8 (weight_dtype)"
    )


def _run(request: Request, ctx: WorkerContext) -> Any:
    """The handler's result for `request`, packed for the reply. Only a registered record (or None) goes
    in and out: a request that does not match the method's declared type is refused before it runs."""
    entry = HANDLERS.get(request.method)
    if entry is None:
        raise KeyError(f"unknown worker method {request.method!r}; known: {', '.join(sorted(HANDLERS))}")
    payload = unpack(request.payload, remove=False)
    wanted = entry.request_type
    if wanted is None and payload is not None:
        raise TypeError(f"worker method {request.method!r} takes no request; got a {type(payload).__name__}")
    if wanted is not None and not isinstance(payload, wanted):
        raise TypeError(
            f"worker method {request.method!r} takes a {wanted.__name__}; got a {type(payload).__name__}"
        )
    result = entry.fn(ctx) if wanted is None else entry.fn(ctx, payload)
    if result is not None and not is_record(result):
        raise TypeError(
            f"worker method {request.method!r} returned a {type(result).__name__}; a method returns a "
            "registered record (transport.record) or None"
        )
    if os.environ.get("RP_INLINE"):  # a rank on another host: the caller cannot read this host's tmpfs
        return pack(result, ctx.shm_dir, "", inline=True)
    if request.reuse_files:
        return pack(result, ctx.shm_dir, f"result-{ctx.rank}", reuse=True)
    return pack(result, ctx.shm_dir, f"result-{ctx.job}-{ctx.rank}")


def _serve(conn: Connection, ctx: WorkerContext) -> bool:
    """Answer requests until shutdown; True when asked to shut down (vs. the parent closing the socket)."""
    while True:
        try:
            request = recv(conn)
        except EOFError:
            return False
        assert isinstance(request, Request), request
        ctx.job = request.job
        if request.method == "shutdown":
            send(conn, Reply(job=request.job, rank=ctx.rank, ok=True))
            return True
        if ctx.heartbeat is not None:
            ctx.heartbeat.set("computing", job=request.job, method=request.method, publish=True)
        started = time.perf_counter()
        try:
            reply = Reply(job=ctx.job, rank=ctx.rank, ok=True, result=_run(request, ctx))
        except BaseException as exc:  # report every failure to the caller at once; the worker stays up
            reply = Reply(
                job=ctx.job,
                rank=ctx.rank,
                ok=False,
                error=_describe_failure(ctx, exc),
                error_type=type(exc).__name__,
                traceback=traceback.format_exc(),
            )
        if ctx.heartbeat is not None:
            # Written before the reply: the caller judges its peers by the collectives this rank issued.
            ctx.heartbeat.set("idle", job=request.job, publish=True)
        send(conn, dataclasses.replace(reply, seconds=time.perf_counter() - started))


def _connect(address: str, key: bytes) -> Connection:
    """The caller's Unix socket, or (a rank on another host) the first host's hub: 'tcp:ADDRESS:PORT',
    connected from this host's address (RP_SOURCE_ADDRESS) and authenticated with the group's key."""
    if not address.startswith("tcp:"):
        return Client(address, family="AF_UNIX", authkey=key)
    from .tcp import connect

    host, _, port = address.removeprefix("tcp:").rpartition(":")
    return connect((host.strip("[]"), int(port)), key, os.environ.get("RP_SOURCE_ADDRESS") or None)


def main() -> None:
    key = bytes.fromhex(sys.stdin.buffer.readline().decode().strip())
    _watch_parent()
    rank, world_size = int(os.environ["RP_RANK"]), int(os.environ["RP_WORLD_SIZE"])
    heartbeat = Heartbeat(rank, os.environ["RP_STATE_DIR"]).start()
    heartbeat.set("starting", detail="connecting")
    _configure_threads()
    device = torch.device(os.environ["RP_DEVICE"])
    for path in filter(None, os.environ.get("RP_EXTRA_SYS_PATH", "").split(os.pathsep)):
        sys.path.insert(0, path)
    conn = _connect(os.environ["RP_ADDRESS"], key)
    send(conn, Hello(rank=rank, pid=os.getpid(), launch=os.environ.get("RP_LAUNCH", "")))
    heartbeat.set("starting", detail="joining the process group")
    _join_group(conn, rank, world_size, device)
    heartbeat.watch_collectives()
    heartbeat.watch_device(device)  # a GPU's queued work counts as work (after set_device: its streams)
    heartbeat.set("starting", detail="importing its methods")
    try:
        _load_methods()
    except BaseException:
        # Exit with a plain status and the traceback in the log (the client shows both): a normal
        # interpreter exit with a live gloo group aborts (-6) and hides the cause.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    ctx = WorkerContext(
        rank=rank, world_size=world_size, device=device, conn=conn, shm_dir=os.environ["RP_SHM_DIR"],
        heartbeat=heartbeat,
    )  # fmt: skip
    heartbeat.set("idle")
    send(conn, Ready(rank=rank, device=str(device), pid=os.getpid()))
    _leave_group(clean=_serve(conn, ctx))


if __name__ == "__main__":  # pragma: no cover - started through client.bootstrap_command
    main()
