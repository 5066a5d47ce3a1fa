"""A worker group with models resident on every rank: the part of `ParallelModel` that starts the group,
loads, re-loads after a failure, unloads, reports status and plans 'auto' layouts.

A group keeps several models resident at once, each in its own slot (a ComfyUI graph with two models, such
as Wan 2.2's high- and low-noise experts or a text encoder beside a diffusion model, keeps both): each slot
has its own layout, shards, LoRA state and conditioning. `ParallelModel` (api.py) adds what runs on a
resident model: `forward` and `sample`; a call names its slot, the default one when it does not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import psutil
import torch

from . import admission
from .auto import choose_layout, make_layout, measure_machine
from .checkpoint import (
    CheckpointInfo,
    check_loras,
    check_weight_dtype,
    inspect_checkpoint,
    planned_file_weights,
    planned_weight_dtype,
    resolve_dtype,
)
from .checkpoint.gguf import check_block_splits
from .checkpoint.lora.values import refuse_foreign_loras
from .client import ProgressCallback, WorkerError, WorkerGroup, check_group_options, validate_devices
from .compile import compile_mode
from .config import ConfigError, ModelDims, ParallelLayout, weight_dtype_name
from .dtypes import WEIGHT_DTYPES, compute_dtype_named
from .forward_client import ForwardClient
from .messages import DEFAULT_SLOT, LinkReport, LoadReport, LoadRequest, RankStatus, UnloadRequest
from .parking import check_policy, parkable, to_park
from .plan import Choice
from .plan.encoder import COMFYUI_GPU0, MARGIN
from .plan.setup import FileWeights, held_bytes
from .platforms import DeviceSpec, parse_devices
from .text import GB

Checkpoint = str | os.PathLike[str] | CheckpointInfo  # a path, or its header as inspect_checkpoint read it


def default_devices() -> list[str]:
    """All visible GPUs (ROCm GPUs are 'cuda' devices in torch); an error naming the torch build when
    there is none (CPU workers are for testing: ask for them, e.g. ParallelModel(["cpu", "cpu"]))."""
    return list(parse_devices("all"))


Loras = Sequence[tuple[str | os.PathLike[str], float]]

# Of a device's memory (a GPU's, or the host's for CPU workers), the share the weights of every resident
# model may take together before the least recently used is unloaded for a new one: the rest is for
# activations, the runtime and (on GPU 0) ComfyUI's own models.
RESIDENT_SHARE = 0.75


@dataclasses.dataclass(frozen=True)
class LoadOptions:
    """How to make a checkpoint resident: one record for `load`, `check_load`, the nodes and the checks.

    `layout`: 'tp' (every device shards the weights), 'context' (ring x Ulysses: `ring` / `ulysses`, None or
    0 filling the rest), degrees such as 'batch 2 x tp 2' (a ParallelLayout's `str`; the product is the
    device count), a ParallelLayout, or 'auto' (the planner's choice). `ring` / `ulysses` go with 'context'
    only: with anything else they are refused. `dtype` is the compute dtype; `weight_dtype` how linear
    weights stay resident ('default' (None): an fp8 file's stay fp8; 'fp8_e4m3fn' / 'fp8_e5m2': converted at
    load; 'compute': upcast at load). `attention` overrides the attention kernel. `loras`: (path, strength)
    pairs applied in order on top (each rank patches its own shard). `compile`: 'inductor' / 'aot_eager'
    compile the repeated blocks (compile.py), 'off' runs eager. `slot`: which of the group's resident
    models this is (several stay resident, one per slot).
    """

    layout: str | ParallelLayout = "tp"
    ring: int | None = None
    ulysses: int | None = None
    dtype: str | None = None
    weight_dtype: str | None = None
    attention: str | None = None
    loras: tuple[tuple[str, float], ...] = ()
    compile: str | None = "off"
    slot: str = DEFAULT_SLOT

    @classmethod
    def make(cls, options: LoadOptions | None = None, **given: Any) -> LoadOptions:
        """`options` with `given` fields replaced (LoRAs as a tuple of (path, strength) pairs)."""
        if "loras" in given:
            given["loras"] = tuple((os.fspath(path), strength) for path, strength in given["loras"] or ())
        unknown = sorted(set(given) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ConfigError(
                f"{', '.join(unknown)} is not a load option; use {', '.join(f.name for f in dataclasses.fields(cls))}"
            )
        return dataclasses.replace(options or cls(), **given)


class ResidentGroup:
    """A worker group (started on first use, started again after a failure closed it) and the models its
    ranks hold: `residents`, slot -> the `LoadRequest` every rank answered (`resident`: the default slot's).

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
        self.residents: OrderedDict[str, LoadRequest] = OrderedDict()
        self._loaded_in: dict[str, WorkerGroup] = {}
        self.auto_choice: Choice | None = None  # the latest 'auto' decision; .explanation for the node
        self._machine: tuple[WorkerGroup, LinkReport] | None = None
        self._lock = threading.RLock()
        self._last_status: list[RankStatus] = []
        self._forwards: dict[str, ForwardClient] = {}  # what the ranks hold for `forward`, per slot
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

    # ------------------------------------------------------------------ auto

    def machine(self) -> LinkReport:
        """Link bandwidth/latency, device TFLOPS and memory, measured once per worker group (probe.py)."""
        group = self.group
        if self._machine is None or self._machine[0] is not group:
            self._machine = (group, measure_machine(group))
        return self._machine[1]

    def auto_layout(
        self,
        dims: ModelDims,
        width: int = 1024,
        height: int = 1024,
        batch: int = 1,
        dtype: str | None = None,
        context_only: bool = False,
        weight_dtype: str = "compute",
        family: str | None = None,
        reference_tokens: int = 0,
        fixed: dict[str, int] | None = None,
        frames: int = 1,
        file_weights: FileWeights | None = None,
    ) -> Choice:
        """The planner's layout for this image (or video: `frames`) on these devices; `.explanation` is one
        line for the node.

        `batch` is the model call's batch (`plan.call_batch`: the images, twice them when cond and uncond
        run together at cfg != 1): the planner never picks a batch degree above it. `context_only` keeps
        tp at 1 (the Ring Attention Sampler's auto); `fixed` keeps other degrees too ({"batch": 2}).
        `weight_dtype`: the planner's name ('compute', 'fp8_e4m3fn', 'fp8_e5m2'; see
        `load.planned_weight_dtype` for a checkpoint's 'default'). `family` is the checkpoint's model
        family (CheckpointInfo.family; the first registered one when None). `reference_tokens`: the image
        tokens of reference latents, which every step carries next to the image's. `file_weights`: the
        checkpoint's linear weights tensor by tensor (`checkpoint.planned_file_weights`): priced as held, and
        no TP degree that would cut a GGUF file's quantization blocks is picked.
        """
        keep = {**(fixed or {}), **({"tp": 1} if context_only else {})}
        self.auto_choice = choose_layout(
            self.machine(), self.devices, dims, width, height, batch, dtype=dtype, fixed=keep,
            weight_dtype=weight_dtype, family=family, reference_tokens=reference_tokens, frames=frames,
            file_weights=file_weights,
        )  # fmt: skip
        return self.auto_choice

    # ------------------------------------------------------------------ models

    @property
    def resident(self) -> LoadRequest | None:
        """What the default slot holds (the one model of a caller that keeps one), or None."""
        return self.residents.get(DEFAULT_SLOT)

    def load(
        self,
        checkpoint: Checkpoint,
        options: LoadOptions | None = None,
        *,
        progress: ProgressCallback | None = None,
        timeout: float | None = None,
        **given: Any,
    ) -> list[LoadReport]:
        """Make `checkpoint` resident as `options` (a LoadOptions, and/or its fields as keywords: `layout`,
        `ring`, `ulysses`, `dtype`, `weight_dtype`, `attention`, `loras`, `compile`, `slot`) say; reuses
        what is already there.

        `checkpoint`: a path, or the CheckpointInfo a caller read from it already (the header is read once
        per run and carried to the workers, which do not read it again).
        'auto' plans for a 1024x1024 image; `sample(layout='auto')` re-plans for the latent's size.
        When only the LoRAs change, the workers re-read just the affected tensors from the checkpoint and
        apply the new set, so `loras=()` gives back the checkpoint's weights bit for bit. Reports then carry
        `lora_tensors` (tensors rewritten) and `lora_seconds`. fp8 weights are upcast per layer: same
        outputs, half the bytes of bf16. A LoRA-patched weight is held in the compute dtype.
        Another slot's model stays resident, unless the weights of all of them would not fit the devices
        together: the least recently used are unloaded first (`evicted` says so).
        `progress(done, total)` runs as the tensors arrive; raising from it stops the load between
        tensors on every rank (nothing stays resident in that slot then). Returns each rank's report (its
        status after the load: device, parameter bytes, memory; and whether the model was reused).
        Changing `compile` re-loads the model.
        """
        with self._lock:
            request = self.check_load(checkpoint, options, **given)
            return self._load_resident(request, progress, timeout)

    def check_load(
        self, checkpoint: Checkpoint, options: LoadOptions | None = None, **given: Any
    ) -> LoadRequest:
        """Validate a load from the checkpoint's and LoRAs' headers alone: no worker starts (except to
        measure the link for 'auto'), nothing is unloaded. Raises ConfigError naming the input; returns
        the request the workers would get."""
        opts = LoadOptions.make(options, **given)
        weight_dtype_name(opts.weight_dtype)  # a bad name fails before the checkpoint is read
        compiled = compile_mode(opts.compile)
        if not isinstance(opts.slot, str) or not opts.slot:
            raise ConfigError(f"slot={opts.slot!r} must be a non-empty name")
        if opts.layout != "auto":  # needs no file: refused before the header is read (that imports diffusers)
            make_layout(opts.layout, len(self.devices), opts.ring, opts.ulysses).check_devices(
                len(self.devices)
            )
        # an SDXL LoRA or a model checkpoint given as a LoRA: named before the checkpoint's header is read
        refuse_foreign_loras(opts.loras)
        info = checkpoint if isinstance(checkpoint, CheckpointInfo) else inspect_checkpoint(checkpoint)
        checked = check_loras(opts.loras, info)
        resolve_dtype(opts.dtype, self.devices[0])  # a bad dtype fails here, before anything is unloaded
        weights = check_weight_dtype(opts.weight_dtype, info)
        layout = opts.layout
        if layout == "auto":
            planned = planned_weight_dtype(weights, info)
            layout = self.auto_layout(
                info.dims, dtype=opts.dtype, weight_dtype=planned, family=info.family,
                file_weights=planned_file_weights(weights, info),
            ).layout  # fmt: skip
        parallel = make_layout(layout, len(self.devices), opts.ring, opts.ulysses)
        parallel.validate(info.dims, devices=len(self.devices))
        # GGUF: each rank must hold whole quantization blocks
        check_block_splits(info, parallel.tp, devices=len(self.devices))
        path = info.path if isinstance(checkpoint, CheckpointInfo) else str(checkpoint)
        return LoadRequest(
            path, info, parallel, opts.dtype, weights, opts.attention, checked, compiled, slot=opts.slot
        )

    def _load_resident(
        self, request: LoadRequest, progress: ProgressCallback | None = None, timeout: float | None = None
    ) -> list[LoadReport]:
        """Load on the workers; `residents` names the request only once every rank holds it."""
        group = self.group
        slot = request.slot
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
        if isinstance(request, LoadRequest):  # a resident module (a VAE) takes no model calls
            self._forwards[slot] = ForwardClient(request.info.model_family.call_spec, slot)
        self._residency_changed()
        return reports

    def _forget(self, slot: str) -> None:
        self.residents.pop(slot, None)
        self._loaded_in.pop(slot, None)
        self._forwards.pop(slot, None)
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

    def _make_room(self, request: LoadRequest, group: WorkerGroup) -> None:
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

    def _slot_request(self, slot: str | None) -> LoadRequest:
        """The request resident in `slot` (the default one when None), or ConfigError naming what is."""
        name = DEFAULT_SLOT if slot is None else slot
        request = self.residents.get(name)
        if request is None:
            if not self.residents:
                raise ConfigError("no checkpoint is loaded; call load(checkpoint) first")
            raise ConfigError(
                f"no checkpoint is loaded in slot {name!r}; loaded: {', '.join(map(repr, self.residents))}"
            )
        return request

    def compute_dtype_of(self, slot: str | None = None) -> torch.dtype:
        """The dtype the workers compute the slot's model in (its load's, else the devices' default)."""
        request = self.residents.get(DEFAULT_SLOT if slot is None else slot)
        return resolve_dtype(request.dtype if request else None, self.devices[0])

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the workers compute in (the default slot's load's, else the devices' default)."""
        return self.compute_dtype_of(None)


def weight_bytes_per_rank(request: Any, device: str) -> int:
    """Parameter bytes one rank holds for `request` (the planner's exact count for its layout and dtypes; a
    resident module's request says its own)."""
    from .plan import weight_bytes

    if not isinstance(request, LoadRequest):
        return int(request.weight_bytes)

    info = request.info
    compute = str(resolve_dtype(request.dtype, device)).removeprefix("torch.")
    planned = planned_weight_dtype(request.weight_dtype, info)
    fp8 = WEIGHT_DTYPES.get(planned)
    bytes_ = compute_dtype_named(compute).bytes
    # each linear weight as the file holds it (a GGUF file mixing Q4_K and Q6_K), the rest as `planned`
    held = planned_file_weights(request.weight_dtype, info)
    return weight_bytes(
        info.dims,
        request.layout,
        bytes_,
        family=info.family,
        linear_bytes=fp8.bytes if fp8 is not None else None,
        linear_bytes_of={name: held_bytes(h, bytes_) for name, h in held.held},
    )


def _load_method(request: Any) -> str:
    """The worker method that makes `request` resident: 'load' for a model, the module's own otherwise."""
    return getattr(request, "load_method", "load")
