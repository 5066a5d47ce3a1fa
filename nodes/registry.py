"""The resident worker groups of this ComfyUI (one ParallelModel per device set, kept between queue runs)
and the plain snapshot of them the web panel reads. No ComfyUI and no torch at import time.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from ..backend.runtime.redact import file_name, file_names_only
from .inputs import describe_layout

if TYPE_CHECKING:
    from ..backend.diffusion.api import ParallelModel
    from ..backend.resident.messages import RankStatus

# Worker threads per process (torch.set_num_threads); unset leaves torch's default. Tests and shared
# CPU machines set it to 1 so that several CPU workers do not fight over the same cores.
THREADS_ENV = "ROCM_PARALLEL_THREADS"


# ComfyUI's Cancel raises comfy.model_management.InterruptProcessingException; matched by name because
# this module never imports ComfyUI. A JobTimeout is not a cancel: it is shown as an error.
_CANCELS = ("InterruptProcessingException", "KeyboardInterrupt", "JobCancelled")


def is_cancel(exc: BaseException) -> bool:
    """The user's Cancel (or Ctrl+C), as opposed to a failure."""
    return type(exc).__name__ in _CANCELS


def public_text(text: str) -> str:
    """`text` with every path shortened to its file name and folder listings dropped (the status route is
    readable by anyone who reaches ComfyUI's port: no folder name may leak, whatever it holds)."""
    return file_names_only(text)


def public_error(exc: BaseException) -> str:
    """An error for the panel and the status route: its first line, with file names only (`public_text`)."""
    return f"{type(exc).__name__}: {public_text(str(exc).splitlines()[0] if str(exc) else '')}"


def size_text(nbytes: float) -> str:
    """'2.3 MB', '23.80 GB': the one unit style of the panel and the Status node."""
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def rank_line(rank: Mapping[str, Any]) -> str:
    """One rank as the panel and the Status node both show it ('rank 0 cuda:0: 5.95 GB weights, 6.20 /
    63.9 GB allocated'); the panel draws the text the snapshot carries, so both say the same."""
    line = (
        f"rank {rank.get('rank')} {rank.get('device')}: {size_text(rank.get('parameter_bytes') or 0)} weights"
    )
    if rank.get("total_gb"):
        line += f", {rank.get('allocated_gb', 0):.2f} / {rank['total_gb']:.1f} GB allocated"
    return line


def _relabel(activity: str, label: str) -> str:
    """The group names a ComfyUI model call 'model call'; the panel knows which step it is."""
    return label + activity[len("model call") :] if activity.startswith("model call") else activity


def threads_from_env() -> int | None:
    """ROCM_PARALLEL_THREADS as a number of threads per worker (unset: None, the default)."""
    text = os.environ.get(THREADS_ENV, "").strip()
    if not text:
        return None
    if not (text.isascii() and text.isdigit() and len(text) <= 9) or int(text) < 1:  # never int('²')
        from ..backend.config import ConfigError

        raise ConfigError(
            f"{THREADS_ENV}={text!r} must be a whole number of torch threads per worker (1 or more); "
            "unset it for the default"
        )
    return int(text)


def _default_factory(devices: tuple[str, ...]) -> ParallelModel:
    from ..backend.diffusion.api import ParallelModel
    from ..backend.platforms import device_host

    if any(device_host(d) for d in devices):
        configure_hosts()
    return ParallelModel(list(devices), threads=threads_from_env())


def announce_hosts() -> None:
    """At ComfyUI's start, with ROCM_PARALLEL_LISTEN set: the group's key made ready (created in the user folder
    when there is none) and the command the other hosts run printed, so they can join before the first job
    (nothing listens yet: the hub starts with the first group that names another host)."""
    import sys

    from ..backend.config import ConfigError
    from ..backend.runtime.hostsettings import LISTEN_ENV, read_key, settings

    if not os.environ.get(LISTEN_ENV) or "folder_paths" not in sys.modules:
        return
    try:
        configure_hosts()
        found = settings()
        read_key(found.key_file, create=True)
    except ConfigError as exc:
        print(f"[ROCm Parallel] other hosts cannot join: {exc}", file=sys.stderr, flush=True)
        return
    address = "{}:{}".format(*found.listen)
    print(
        f"[ROCm Parallel] other hosts join this ComfyUI with a copy of {found.key_file} (mode 600) and: python "
        f"custom_nodes/<this pack> worker --join {address} --key-file <the copy> --devices <theirs> --models "
        "<their ComfyUI/models> (docs/hosts.md)",
        file=sys.stderr,
        flush=True,
    )


