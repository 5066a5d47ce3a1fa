"""A worker group with one model resident on every rank: the part of `ParallelFlux` that starts the
group, loads, re-loads after a failure, unloads, reports status and plans 'auto' layouts.

`ParallelFlux` (api.py) adds what runs on the resident model: `forward` and `sample`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Sequence

import torch

from .auto import choose_layout, make_layout, measure_machine
from .checkpoint import (
    CheckpointInfo,
    check_loras,
    check_weight_dtype,
    inspect_checkpoint,
    planned_weight_dtype,
    resolve_dtype,
)
from .client import ProgressCallback, WorkerError, WorkerGroup, check_group_options, validate_devices
from .compile import compile_mode
from .config import FluxDims, ParallelLayout, weight_dtype_name
from .forward_client import ForwardClient
from .messages import LinkReport, LoadReport, LoadRequest, RankStatus
from .plan import Choice
from .platforms import DeviceSpec, parse_devices

Checkpoint = str | os.PathLike[str] | CheckpointInfo  # a path, or its header as inspect_checkpoint read it


def default_devices() -> list[str]:
    """All visible GPUs (ROCm GPUs are 'cuda' devices in torch); an error naming the torch build when
    there is none (CPU workers are for testing: ask for them, e.g. ParallelFlux(["cpu", "cpu"]))."""
    return list(parse_devices("all"))


class ResidentGroup:
    """A worker group (started on first use, started again after a failure closed it) and the one model
    all its ranks hold: `resident`, the `LoadRequest` every rank answered, or None.

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
        self.resident: LoadRequest | None = None  # what every rank holds
        self._loaded_in: WorkerGroup | None = None
        self.auto_choice: Choice | None = None  # the latest 'auto' decision; .explanation for the node
        self._machine: tuple[WorkerGroup, LinkReport] | None = None
        self._lock = threading.RLock()
        self._last_status: list[RankStatus] = []
        self._forwards = ForwardClient()  # what the ranks hold for `forward`

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
            self._group, self._loaded_in = None, None

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
        dims: FluxDims,
        width: int = 1024,
        height: int = 1024,
        batch: int = 1,
        dtype: str | None = None,
        context_only: bool = False,
        weight_dtype: str = "compute",
        family: str = "flux1",
        reference_tokens: int = 0,
        fixed: dict[str, int] | None = None,
    ) -> Choice:
        """The planner's layout for this image on these devices; `.explanation` is one line for the node.

        `batch` is the model call's batch (`plan.call_batch`: the images, twice them when cond and uncond
        run together at cfg != 1): the planner never picks a batch degree above it. `context_only` keeps
        tp at 1 (the Ring Attention Sampler's auto); `fixed` keeps other degrees too ({"batch": 2}).
        `weight_dtype`: the planner's name ('compute', 'fp8_e4m3fn', 'fp8_e5m2'; see
        `load.planned_weight_dtype` for a checkpoint's 'default'). `family` is the checkpoint's model
        family (CheckpointInfo.family): FLUX.2's shapes and text length differ. `reference_tokens`: the
        image tokens of Kontext / FLUX.2 reference latents, which every step carries next to the image's.
        """
        keep = {**(fixed or {}), **({"tp": 1} if context_only else {})}
        self.auto_choice = choose_layout(
            self.machine(), self.devices, dims, width, height, batch, dtype=dtype, fixed=keep,
            weight_dtype=weight_dtype, family=family, reference_tokens=reference_tokens,
        )  # fmt: skip
        return self.auto_choice

    # ------------------------------------------------------------------ model

    def load(
        self,
        checkpoint: Checkpoint,
        *,
        layout: str | ParallelLayout = "tp",
        ring: int | None = None,
        ulysses: int | None = None,
        dtype: str | None = None,
        weight_dtype: str | None = None,
        attention: str | None = None,
        loras: Sequence[tuple[str | os.PathLike[str], float]] = (),
        progress: ProgressCallback | None = None,
        timeout: float | None = None,
        compile: str | None = "off",
    ) -> list[LoadReport]:
        """Make `checkpoint` resident in `layout`; reuses what is already there.

        `layout`: 'tp' (every device shards the weights), 'context' (ring x Ulysses: `ring` / `ulysses`,
        None or 0 filling the rest), degrees such as 'batch 2 x tp 2' or 'tp2xring2' (a ParallelLayout's
        `str`; the product is the device count), a ParallelLayout, or 'auto' (the planner's choice).
        `ring` / `ulysses` go with 'context' only: with anything else they are refused.

        `checkpoint`: a path, or the CheckpointInfo a caller read from it already (the header is read once
        per run and carried to the workers, which do not read it again).
        'auto' plans for a 1024x1024 image; `sample(layout='auto')` re-plans for the latent's size.
        `loras`: (path, strength) pairs applied in order on top (each rank patches its own shard); when
        only they change, the workers re-read just the affected tensors from the checkpoint and apply
        the new set, so `loras=()` gives back the checkpoint's weights bit for bit. Reports then carry
        `lora_tensors` (tensors rewritten) and `lora_seconds`.
        `dtype` is the compute dtype; `weight_dtype` how linear weights stay resident: 'default' (None:
        an fp8 file's weights stay fp8), 'fp8_e4m3fn' / 'fp8_e5m2' (converted at load), 'compute' (upcast
        at load). fp8 weights are upcast per layer: same outputs, half the bytes of bf16. A LoRA-patched
        weight is held in the compute dtype (flux/lora.py says why).
        `progress(done, total)` runs as the tensors arrive; raising from it stops the load between
        tensors on every rank (nothing stays resident then). Returns each rank's report (its status after
        the load: device, parameter bytes, memory; and whether the model was reused).
        `compile`: 'inductor' compiles the repeated transformer blocks on every rank (compile.py; the first
        call of each new input size pays the compile, `compiles` names those calls), 'aot_eager' traces
        them without generating code, 'off' (the default) runs eager. Changing it re-loads the model.
        """
        with self._lock:
            request = self.check_load(
                checkpoint, layout=layout, ring=ring, ulysses=ulysses, dtype=dtype, weight_dtype=weight_dtype,
                loras=loras, compile=compile,
            )  # fmt: skip
            return self._load_resident(dataclasses.replace(request, attention=attention), progress, timeout)

    def check_load(
        self,
        checkpoint: Checkpoint,
        *,
        layout: str | ParallelLayout = "tp",
        ring: int | None = None,
        ulysses: int | None = None,
        dtype: str | None = None,
        weight_dtype: str | None = None,
        loras: Sequence[tuple[str | os.PathLike[str], float]] = (),
        compile: str | None = "off",
    ) -> LoadRequest:
        """Validate a load from the checkpoint's and LoRAs' headers alone: no worker starts (except to
        measure the link for 'auto'), nothing is unloaded. Raises ConfigError naming the input; returns
        the request the workers would get."""
        weight_dtype_name(weight_dtype)  # a bad name fails before the checkpoint is read
        compiled = compile_mode(compile)
        info = checkpoint if isinstance(checkpoint, CheckpointInfo) else inspect_checkpoint(checkpoint)
        checked = check_loras(loras, info)
        resolve_dtype(dtype, self.devices[0])  # a bad dtype fails here, before anything is unloaded
        weights = check_weight_dtype(weight_dtype, info)
        if layout == "auto":
            planned = planned_weight_dtype(weights, info)
            layout = self.auto_layout(info.dims, dtype=dtype, weight_dtype=planned, family=info.family).layout
        parallel = make_layout(layout, len(self.devices), ring, ulysses)
        parallel.validate(info.dims, devices=len(self.devices))
        path = info.path if isinstance(checkpoint, CheckpointInfo) else str(checkpoint)
        return LoadRequest(path, info, parallel, dtype, weights, None, checked, compiled)

    def _load_resident(
        self, request: LoadRequest, progress: ProgressCallback | None = None, timeout: float | None = None
    ) -> list[LoadReport]:
        """Load on the workers; `self.resident` names the request only once every rank holds it."""
        group = self.group
        self.resident, self._loaded_in = None, None  # the workers drop what they held first
        try:
            reports = group.call_all("load", request, timeout=timeout, progress=progress)
        except BaseException:
            # Loading has no collectives, so a cancel or a one-rank failure can leave some ranks holding
            # the new model and others nothing: drop it everywhere, so no rank holds what no record names.
            if group.alive:
                with contextlib.suppress(WorkerError):
                    group.call_all("unload")
            raise
        self.resident, self._loaded_in = request, group
        self._last_status, self._forwards = reports, ForwardClient()
        return reports

    def _resident_group(self, request: LoadRequest) -> WorkerGroup:
        """The group holding `request`, loading it first when the ranks hold something else (or the
        group was restarted after a failure)."""
        if request != self.resident or self._loaded_in is not self._group or not self.started:
            self._load_resident(request)
        return self.group

    def unload(self) -> None:
        """Free the model on every device; the worker group stays up."""
        with self._lock:
            if self.started:
                self.group.call_all("unload")
            self.resident, self._loaded_in = None, None

    def status(self) -> list[RankStatus]:
        """Each rank's device, resident model and memory. While a job runs (another thread), the last
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

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the workers compute in (the resident load's, else the default for the devices)."""
        return resolve_dtype(self.resident.dtype if self.resident else None, self.devices[0])
