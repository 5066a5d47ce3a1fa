"""The public Python API: a parallel FLUX that stays resident between jobs. The nodes use it too.

>>> from rocm_parallel.backend.api import ParallelFlux
>>> with ParallelFlux(["cuda:0", "cuda:1"]) as flux:
...     flux.load("models/diffusion_models/flux1-dev.safetensors", layout="tp")
...     out = flux.sample(positive, {"samples": latent}, seed=0, steps=20)

Everything a user can get wrong is checked here, in the caller's process, before any worker starts or
any step runs: devices, checkpoint, layout, latent, conditioning, schedule.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

from .checkpoint import (
    CheckpointInfo,
    check_loras,
    check_weight_dtype,
    inspect_checkpoint,
    planned_weight_dtype,
    resolve_dtype,
)
from .client import ProgressCallback, WorkerError, WorkerGroup, validate_devices
from .config import ConfigError, FluxDims, ParallelLayout, weight_dtype_name
from .family import get_family
from .flux.forward import REF_METHODS
from .flux.sampling import LATENT_CHANNELS, SamplingPlan, plan_sampling
from .plan import Choice, Link, Setup, choose
from .platforms import parse_devices
from .service import ConditioningSender, ForwardPace

SAMPLED_FAMILY = "flux1"  # sample() is FLUX.1's euler/simple loop (flux/sampling.py)


def default_devices() -> list[str]:
    """All visible GPUs (ROCm GPUs are 'cuda' devices in torch); an error naming the torch build when
    there is none (CPU workers are for testing: ask for them, e.g. ParallelFlux(["cpu", "cpu"]))."""
    return list(parse_devices("all"))


def make_layout(
    kind: str | ParallelLayout,
    devices: int,
    ring: int | None = None,
    ulysses: int | None = None,
    setup: Setup | None = None,
) -> ParallelLayout:
    """`ParallelLayout.make(kind, devices, ring, ulysses)`, plus 'auto' → the planner's choice for `setup`
    (see ParallelFlux.auto_layout, which also explains it)."""
    if isinstance(kind, ParallelLayout):
        return kind
    if kind == "auto" and setup is not None:
        return choose(setup).layout
    return ParallelLayout.make(kind, devices, ring, ulysses)


def plan_to_data(plan: SamplingPlan) -> dict[str, Any]:
    """Plain data for the workers (no class identity crosses the process boundary)."""
    data = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan) if f.name != "cond"}
    data["cond"] = {f.name: getattr(plan.cond, f.name) for f in dataclasses.fields(plan.cond)}
    return data


@dataclasses.dataclass(frozen=True)
class Resident:
    """What the workers hold: a checkpoint in a layout, with LoRAs ((path, strength), applied in order).

    `dtype` is the compute dtype (None: the devices' default), `weight_dtype` how the linear weights are
    held (config.WEIGHT_DTYPE_BYTES: 'default', 'fp8_e4m3fn', 'fp8_e5m2', 'compute').
    """

    checkpoint: str
    info: CheckpointInfo
    layout: ParallelLayout
    dtype: str | None
    attention: str | None
    loras: tuple[tuple[str, float], ...] = ()
    weight_dtype: str = "default"


class ParallelFlux:
    """A FLUX transformer spread over several devices, resident in a worker group between jobs.

    A failed job (a rank failed while its peers waited for it, a worker died, stopped answering or ran
    past its time limit) closes the group; the next call starts a fresh one and loads the same checkpoint
    again, so a caller never has to clean up. Every job runs under the group's default watchdog
    (`client.DEFAULT_WATCHDOG`), so a hung GPU fails the job without the caller passing `timeout`.

    Thread-safe: calls from several threads run one at a time; `status()` never waits for a running
    job (it answers from the last report, marked busy).
    """

    def __init__(
        self,
        devices: Sequence[str] | None = None,
        *,
        threads: int | None = None,
        start_timeout: float = 300.0,
        group: WorkerGroup | None = None,
        backend: str | None = None,
    ) -> None:
        """`group` adopts a running WorkerGroup (tests share one); otherwise one starts on first use.
        `backend='gloo'` runs GPU collectives through gloo (no NCCL/RCCL; several workers on one GPU)."""
        if group is not None:
            devices, backend = group.devices, group.backend
        self.backend = backend
        self.devices = validate_devices(devices if devices is not None else default_devices(), backend)
        self.threads, self.start_timeout = threads, start_timeout
        self._group: WorkerGroup | None = group
        self.resident: Resident | None = None
        self._loaded_in: WorkerGroup | None = None
        self.auto_choice: Choice | None = None  # the latest 'auto' decision; .explanation for the node
        self._machine: tuple[WorkerGroup, dict[str, Any]] | None = None
        self._lock = threading.RLock()
        self._last_status: list[dict[str, Any]] = []
        self._conditioning = ConditioningSender()  # what the ranks hold for `forward`
        self._pace = ForwardPace()
        self.last_forward_seconds = 0.0  # the ranks' own time for the latest `forward` (rank 0)

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
    def started(self) -> bool:
        return self._group is not None and self._group.alive

    def close(self) -> None:
        with self._lock:
            if self._group is not None:
                self._group.close()
            self._group, self._loaded_in = None, None

    def __enter__(self) -> ParallelFlux:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ auto

    def machine(self) -> dict[str, Any]:
        """Link bandwidth/latency, device TFLOPS and memory, measured once per worker group (probe.py)."""
        group = self.group
        if self._machine is None or self._machine[0] is not group:
            reports = group.call_all("measure_link")
            first = reports[0]
            self._machine = (group, {**first, "memory_bytes": min(r["memory_bytes"] for r in reports)})
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
    ) -> Choice:
        """The planner's layout for this image on these devices; `.explanation` is one line for the node.

        `context_only` chooses among ring x Ulysses splits only (the Ring Attention Sampler's auto).
        `weight_dtype`: the planner's name ('compute', 'fp8_e4m3fn', 'fp8_e5m2'; see
        `load.planned_weight_dtype` for a checkpoint's 'default'). `family` is the checkpoint's model
        family (CheckpointInfo.family): FLUX.2's shapes and text length differ. `reference_tokens`: the
        image tokens of Kontext / FLUX.2 reference latents, which every step carries next to the image's.
        """
        m = self.machine()
        cpu = self.devices[0].startswith("cpu")
        link = Link(
            m.get("gbps", 1.0),
            m.get("latency_us", 0.0),
            measured="gbps" in m,
            name="gloo (CPU)" if cpu else "link",
        )
        compute = str(resolve_dtype(dtype, self.devices[0])).removeprefix("torch.")
        setup = Setup(
            dims, width, height, batch, dtype=compute, devices=len(self.devices),
            memory_gb=m["memory_bytes"] / 1e9, link=link, tflops=m["tflops"],
            device_word="CPU worker" if cpu else "GPU", weight_dtype=weight_dtype, family=family,
            text_tokens=get_family(family).text.tokens, reference_tokens=reference_tokens,
        )  # fmt: skip
        self.auto_choice = choose(setup, allow=(lambda lay: lay.tp == 1) if context_only else None)
        return self.auto_choice

    # ------------------------------------------------------------------ model

    def load(
        self,
        checkpoint: str | os.PathLike[str],
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
    ) -> list[dict[str, Any]]:
        """Make `checkpoint` resident in `layout` ('tp', 'context' or 'auto'); reuses what is already there.

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
        tensors on every rank (nothing stays resident then). Returns each rank's status (device,
        parameter bytes, memory).
        """
        with self._lock:
            resident = self.check_load(
                checkpoint, layout=layout, ring=ring, ulysses=ulysses, dtype=dtype, weight_dtype=weight_dtype,
                loras=loras,
            )  # fmt: skip
            return self._load_resident(dataclasses.replace(resident, attention=attention), progress, timeout)

    def check_load(
        self,
        checkpoint: str | os.PathLike[str],
        *,
        layout: str | ParallelLayout = "tp",
        ring: int | None = None,
        ulysses: int | None = None,
        dtype: str | None = None,
        weight_dtype: str | None = None,
        loras: Sequence[tuple[str | os.PathLike[str], float]] = (),
    ) -> Resident:
        """Validate a load from the checkpoint's and LoRAs' headers alone: no worker starts (except to
        measure the link for 'auto'), nothing is unloaded. Raises ConfigError naming the input; returns
        the plan."""
        weight_dtype_name(weight_dtype)  # a bad name fails before the checkpoint is read
        info = inspect_checkpoint(checkpoint)
        checked = check_loras(loras, info)
        resolve_dtype(dtype, self.devices[0])  # a bad dtype fails here, before anything is unloaded
        weights = check_weight_dtype(weight_dtype, info)
        if layout == "auto":
            planned = planned_weight_dtype(weights, info)
            layout = self.auto_layout(info.dims, dtype=dtype, weight_dtype=planned, family=info.family).layout
        parallel = make_layout(layout, len(self.devices), ring, ulysses)
        parallel.validate(info.dims, devices=len(self.devices))
        return Resident(str(checkpoint), info, parallel, dtype, None, checked, weights)

    def _load_resident(
        self, r: Resident, progress: ProgressCallback | None = None, timeout: float | None = None
    ) -> list[dict[str, Any]]:
        """Load `r` on the workers; `self.resident` names it only once every rank holds it."""
        group = self.group
        self.resident, self._loaded_in = None, None  # the workers drop what they held first
        kwargs = {
            "checkpoint": r.checkpoint,
            "dtype": r.dtype,
            "weight_dtype": r.weight_dtype,
            "tp": r.layout.tp,
            "ring": r.layout.ring,
            "ulysses": r.layout.ulysses,
            "attention": r.attention,
            "loras": [list(lora) for lora in r.loras],
        }
        try:
            reports = group.call_all("load", kwargs, timeout=timeout, progress=progress)
        except BaseException:
            # Loading has no collectives, so a cancel or a one-rank failure can leave some ranks holding
            # the new model and others nothing: drop it everywhere, so no rank holds what no record names.
            if group.alive:
                with contextlib.suppress(WorkerError):
                    group.call_all("unload")
            raise
        self.resident, self._loaded_in = r, group
        self._last_status = reports
        self._conditioning, self._pace = ConditioningSender(), ForwardPace()
        return reports

    def unload(self) -> None:
        """Free the model on every device; the worker group stays up."""
        with self._lock:
            if self.started:
                self.group.call_all("unload")
            self.resident, self._loaded_in = None, None

    def status(self) -> list[dict[str, Any]]:
        """Each rank's device, resident model and memory. While a job runs (another thread), the last
        report, each marked `busy`, instead of waiting for the job."""
        if not self._lock.acquire(blocking=False):
            return [{**r, "busy": True} for r in self._last_status]
        try:
            if not self.started:
                return []
            self._last_status = self.group.call_all("status")
            return self._last_status
        finally:
            self._lock.release()

    # ------------------------------------------------------------------ jobs

    @staticmethod
    def check_sample(
        positive: Any,
        latent: dict[str, Any],
        *,
        checkpoint: str | os.PathLike[str] | CheckpointInfo,
        seed: int,
        steps: int,
        denoise: float = 1.0,
        sigmas: Sequence[float] | torch.Tensor | None = None,
        shift_mu: float | None = None,
    ) -> SamplingPlan:
        """Validate a sampling job against the checkpoint's header alone: no worker starts, nothing loads.

        Raises ConfigError naming the input, the value and the fix; returns the decided plan.
        """
        info = checkpoint if isinstance(checkpoint, CheckpointInfo) else inspect_checkpoint(checkpoint)
        if not isinstance(latent, dict) or "samples" not in latent:
            raise ConfigError("latent must be a LATENT dict with 'samples' [batch, 16, height/8, width/8]")
        if info.family != SAMPLED_FAMILY:
            raise ConfigError(
                f"sample() runs FLUX.1's euler/simple loop; {info.model_name} is sampled by ComfyUI's own "
                "samplers on the ROCm Parallel Model (Flux2Scheduler + SamplerCustomAdvanced), or step by "
                "step with forward()"
            )
        if info.input_channels != LATENT_CHANNELS:
            raise ConfigError(
                f"{info.model_name} takes the masked image and mask in every step ({info.input_channels} input "
                "channels), which sample() does not supply: drive it step by step with forward() (in ComfyUI: "
                "the ROCm Parallel Model with InpaintModelConditioning and KSampler)"
            )
        dims = info.dims
        return plan_sampling(
            latent["samples"],
            positive,
            seed,
            steps,
            denoise,
            sigmas,
            latent.get("noise_mask"),
            latent.get("batch_index"),
            variant=info.variant,
            shift_mu=shift_mu,
            text_dim=dims.text_dim,
            pooled_dim=dims.pooled_dim,
        )

    def sample(
        self,
        positive: Any,
        latent: dict[str, Any],
        *,
        seed: int,
        steps: int,
        denoise: float = 1.0,
        sigmas: Sequence[float] | torch.Tensor | None = None,
        shift_mu: float | None = None,
        layout: str | ParallelLayout | None = None,
        ring: int | None = None,
        ulysses: int | None = None,
        progress: ProgressCallback | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """ComfyUI's `KSampler(euler, simple, cfg 1.0)` on the resident model: a LATENT dict in and out.

        `layout` re-shards the resident checkpoint when it differs. `progress(step, total)` runs after
        every step; raising from it cancels the job on every rank at the next step boundary, and so does
        any exception while waiting (Ctrl+C): the next call never sees this job's result.
        """
        with self._lock:
            resident = self.resident
            if resident is None:
                raise ConfigError("no checkpoint is loaded; call load(checkpoint) first")
            plan = self.check_sample(
                positive, latent, checkpoint=resident.info, seed=seed, steps=steps, denoise=denoise,
                sigmas=sigmas, shift_mu=shift_mu,
            )  # fmt: skip
            if layout == "auto":
                b, _, h, w = plan.original.shape
                info = resident.info
                width, height = info.model_family.planned_pixels(h, w)
                planned = planned_weight_dtype(resident.weight_dtype, info)
                layout = self.auto_layout(
                    info.dims, width, height, b, resident.dtype, weight_dtype=planned, family=info.family
                ).layout
            if layout is not None:
                wanted = make_layout(layout, len(self.devices), ring, ulysses)
                if wanted != resident.layout:
                    wanted.validate(resident.info.dims, devices=len(self.devices))
                    resident = dataclasses.replace(resident, layout=wanted)
            out = dict(latent)
            if plan.steps == 0:
                out["samples"] = plan.original
                return out
            resident.layout.validate_sequence(resident.info.model_family.image_tokens(*plan.noise.shape[-2:]))
            if resident != self.resident or self._loaded_in is not self._group or not self.started:
                self._load_resident(resident)
            result = self.group.call(
                "sample", {"plan": plan_to_data(plan)}, timeout=timeout, progress=progress
            )
            out["samples"] = result["samples"]
            return out

    # ------------------------------------------------------------------ the forward service

    @property
    def conditioning_bytes_sent(self) -> int:
        """Conditioning bytes `forward` sent to the ranks since the model was loaded (each prompt once)."""
        return self._conditioning.sent_bytes

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the workers compute in (the resident load's, else the default for the devices)."""
        return resolve_dtype(self.resident.dtype if self.resident else None, self.devices[0])

    def forward(
        self,
        x: torch.Tensor,
        timestep: torch.Tensor,
        context: torch.Tensor,
        y: torch.Tensor | None = None,
        guidance: torch.Tensor | None = None,
        ref_latents: Sequence[torch.Tensor] | None = None,
        ref_method: str | None = None,
        *,
        timeout: float | None = None,
    ) -> torch.Tensor:
        """One model call on the resident model, as ComfyUI's FLUX `diffusion_model(x, timestep, context,
        y, guidance, ref_latents, ref_latents_method=)` makes it: x [B, C, H, W] of any size in sampler
        space (C = 16, or 96 for FLUX.1 Fill: latent, masked image and mask as ComfyUI's `c_concat`
        appends them), timestep [B] (sigma), context [B, T, text_dim] (T5-XXL), y [B, pooled_dim] (CLIP
        pooled), guidance [B] (None for schnell), ref_latents (Kontext: ReferenceLatent's latents after
        the latent format's process_in, [B, 16, h, w] each, any size) placed by `ref_method` ('offset',
        the default, 'index' or 'uxo'). Returns the output [B, 16, H, W] on the CPU in the workers'
        compute dtype.

        FLUX.2 (ComfyUI's `Flux2` model) is called alike: x [B, 128, H, W] at 1/16 of the pixels (one
        token per latent pixel), context [B, T, text_dim] (ComfyUI pads it to 512 tokens), no pooled
        vector (`y` is ignored), guidance for [dev], reference latents [B, 128, h, w] placed by 'index'
        unless `ref_method` says otherwise.

        Every rank runs it in the resident layout; the conditioning (with the reference latents) is sent
        once and kept on the ranks (found again by content), so a sampler's step moves only x. After a
        failure closed the group, the next call starts it again and re-loads the resident model first.
        """
        refs = list(ref_latents or ())
        with self._lock:
            resident = self.resident
            if resident is None:
                raise ConfigError("no checkpoint is loaded; call load(checkpoint) first")
            family = resident.info.model_family
            method = ref_method or family.ref_method
            if not family.text.pooled:
                # FLUX.2 has no pooled vector: an empty one keeps one conditioning record for all families
                y = torch.zeros(x.shape[0], 0, dtype=context.dtype if torch.is_tensor(context) else None)
            _check_forward(x, timestep, context, y, guidance, resident, refs, method)
            if resident.info.variant != "dev":
                guidance = None  # ComfyUI's Flux ignores it without a guidance embedder (schnell)
            if self._loaded_in is not self._group or not self.started:
                self._load_resident(resident)
            result = self._forward_on_ranks(x, timestep, context, y, guidance, timeout, refs, method)
            self._pace.record(result["seconds"])
            self.last_forward_seconds = result["seconds"]
            return result["out"]

    def _forward_on_ranks(
        self,
        x: torch.Tensor,
        timestep: torch.Tensor,
        context: torch.Tensor,
        y: torch.Tensor,
        guidance: torch.Tensor | None,
        timeout: float | None,
        refs: Sequence[torch.Tensor] = (),
        ref_method: str = "offset",
    ) -> dict[str, Any]:
        """One `flux_forward` job, with the conditioning (and Kontext's reference latents) under the key
        the ranks hold (sent along when they do not). The key's full check runs while the ranks compute;
        a lookalike prompt that fails it has its output discarded and the step sent again with its own
        conditioning."""
        group, sender = self.group, self._conditioning
        match = sender.key_for(context, y, refs)
        checked: list[bool] = []
        for attempt in range(3):
            request: dict[str, Any] = {
                "x": x,
                "timestep": timestep,
                "guidance": guidance,
                "cond_key": match.key,
            }
            if refs:
                request["ref_method"] = ref_method
            if not match.held:
                request["cond"] = {"context": context, "y": y}
                if refs:
                    request["cond"]["ref_latents"] = list(refs)
            try:
                result = group.call(
                    "flux_forward", request, timeout=timeout, watchdog=self._pace.watchdog(),
                    reuse_files=True, while_waiting=lambda m=match: checked.append(m.verify()),
                )  # fmt: skip
            except WorkerError as exc:
                sender.forget(match.key)  # whatever happened, no rank is assumed to hold it
                # A rank without the key (a restarted worker, an eviction out of step) gets the tensors
                # once more; anything else ends the call.
                if exc.remote_type != "ConditioningMissing" or attempt or not group.alive:
                    raise
                match = sender.add(context, y, refs)
                continue
            if checked.pop():
                return result
            match = sender.add(context, y, refs)
        raise AssertionError("unreachable: a new key always verifies")


def _check_forward(
    x: torch.Tensor,
    timestep: torch.Tensor,
    context: torch.Tensor,
    y: torch.Tensor,
    guidance: torch.Tensor | None,
    resident: Resident,
    refs: Sequence[torch.Tensor] = (),
    ref_method: str = "offset",
) -> None:
    """The shapes a model call needs, named by ComfyUI's argument names; cheap enough for every step."""
    info = resident.info
    dims, family = info.dims, info.model_family
    channels, latent = info.input_channels, family.latent_channels(info.config)
    if not torch.is_tensor(x) or x.ndim != 4 or x.shape[1] != channels or 0 in x.shape:
        shape = tuple(x.shape) if torch.is_tensor(x) else type(x).__name__
        if channels == latent:
            raise ConfigError(
                f"x has shape {shape}; {info.model_name} takes [batch, {channels}, height, width] latents "
                f"(encode with {family.latent.vae}, or use {family.latent.empty_node})"
            )
        raise ConfigError(
            f"x has shape {shape}; {info.model_name} takes [batch, {channels}, height, width]: the {latent}-channel "
            f"latent with the {channels - latent} channels of the masked image and mask appended "
            "(ComfyUI's InpaintModelConditioning supplies them)"
        )
    batch = x.shape[0]
    if (
        not torch.is_tensor(context)
        or context.ndim != 3
        or context.shape[0] != batch
        or (context.shape[-1] != dims.text_dim)
    ):
        shape = tuple(context.shape) if torch.is_tensor(context) else type(context).__name__
        raise ConfigError(
            f"context has shape {shape}; {info.model_name} expects [{batch}, tokens, {dims.text_dim}] (text "
            f"features for each latent): encode the prompt with {family.text.encoder}"
        )
    if family.text.pooled and (not torch.is_tensor(y) or tuple(y.shape) != (batch, dims.pooled_dim)):
        shape = tuple(y.shape) if torch.is_tensor(y) else type(y).__name__
        raise ConfigError(
            f"y (pooled_output) has shape {shape}; {info.model_name} expects [{batch}, {dims.pooled_dim}] "
            f"(CLIP-L pooled): encode the prompt with {family.text.encoder}"
        )
    if not torch.is_tensor(timestep) or timestep.numel() != batch:
        raise ConfigError(f"timestep must hold one value per latent ({batch}); got {timestep!r}")
    if info.variant == "dev" and guidance is None:
        raise ConfigError(
            f"guidance is None; {info.model_name} needs one per latent (FluxGuidance, e.g. 3.5)"
        )
    _check_refs(refs, ref_method, batch, channels, latent)
    tokens = family.image_tokens(*x.shape[-2:]) + sum(family.image_tokens(*r.shape[-2:]) for r in refs)
    resident.layout.validate_sequence(tokens)


def _check_refs(refs: Sequence[torch.Tensor], method: str, batch: int, channels: int, latent: int) -> None:
    """Reference latents (Kontext, FLUX.2): what comfy/ldm/flux/model.py `Flux._forward` can concatenate."""
    if not refs:
        return
    if method not in REF_METHODS:
        raise ConfigError(
            f"ref_latents_method={method!r} is not one of {', '.join(REF_METHODS)}; use ComfyUI's "
            "FluxKontextMultiReferenceLatentMethod node to set it"
        )
    if channels != latent:
        raise ConfigError(
            f"reference latents (ReferenceLatent) cannot be combined with a {channels}-channel model (FLUX.1 "
            "Fill): its tokens are wider than a reference latent's; remove the ReferenceLatent node or load a "
            "FLUX.1 Kontext checkpoint"
        )
    for i, ref in enumerate(refs):
        ok = torch.is_tensor(ref) and ref.ndim == 4 and ref.shape[1] == latent and 0 not in ref.shape
        if not ok or ref.shape[0] != batch:
            shape = tuple(ref.shape) if torch.is_tensor(ref) else type(ref).__name__
            raise ConfigError(
                f"ref_latents[{i}] has shape {shape}; a reference latent is [{batch}, {latent}, height, width] "
                "(one per latent in the batch): connect a VAE Encode of the reference image to ReferenceLatent"
            )