def configure_hosts() -> None:
    """What a group across hosts takes from ComfyUI (docs/hosts.md): the group's key in its user folder
    (created there on first use), and its model folders, under which the other hosts find their copies of a
    file by the same name (its models folder: 'diffusion_models/flux.safetensors'; a folder of its
    extra_model_paths.yaml: '<kind>/<name>')."""
    import folder_paths

    from ..backend.runtime.hostsettings import configure

    models = os.path.abspath(folder_paths.models_dir)
    folders = {models: ""}
    for kind, entry in folder_paths.folder_names_and_paths.items():
        for folder in entry[0]:
            inside = os.path.abspath(folder).startswith(models + os.sep)
            folders.setdefault(os.path.abspath(folder), os.path.relpath(folder, models) if inside else kind)
    key_file = os.path.join(folder_paths.get_user_directory(), "rocm_parallel", "hosts.key")
    configure(key_file=key_file, folders=folders)


class Registry:
    """One ParallelModel per device set, kept between queue runs; asking for another set closes the old.

    `state` is a plain snapshot for the web panel, updated by the nodes as they run, so the HTTP route
    never talks to the workers (a job may be running on them from ComfyUI's execution thread).
    """

    def __init__(self, factory: Callable[[tuple[str, ...]], ParallelModel] = _default_factory) -> None:
        self._factory = factory
        self._model: ParallelModel | None = None
        self._lock = threading.Lock()
        self.state: dict[str, Any] = self._idle_state()

    @staticmethod
    def _idle_state() -> dict[str, Any]:
        return {"devices": [], "checkpoint": None, "layout": None, "phase": "stopped", "ranks": []}

    @property
    def current(self) -> ParallelModel | None:
        return self._model

    def group_for(self, devices: Sequence[str]) -> ParallelModel:
        """The resident ParallelModel for exactly these devices (started lazily by the backend)."""
        key = tuple(devices)
        if self._model is not None and tuple(self._model.devices) == key:
            return self._model
        self.close()
        self._model = self._factory(key)
        self.update(devices=list(self._model.devices), phase="idle")
        return self._model

    def close(self) -> None:
        """Stop the worker group (ComfyUI's models can have the devices back)."""
        model, self._model = self._model, None
        if model is not None:
            model.close()
        with self._lock:
            self.state = self._idle_state()

    def update(self, **fields: Any) -> None:
        with self._lock:
            self.state = {**self.state, **fields}

    def snapshot(self) -> dict[str, Any]:
        """The panel's data, safe to show to anyone who reaches ComfyUI's port: file names only (ComfyUI
        lists models in subfolders as 'My Models/private user/flux.safetensors'), and, while a job runs,
        what its ranks are doing ('step 3 of 20: 41 s so far, still computing')."""
        with self._lock:
            state = dict(self.state)
        for key in ("checkpoint", "loading"):
            if state.get(key):
                state[key] = file_name(str(state[key]))
        state["models"] = [
            {**m, "checkpoint": file_name(str(m["checkpoint"]))} for m in state.get("models") or ()
        ]
        for key in ("error", "last", "evicted"):
            if state.get(key):
                state[key] = public_text(str(state[key]))
        state["ranks"] = [{**r, "text": rank_line(r)} for r in state.get("ranks", [])]
        transport = getattr(self._model, "transport_note", None)  # a slower transport after a failed start
        if transport:
            state["transport"] = public_text(transport)
        activity = self._model.activity if self._model is not None else None
        if activity:
            step, total = state.get("step"), state.get("total")
            label = f"step {step + 1} of {total}" if state.get("phase") == "sampling" and total else None
            state["activity"] = public_text(activity if label is None else _relabel(activity, label))
        return state

    @contextmanager
    def phase(self, name: str, **fields: Any) -> Iterator[None]:
        """Show `name` (starting, loading, sampling) while the body runs, and how it ended.

        A user's Cancel is shown as such ('cancelled'), not as an error; an error is shown with file
        names only, never the absolute paths or folder listings a backend message may carry.
        """
        self.update(phase=name, since=time.time(), error=None, last=None, **fields)
        try:
            yield
        except BaseException as exc:
            if is_cancel(exc):
                self.update(phase="idle", last=f"{name} cancelled by the user")
            else:
                self.update(phase="idle", error=public_error(exc))
            raise
        self.update(phase="idle")

    @contextmanager
    def refusals(self) -> Iterator[None]:
        """Around a node's run: an error raised outside a phase (input refused before any worker starts: a
        layout that does not fit the model, a file that is no checkpoint, the admission refusal, a LoRA
        that does not fit) is the panel's last error too, as a phase's own error is."""
        try:
            yield
        except BaseException as exc:
            if not is_cancel(exc):
                self.update(error=public_error(exc), last=None)
            raise

    def record_resident(self, model: ParallelModel) -> None:
        """Name what the workers really hold (never a file that was asked for and rejected): the diffusion
        model used last as `checkpoint` / `layout` (what a loader's panel compares with its widgets), every
        resident module in `models` (a graph with two loaders on these devices keeps both; a text encoder and
        a VAE beside them), and the latest model unloaded to make room for another (`evicted`)."""
        # a text encoder or a VAE (a module that describes itself) is no loader's model and may have no layout
        models = [r for r in model.residents.values() if not callable(getattr(r, "describe", None))]
        latest = models[-1] if models else None
        self.update(
            checkpoint=os.path.basename(latest.checkpoint) if latest is not None else None,
            layout=describe_layout(latest.layout) if latest is not None else None,
            models=[_resident_entry(model, slot, r) for slot, r in model.residents.items()],
            evicted=model.evicted[-1] if model.evicted else None,
        )

    def watch_residency(self, model: ParallelModel) -> None:
        """Keep the panel's `models` current whenever what `model`'s ranks hold, or where, changes (a text
        encoder parked in host memory while the model samples: backend/resident/parking.py)."""
        model.on_residency_change = lambda: self.record_resident(model)

    def record_ranks(self, reports: Sequence[RankStatus]) -> None:
        """Keep each rank's device, parameter bytes and memory for the panel (plain data: it is JSON)."""
        ranks = []
        for r in reports:
            memory = dataclasses.asdict(r.memory) if r.memory is not None else {}
            ranks.append({"rank": r.rank, "device": r.device, "parameter_bytes": r.parameter_bytes, **memory})
        self.update(ranks=ranks)


