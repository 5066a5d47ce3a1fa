"""Everything the ComfyUI nodes decide, in plain Python: input parsing, the handle, the worker registry.

No ComfyUI and no torch at import time: the pack's entry point imports this module, and the CI tests
run it without ComfyUI. The node classes in `classes.py` only translate between ComfyUI and these
functions; the backend is imported lazily, when a node first runs.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..backend.config import ConfigError, ParallelLayout

if TYPE_CHECKING:
    from ..backend.api import ParallelFlux

# The socket type between the loader and the samplers (ComfyUI matches custom types by string).
HANDLE_TYPE = "PARALLEL_FLUX"
CATEGORY = "ROCm Parallel"

DEVICES_ALL = "all"
DTYPES = ("default", "bfloat16", "float16", "float32")
PRELOAD_LAYOUTS = ("none", "tp", "context", "auto")
# Only ComfyUI's euler / simple are implemented by the backend; offering more would be a lie.
SAMPLERS = ("euler",)
SCHEDULERS = ("simple",)
STATUS_ACTIONS = ("report", "unload", "close", "doctor")
# Worker threads per process (torch.set_num_threads); unset leaves torch's default. Tests and shared
# CPU machines set it to 1 so that several CPU workers do not fight over the same cores.
THREADS_ENV = "ROCM_PARALLEL_THREADS"


# --------------------------------------------------------------------------------------------------
# Input parsing


def parse_devices(text: str, visible_gpus: Callable[[], int] | None = None) -> tuple[str, ...]:
    """The loader's `devices` text -> device names for the worker group (`backend.platforms.parse_devices`).

    "all" (or empty): every visible GPU, an error naming the torch build when there is none. "0,1,2,3"
    or "cuda:0, cuda:1": those GPUs. "cpu x2" (or "cpu*2", "cpu, cpu"): CPU workers, for testing.
    """
    from ..backend.platforms import parse_devices as parse

    return parse(text, visible_gpus)


def compute_dtype(choice: str) -> str | None:
    """'default' -> None (bfloat16 on GPUs that support it, float32 on CPU); otherwise the name."""
    if choice not in DTYPES:
        raise ConfigError(f"dtype={choice!r} is not offered; use one of {', '.join(DTYPES)}")
    return None if choice == "default" else choice


def tp_layout(devices: int) -> ParallelLayout:
    """Tensor parallelism over every device of the group."""
    return ParallelLayout.make("tp", devices)


def context_layout(ring: int, ulysses: int, devices: int) -> ParallelLayout | None:
    """The Ring Attention Sampler's degrees: 0 fills the rest; both 0 is `None`, the planner's choice
    for the image being sampled (see `sample`)."""
    if ring == 0 and ulysses == 0:
        return None
    return ParallelLayout.make("context", devices, ring, ulysses)


def describe_layout(layout: ParallelLayout) -> str:
    return layout.describe()


# ComfyUI's Cancel raises comfy.model_management.InterruptProcessingException; matched by name because
# this module never imports ComfyUI. A JobTimeout is not a cancel: it is shown as an error.
_CANCELS = ("InterruptProcessingException", "KeyboardInterrupt", "JobCancelled")
_ABSOLUTE_PATH = re.compile(r"(?<![\w.])(?:[A-Za-z]:)?[/\\](?:[^\s'\"/\\:;,]+[/\\])*([^\s'\"/\\:;,]+)")
_LISTING = re.compile(r"(?:; |, )?'[^']*' has: .*?(?:\.(?= [A-Z])|\.?$)")


def is_cancel(exc: BaseException) -> bool:
    """The user's Cancel (or Ctrl+C), as opposed to a failure."""
    return type(exc).__name__ in _CANCELS


def public_error(exc: BaseException) -> str:
    """An error for the panel and the status route: absolute paths shortened to their file names and
    folder listings dropped (the route is readable by anyone who reaches ComfyUI's port)."""
    text = _LISTING.sub(".", str(exc).splitlines()[0] if str(exc) else "")
    return f"{type(exc).__name__}: {_ABSOLUTE_PATH.sub(lambda m: m.group(1), text)}"


def needs_gpu_memory(devices: Sequence[str]) -> bool:
    """ComfyUI's own models must leave the GPUs before the workers load theirs."""
    return any(d.startswith("cuda") for d in devices)


# --------------------------------------------------------------------------------------------------
# The handle between the nodes


@dataclass(frozen=True)
class ParallelHandle:
    """What flows over a PARALLEL_FLUX link: which checkpoint, on which devices, in which dtype.

    Plain, hashable data: the resident worker group itself stays in the registry, so a handle from a
    cached node output still finds (or restarts) the group that serves its devices.
    """

    checkpoint: str  # absolute path
    name: str  # as listed in ComfyUI's diffusion_models
    devices: tuple[str, ...]
    dtype: str | None

    def __repr__(self) -> str:
        return f"<{HANDLE_TYPE} {self.name} on {', '.join(self.devices)}>"


