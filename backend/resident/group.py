"""A worker group with models resident on every rank, whatever their kind (a diffusion model, a text encoder,
a VAE): the group started on first use and again after a failure, each model in its slot, loaded when a job
needs it, evicted (least recently used first) or parked in host memory when the weights would not fit
together, unloaded, and the ranks' status.

A group keeps several models resident at once, each in its own slot (a ComfyUI graph with two models, such
as Wan 2.2's high- and low-noise experts or a text encoder beside a diffusion model, keeps both). A model is
named by its load request: any frozen record with `slot`, `checkpoint`, the bytes of weights it puts on
each rank (`weight_bytes`, or a `weight_bytes_on(device)` method) and `load_method` (the worker method that
loads it; resident/jobs.py `load_slot` is its skeleton). `diffusion/group.py` adds what loading a diffusion
model takes (options, checks, 'auto' layouts); `ParallelEncoder` and `ParallelVae` use a group as it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections import OrderedDict
from typing import Any

import psutil

from ..config import DEFAULT_SLOT
from ..plan.encoder import COMFYUI_GPU0, MARGIN
from ..platforms import DeviceSpec, parse_devices
from ..runtime.client import ProgressCallback, WorkerError, WorkerGroup, check_group_options, validate_devices
from ..text import GB
from . import admission
from .messages import LoadReport, RankStatus, UnloadRequest
from .parking import check_policy, parkable, to_park


def default_devices() -> list[str]:
    """All visible GPUs (ROCm GPUs are 'cuda' devices in torch); an error naming the torch build when
    there is none (CPU workers are for testing: ask for them, e.g. ParallelModel(["cpu", "cpu"]))."""
    return list(parse_devices("all"))


# Of a device's memory (a GPU's, or the host's for CPU workers), the share the weights of every resident
# model may take together before the least recently used is unloaded for a new one: the rest is for
# activations, the runtime and (on GPU 0) ComfyUI's own models.
RESIDENT_SHARE = 0.75


class ResidentGroup:
    """A worker group (started on first use, started again after a failure closed it) and the models its
    ranks hold: `residents`, slot -> the load request every rank answered (`resident`: the default slot's).

    Thread-safe: calls from several threads run one at a time; `status()` never waits for a running
    job (it answers from the last report, marked busy).
    """

    def __init__(
        self,
        devices: DeviceSpec | None = None,
        *,
        threads: int | None = None,
        start_timeout: float = 300.0,
        group: WorkerGroup | None = None,
        backend: str | None = None,
    ) -> None:
        """`group` adopts a running WorkerGroup (tests share one); otherwise one starts on first use.
        `backend='gloo'` runs GPU collectives through gloo (no NCCL/RCCL; several workers on one GPU)."""
        check_group_options(threads, start_timeout, group, devices, backend)
        if group is not None:
            devices, backend = group.devices, group.backend
        self.backend = backend
        self.devices = validate_devices(devices if devices is not None else default_devices(), backend)
        self.threads, self.start_timeout = threads, start_timeout
        self._group: WorkerGroup | None = group
        # slot -> what every rank holds there, in least recently used order (the first is evicted first)
        self.residents: OrderedDict[str, Any] = OrderedDict()
        self._loaded_in: dict[str, WorkerGroup] = {}
        self._lock = threading.RLock()
        self._last_status: list[RankStatus] = []
        self.evicted: list[str] = []  # one line per model unloaded to make room for another (the panel)
        # slots whose weights wait in host memory (parking.py), and each parkable slot's policy
        self.parked: set[str] = set()
        self.park_policy: dict[str, str] = {}
        # called (under the group's lock) after what the ranks hold or where changed: the panel's refresh
        self.on_residency_change: Any = None

    # ------------------------------------------------------------------ group

    @property
    def group(self) -> WorkerGroup:
        """The live worker group, started (again) when needed."""
        with self._lock:
            if self._group is None or not self._group.alive:
                if self._group is not None:
                    self._group.close(timeout=2.0)
                self._group = WorkerGroup(
                    self.devices, threads=self.threads, start_timeout=self.start_timeout, backend=self.backend
                )
            return self._group

    def start(self) -> WorkerGroup:
        """Start the workers now (otherwise the first load does)."""
        return self.group

    @property
    def warnings(self) -> list[str]:
        """What the running group's start-up changed on its own (e.g. NCCL_P2P_DISABLE=1 after a hang)."""
        return list(self._group.warnings) if self._group is not None else []

    @property
    def transport_note(self) -> str | None:
        """The panel's line when the running group is not on the fastest transport (preflight.py)."""
        return self._group.transport_note if self._group is not None else None

    @property
    def activity(self) -> str | None:
        """What the running job's ranks are doing ('step 3 of 20: 41 s so far, still computing'), from
        their own reports (`WorkerGroup.activity`); None between jobs. Safe to read from any thread."""
        group = self._group
        return group.activity if group is not None else None

    @property
    def started(self) -> bool:
        return self._group is not None and self._group.alive

    def close(self) -> None:
        with self._lock:
            if self._group is not None:
                self._group.close()
            self._group = None
            self.residents.clear()
            self._loaded_in.clear()

    def __enter__(self) -> ResidentGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ models

    @property
    def resident(self) -> Any:
        """What the default slot holds (the one model of a caller that keeps one), or None."""
        return self.residents.get(DEFAULT_SLOT)

    def _load_resident(
        self, request: Any, progress: ProgressCallback | None = None, timeout: float | None = None
    ) -> list[LoadReport]:
        """Load on the workers; `residents` names the request only once every rank holds it."""
        group = self.group
        slot = request.slot
        group.check_files(request)  # another host's copies: refused while the ranks still hold what they hold
        self._forget(slot)  # the workers drop what they held there first
        self._make_room(request, group)
        try:
            reports = group.call_all(_load_method(request), request, timeout=timeout, progress=progress)
        except BaseException:
            # Loading has no collectives, so a cancel or a one-rank failure can leave some ranks holding
            # the new model and others nothing: drop it everywhere, so no rank holds what no record names.
            if group.alive:
                with contextlib.suppress(WorkerError):
                    group.call_all("unload_slot", UnloadRequest(slot))
            raise
        self.residents[slot], self._loaded_in[slot] = request, group
        self._last_status = reports
        self._held(request)
        self._residency_changed()
        return reports

    def _held(self, request: Any) -> None:
        """Every rank holds `request` now: what a kind keeps in the caller for it (diffusion/group.py: the
        forward client of its model calls)."""

    def _forget(self, slot: str) -> None:
        self.residents.pop(slot, None)
        self._loaded_in.pop(slot, None)
        self.parked.discard(slot)

    def _residency_changed(self) -> None:
        if self.on_residency_change is not None:
            self.on_residency_change()

    # ------------------------------------------------------------------ host placement (parking.py)

    def set_park_policy(self, slot: str, policy: str) -> None:
        """Where `slot`'s module waits between jobs: "auto", "resident" or "host" (parking.py)."""
        self.park_policy[slot] = check_policy(policy)

    def park(self, slot: str) -> None:
        """Move the module in `slot` to host memory on every rank (each its own shard), if not there."""
        with self._lock:
            if slot in self.parked or slot not in self.residents or not self.started:
                return
            self._place(slot, self.group, on_device=False)

    def _place(self, slot: str, group: WorkerGroup, *, on_device: bool) -> None:
        request = self.residents[slot]
        self._last_status = group.call_all(request.park_method, request.placement(on_device))
        if on_device:
            self.parked.discard(slot)
        else:
            self.parked.add(slot)
        self._residency_changed()

    def _parking_frees_memory(self) -> bool:
        """On CPU workers the host is the device: parking would move nothing."""
        return self.devices[0] != "cpu"

    def make_headroom(self, need: float, *, exclude: str = "") -> None:
        """Before a job that needs `need` bytes per rank beyond the resident weights (its activations):
        park the modules whose policy allows it, least recently used first, while the job would not fit
        (admission.memory_limit, the bound the job is then admitted against)."""
        with self._lock:
            if not self._parking_frees_memory() or not self.started:
                return
            for slot in to_park(self.residents.items(), self.parked, self.park_policy, exclude=exclude):
                bound = admission.memory_limit(self.devices, self._last_status)
                if bound is None or need <= bound[0]:
                    return
                self._place(slot, self.group, on_device=False)

    def _resident_group(self, request: Any, progress: ProgressCallback | None = None) -> WorkerGroup:
        """The group holding `request` in its slot, loading it first when the ranks hold something else
        there (or the group was restarted after a failure); the slot becomes the most recently used."""
        slot = request.slot
        held = self.residents.get(slot)
        if held != request or self._loaded_in.get(slot) is not self._group or not self.started:
            self._load_resident(request, progress)
        elif slot in self.parked:  # back on the devices before it runs (beside what still fits there)
            self._make_room(request, self.group)
            self._place(slot, self.group, on_device=True)
        self.residents.move_to_end(slot)
        return self.group

    def hold(self, request: Any, progress: ProgressCallback | None = None) -> None:
        """Make `request` resident in its slot now, as the first job that needs it would: loaded when the ranks
        hold something else there, brought back to the devices when parked; the slot becomes the most
        recently used."""
        with self._lock:
            self._resident_group(request, progress)

    def call_resident(
        self,
        request: Any,
        method: str,
        payload: Any,
        *,
        timeout: float | None = None,
        progress: ProgressCallback | None = None,
    ) -> list[Any]:
        """Run worker `method` on every rank with `request` resident in its slot (loaded first when the ranks
        hold something else there), one job at a time with the group's other calls; each rank's reply.

        `request` is a model's LoadRequest or a resident module's record: any frozen record with `slot`,
        `checkpoint`, `weight_bytes` (per rank) and `load_method` (the worker method that loads it, e.g.
        backend/vae/messages.py VaeLoadRequest), kept and evicted like a model."""
        with self._lock:
            group = self._resident_group(request, progress)
            return group.call_all(method, payload, timeout=timeout)

    @property
    def reports(self) -> list[RankStatus]:
        """Each rank's latest status (after the latest load or status call): what admission reads."""
        return list(self._last_status)

    def _make_room(self, request: Any, group: WorkerGroup) -> None:
        """Make room on the devices for `request`'s weights: while every resident model's weights and the
        new one's would not fit together (`RESIDENT_SHARE` of the smallest device's memory), park the
        modules that may wait in host memory (parking.py; they then hold no device memory), then unload
        the least recently used other slots."""
        others = [
            s
            for s, r in self.residents.items()
            if s != request.slot and self._loaded_in.get(s) is group and s not in self.parked
        ]
        if not others:
            return
        limit = self._encode_limit() if parkable(request) else self._weight_limit()
        if limit is None:
            return
        held = {s: weight_bytes_per_rank(self.residents[s], self.devices[0]) for s in others}
        need = weight_bytes_per_rank(request, self.devices[0])
        if self._parking_frees_memory():
            for slot in to_park(((s, self.residents[s]) for s in others), self.parked, self.park_policy):
                if sum(held.values()) + need <= limit:
                    return
                self._place(slot, group, on_device=False)
                held.pop(slot)
        for slot in [s for s in others if s in held]:  # least recently used first
            if sum(held.values()) + need <= limit:
                return
            dropped = self.residents[slot]
            with contextlib.suppress(WorkerError):
                group.call_all("unload_slot", UnloadRequest(slot))
            self._forget(slot)
            held.pop(slot)
            self.evicted.append(
                f"unloaded {os.path.basename(dropped.checkpoint)} ({slot}) to make room for "
                f"{os.path.basename(request.checkpoint)}: their weights ({(sum(held.values()) + need) / GB:.1f} GB "
                f"with the rest) would not fit {limit / GB:.1f} GB per device together"
            )

    def _weight_limit(self) -> float | None:
        """Bytes per rank the weights of all resident models may take together, or None when unknown (a
        GPU group that has not reported its memory yet)."""
        if self.devices[0] == "cpu":
            memory = psutil.virtual_memory()
            held = sum(r.parameter_bytes for r in self._last_status)
            return (memory.available + held) * RESIDENT_SHARE / len(self.devices)
        totals = [r.memory.total_gb for r in self._last_status if r.memory is not None]
        return min(totals) * GB * RESIDENT_SHARE if totals else None

    def _encode_limit(self) -> float | None:
        """Bytes per rank the weights may take together while a parkable module (a text encoder) runs: the
        planner's bound for its "host" placement (plan/encoder.py: `MARGIN` of the smallest GPU less ComfyUI's
        own share on GPU 0), not `RESIDENT_SHARE`, which keeps room for sampling activations that an encode does
        not have (a job that needs them parks the encoder first: `make_headroom`)."""
        if not self._parking_frees_memory():
            return self._weight_limit()
        totals = [r.memory.total_gb for r in self._last_status if r.memory is not None]
        return min(totals) * GB * MARGIN - COMFYUI_GPU0 if totals else None

    def unload(self, slot: str | None = None) -> None:
        """Free the model in `slot` (every model when None) on every device; the worker group stays up."""
        with self._lock:
            if self.started:
                if slot is None:
                    self.group.call_all("unload")
                else:
                    self.group.call_all("unload_slot", UnloadRequest(slot))
            for name in list(self.residents) if slot is None else [slot]:
                self._forget(name)

    def status(self) -> list[RankStatus]:
        """Each rank's device, resident models and memory. While a job runs (another thread), the last
        report, each marked `busy`, instead of waiting for the job."""
        if not self._lock.acquire(blocking=False):
            return [dataclasses.replace(r, busy=True) for r in self._last_status]
        try:
            if not self.started:
                return []
            self._last_status = self.group.call_all("status")
            return self._last_status
        finally:
            self._lock.release()


def weight_bytes_per_rank(request: Any, device: str) -> int:
    """Parameter bytes one rank holds for `request`: its own count (`weight_bytes_on(device)`: a diffusion
    model's, the planner's exact count for its layout and dtypes) or the number it carries (`weight_bytes`)."""
    count = getattr(request, "weight_bytes_on", None)
    return int(count(device)) if count is not None else int(request.weight_bytes)


def _load_method(request: Any) -> str:
    """The worker method that makes `request` resident: 'load' for a model, the module's own otherwise."""
    return getattr(request, "load_method", "load")