def model_text(entry: Mapping[str, Any]) -> str:
    """One resident model as the Status node shows it (the panel draws the same: js/rocm_parallel.js)."""
    placement = f", {entry['placement']}" if entry.get("placement") else ""
    return f"{entry['checkpoint']} ({entry['layout']}{placement})"


def _resident_entry(model: ParallelModel, slot: str, request: Any) -> dict[str, Any]:
    """One resident model for the panel: its file, its layout (a resident module's own words: "text encoder,
    tp 4"), and for a module that may wait in host memory where it is now."""
    describe = getattr(request, "describe", None)
    entry = {
        "checkpoint": os.path.basename(request.checkpoint),
        "layout": describe() if callable(describe) else describe_layout(request.layout),
    }
    if getattr(request, "park_method", None):
        where = "in host memory" if slot in model.parked else "on the devices"
        entry["placement"] = f"{size_text(int(request.weight_bytes))} per device, {where}"
    return entry


REGISTRY = Registry()

Node = TypeVar("Node", bound=Callable[..., Any])


def shows_errors(function: Node) -> Node:
    """A node's FUNCTION whose errors the panel shows as its last error (`Registry.refusals` on REGISTRY,
    looked up when the node runs)."""

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        with REGISTRY.refusals():
            return function(*args, **kwargs)

    return run  # type: ignore[return-value]


def loader_request(checkpoint: str, devices: str, preload: str) -> dict[str, Any]:
    """What a loader with these widgets would ask the workers for: its checkpoint's file name, the devices
    its text names (None when refused, with the reason in `refused`) and, for preload 'tp' / 'context', the
    layout ('auto' and 'none' leave the layout to the planner or the sampler: None)."""
    from ..backend.config import ConfigError, ParallelLayout
    from ..backend.platforms import validate_devices  # cheap: the status route runs it
    from .inputs import parse_devices, tp_layout

    refused = None
    try:
        wanted: tuple[str, ...] | None = validate_devices(parse_devices(devices))
    except ConfigError as exc:
        wanted, refused = None, str(exc)
    layout = None
    if wanted and preload in ("tp", "context"):
        try:
            made = (
                tp_layout(len(wanted))
                if preload == "tp"
                else ParallelLayout.make("context", len(wanted), 0, 0)
            )
            layout = describe_layout(made)
        except ConfigError:
            layout = None
    return {
        "checkpoint": file_name(checkpoint) or None,
        "devices": wanted,
        "layout": layout,
        "refused": refused,
    }


def _group_text(checkpoint: str | None, devices: Sequence[str], layout: str | None) -> str:
    where = f"{checkpoint or 'no model'} on {', '.join(devices)}"
    return f"{where} ({layout})" if layout else where


def mismatch(state: Mapping[str, Any], request: Mapping[str, Any]) -> str | None:
    """The panel's notice when the running group (`state`, a snapshot) is not what this loader asks for
    (`request`, `loader_request`): another device list, another resident checkpoint, another layout.
    None when they agree or when nothing runs. A loader whose devices would be refused (a 4-GPU workflow
    opened on a 2-GPU machine) is told so: the group shown is not its own."""
    running = list(state.get("devices") or [])
    wanted = request.get("devices")
    resident, layout = state.get("checkpoint"), state.get("layout")
    if not running:
        return None
    if wanted is None:
        return (
            f"showing the running group of {_group_text(resident, running, layout)}, not this loader's: "
            f"its devices would be refused ({request.get('refused')})"
        )
    differs = list(wanted) != running
    differs |= bool(resident) and request.get("checkpoint") != resident
    differs |= bool(resident and layout and request.get("layout")) and request.get("layout") != layout
    if not differs:
        return None
    return (
        f"showing the running group of {_group_text(resident, running, layout)}; this loader asks for "
        f"{_group_text(request.get('checkpoint'), wanted, request.get('layout'))}; it will load when queued"
    )