# --------------------------------------------------------------------------------------------------
# The registry of resident worker groups


def _default_factory(devices: tuple[str, ...]) -> ParallelFlux:
    from ..backend.api import ParallelFlux

    threads = int(os.environ[THREADS_ENV]) if os.environ.get(THREADS_ENV) else None
    return ParallelFlux(list(devices), threads=threads)


class Registry:
    """One ParallelFlux per device set, kept between queue runs; asking for another set closes the old.

    `state` is a plain snapshot for the web panel, updated by the nodes as they run, so the HTTP route
    never talks to the workers (a job may be running on them from ComfyUI's execution thread).
    """

    def __init__(self, factory: Callable[[tuple[str, ...]], ParallelFlux] = _default_factory) -> None:
        self._factory = factory
        self._flux: ParallelFlux | None = None
        self._lock = threading.Lock()
        self.state: dict[str, Any] = self._idle_state()

    @staticmethod
    def _idle_state() -> dict[str, Any]:
        return {"devices": [], "checkpoint": None, "layout": None, "phase": "stopped", "ranks": []}

    @property
    def current(self) -> ParallelFlux | None:
        return self._flux

    def flux_for(self, devices: Sequence[str]) -> ParallelFlux:
        """The resident ParallelFlux for exactly these devices (started lazily by the backend)."""
        key = tuple(devices)
        if self._flux is not None and tuple(self._flux.devices) == key:
            return self._flux
        self.close()
        self._flux = self._factory(key)
        self.update(devices=list(self._flux.devices), phase="idle")
        return self._flux

    def close(self) -> None:
        """Stop the worker group (ComfyUI's models can have the devices back)."""
        flux, self._flux = self._flux, None
        if flux is not None:
            flux.close()
        with self._lock:
            self.state = self._idle_state()

    def update(self, **fields: Any) -> None:
        with self._lock:
            self.state = {**self.state, **fields}

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return dict(self.state)

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

    def record_resident(self, flux: ParallelFlux) -> None:
        """Name what the workers really hold (never a file that was asked for and rejected)."""
        resident = flux.resident
        self.update(
            checkpoint=os.path.basename(resident.checkpoint) if resident is not None else None,
            layout=describe_layout(resident.layout) if resident is not None else None,
        )

    def record_ranks(self, reports: Sequence[dict[str, Any]]) -> None:
        """Keep each rank's device, parameter bytes and memory for the panel."""
        keys = ("rank", "device", "parameter_bytes", "allocated_gb", "peak_gb", "free_gb", "total_gb")
        self.update(ranks=[{k: r[k] for k in keys if k in r} for r in reports])


REGISTRY = Registry()


# --------------------------------------------------------------------------------------------------
# What the nodes do


def load(
    registry: Registry,
    handle: ParallelHandle,
    preload: str,
    ring: int = 0,
    ulysses: int = 0,
    interrupted: Callable[[], None] | None = None,
) -> ParallelFlux:
    """Start (or reuse) the group for the handle's devices and, unless preload is 'none', load the model."""
    if preload not in PRELOAD_LAYOUTS:
        raise ConfigError(f"preload={preload!r} is not offered; use one of {', '.join(PRELOAD_LAYOUTS)}")
    flux = registry.flux_for(handle.devices)
    if preload == "none":
        start_workers(registry, flux)  # now, so the first sampler run only loads weights
        return flux
    if preload == "auto":
        layout = auto_layout(registry, flux, handle, 1024, 1024, 1, context_only=False)
    else:
        registry.update(auto=None)
        layout = (
            tp_layout(len(handle.devices))
            if preload == "tp"
            else ParallelLayout.make("context", len(handle.devices), ring, ulysses)
        )
    ensure_loaded(registry, flux, handle, layout, interrupted)
    return flux


def start_workers(registry: Registry, flux: ParallelFlux) -> None:
    """Start the worker processes if they are not running, showing 'starting' meanwhile."""
    if not flux.started:
        with registry.phase("starting workers"):
            flux.start()


def auto_layout(
    registry: Registry,
    flux: ParallelFlux,
    handle: ParallelHandle,
    width: int,
    height: int,
    batch: int,
    context_only: bool,
) -> ParallelLayout:
    """The planner's layout for this image (link and memory measured once per group); its reason is shown."""
    from ..backend.flux.load import inspect_checkpoint

    resident = flux.resident
    dims = resident.info.dims if resident is not None and resident.checkpoint == handle.checkpoint else None
    dims = dims or inspect_checkpoint(handle.checkpoint).dims
    choice = flux.auto_layout(dims, width, height, batch, handle.dtype, context_only=context_only)
    registry.update(auto=choice.explanation)
    return choice.layout


def ensure_loaded(
    registry: Registry,
    flux: ParallelFlux,
    handle: ParallelHandle,
    layout: ParallelLayout,
    interrupted: Callable[[], None] | None = None,
) -> None:
    """Make the handle's checkpoint resident in `layout` (a no-op on the workers when it already is).

    `interrupted()` runs between tensors and raises on a pending Cancel: the load stops there on every
    rank. The panel names the file being loaded as such, and the resident one only once it is.
    """

    def check(done: int, total: int) -> None:
        registry.update(step=done, total=total)
        if interrupted is not None:
            interrupted()

    with registry.phase("loading", loading=handle.name, step=0, total=0):
        try:
            flux.check_load(handle.checkpoint, layout=layout, dtype=handle.dtype)  # before any worker starts
            if not flux.started:
                registry.update(phase="starting workers")
                flux.start()
                registry.update(phase="loading")
            reports = flux.load(handle.checkpoint, layout=layout, dtype=handle.dtype, progress=check)
        finally:
            registry.update(loading=None)
            registry.record_resident(flux)
    registry.record_ranks(reports)


def sample(
    registry: Registry,
    handle: ParallelHandle,
    layout: ParallelLayout | None,
    positive: Any,
    latent: dict[str, Any],
    *,
    seed: int,
    steps: int,
    denoise: float,
    sigmas: Any = None,
    progress: Callable[[int, int], None] | None = None,
    interrupted: Callable[[], None] | None = None,
    make_room: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Validate, load in `layout` if needed, then run the whole denoising loop on the workers.

    The job is checked against the checkpoint's header before any worker starts, any weight loads or
    `make_room()` (ComfyUI freeing its own models for the workers) runs. `layout=None` lets the planner
    choose a ring x Ulysses split for this latent's size.
    """
    from ..backend.api import ParallelFlux

    ParallelFlux.check_sample(
        positive, latent, checkpoint=handle.checkpoint, seed=seed, steps=steps, denoise=denoise, sigmas=sigmas
    )
    if make_room is not None:
        make_room()
    flux = registry.flux_for(handle.devices)
    if layout is None:
        b, _, h, w = latent["samples"].shape
        layout = auto_layout(registry, flux, handle, w * 8, h * 8, b, context_only=True)
    else:
        registry.update(auto=None)
    ensure_loaded(registry, flux, handle, layout, interrupted)

    def report(step: int, total: int) -> None:
        registry.update(step=step, total=total)
        if progress is not None:
            progress(step, total)  # ComfyUI's progress bar raises here on Cancel: every rank stops

    with registry.phase("sampling", step=0, total=steps):
        out = flux.sample(
            positive, latent, seed=seed, steps=steps, denoise=denoise, sigmas=sigmas, progress=report
        )
    registry.record_ranks(flux.status())
    return out


def status_text(registry: Registry, action: str, devices: Sequence[str] | None = None) -> str:
    """The status node: report, or unload the model (workers stay), or close the worker group, or run
    `doctor` (over the resident group, else over `devices` or every GPU)."""
    if action not in STATUS_ACTIONS:
        raise ConfigError(f"action={action!r} is not offered; use one of {', '.join(STATUS_ACTIONS)}")
    if action == "doctor":
        return doctor_text(registry, devices)
    flux = registry.current
    if action == "unload" and flux is not None:
        flux.unload()
        registry.record_resident(flux)
        if flux.started:
            registry.record_ranks(flux.status())
    elif action == "close":
        registry.close()
    elif flux is not None and flux.started:
        registry.record_ranks(flux.status())
    flux = registry.current
    return format_state(registry.snapshot()) + "".join(
        f"\nwarning: {w}" for w in (flux.warnings if flux is not None else ())
    )


def doctor_text(registry: Registry, devices: Sequence[str] | None = None) -> str:
    """`python -m rocm_parallel doctor`'s report; uses the resident group when one runs (its GPUs are
    busy with it), otherwise starts a short-lived one on `devices` (default: every GPU, else 'cpu x2')."""
    from ..backend import doctor

    flux = registry.current
    group = flux.group if flux is not None and flux.started else None
    return doctor.format_report(doctor.collect(devices, group=group))


def format_state(state: dict[str, Any]) -> str:
    """Human text of a registry snapshot (the status node's STRING)."""
    if not state.get("devices"):
        return "ROCm Parallel: no worker group is running"
    lines = [
        f"ROCm Parallel: {len(state['devices'])} workers on {', '.join(state['devices'])} ({state['phase']})",
        f"model: {state.get('checkpoint') or 'none loaded'}"
        + (f", {state['layout']}" if state.get("layout") else ""),
    ]
    if state.get("loading"):
        lines.append(f"loading: {state['loading']}")
    for r in state.get("ranks", []):
        line = (
            f"  rank {r.get('rank')} {r.get('device')}: {r.get('parameter_bytes', 0) / 1e9:.3f} GB parameters"
        )
        if "allocated_gb" in r:
            line += f", {r['allocated_gb']:.2f} / {r.get('total_gb', 0):.2f} GB allocated"
        lines.append(line)
    if state.get("auto"):
        lines.append(state["auto"])
    if state.get("last"):
        lines.append(f"last job: {state['last']}")
    if state.get("error"):
        lines.append(f"last error: {state['error']}")
    return "\n".join(lines)
