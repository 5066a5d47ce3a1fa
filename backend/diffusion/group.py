"""A worker group with diffusion models resident: what loading one takes, on top of the group every resident
model shares (resident/group.py `ResidentGroup`: start, slots, eviction, parking, unload, status).

`load` / `check_load` take the checkpoint and its `LoadOptions` (layout, dtypes, LoRAs, compile, slot), check
everything from the headers before any rank runs, and plan 'auto' layouts from the machine measured once per
group (`machine`, `auto_layout`). Each loaded model gets the caller's side of its model calls
(forward_client.py). `ParallelModel` (api.py) adds what runs on a resident model: `forward` and `sample`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..checkpoint import (
    CheckpointInfo,
    check_loras,
    check_weight_dtype,
    inspect_checkpoint,
    planned_file_weights,
    planned_weight_dtype,
    resolve_dtype,
)
from ..checkpoint.gguf import check_block_splits
from ..checkpoint.lora.values import lora_pair, refuse_foreign_loras
from ..compile import compile_mode
from ..config import DEFAULT_SLOT, ConfigError, ModelDims, ParallelLayout, weight_dtype_name
from ..plan import Choice
from ..plan.setup import FileWeights
from ..platforms import DeviceSpec, host_sizes
from ..resident.group import ResidentGroup
from ..resident.messages import LoadReport
from ..runtime.client import ProgressCallback, WorkerGroup
from ..runtime.messages import LinkReport
from .auto import choose_layout, make_layout, measure_machine
from .forward_client import ForwardClient
from .messages import LoadRequest

Checkpoint = str | os.PathLike[str] | CheckpointInfo  # a path, or its header as inspect_checkpoint read it

Loras = Sequence[tuple[str | os.PathLike[str], float]]


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
    models this is (several stay resident, one per slot). `engine`: 'diffusers' (the family's diffusers
    model) or 'comfy' (ComfyUI's own model class, sharded by its plan: backend/models/), which imports the
    ComfyUI at `comfyui` (default: COMFYUI_PATH, else the ComfyUI this process runs in) on the workers;
    `detection`: values over ComfyUI's model detection for a file it cannot describe (a small test model's
    head count and RoPE axes, e.g. {"num_heads": 4, "axes_dim": [4, 6, 6]}).
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
    engine: str = "diffusers"
    comfyui: str | os.PathLike[str] | None = None
    detection: Mapping[str, Any] | str | None = None

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


class DiffusionGroup(ResidentGroup):
    """A `ResidentGroup` whose slots hold diffusion models (and beside them any resident module: a text
    encoder, a VAE): `residents` maps a model's slot to its `LoadRequest`."""

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
        super().__init__(devices, threads=threads, start_timeout=start_timeout, group=group, backend=backend)
        self.auto_choice: Choice | None = None  # the latest 'auto' decision; .explanation for the node
        self._machine: tuple[WorkerGroup, LinkReport] | None = None
        self._forwards: dict[str, ForwardClient] = {}  # what the ranks hold for `forward`, per slot

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
            file_weights=file_weights, hosts_link=self.group.hosts_link,
        )  # fmt: skip
        return self.auto_choice

    # ------------------------------------------------------------------ models

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
            named = make_layout(opts.layout, len(self.devices), opts.ring, opts.ulysses)
            named.check_devices(len(self.devices))
            named.check_hosts(host_sizes(self.devices))  # TP inside a host (docs/hosts.md)
        # an SDXL LoRA or a model checkpoint given as a LoRA: named before the checkpoint's header is read
        refuse_foreign_loras(opts.loras)
        info = checkpoint if isinstance(checkpoint, CheckpointInfo) else inspect_checkpoint(checkpoint)
        engine = _engine_fields(opts, info)  # before 'auto' starts workers to measure the machine
        if engine:  # the comfy engine applies what ComfyUI's LoRA loader applies; each rank refuses the rest
            checked = tuple(lora_pair(i, item) for i, item in enumerate(opts.loras))
        else:
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
        parallel.check_hosts(host_sizes(self.devices))
        # GGUF: each rank must hold whole quantization blocks
        check_block_splits(info, parallel.tp, devices=len(self.devices))
        path = info.path if isinstance(checkpoint, CheckpointInfo) else str(checkpoint)
        return LoadRequest(
            path,
            info,
            parallel,
            opts.dtype,
            weights,
            opts.attention,
            checked,
            compiled,
            slot=opts.slot,
            **engine,
        )

    def _held(self, request: Any) -> None:
        if isinstance(request, LoadRequest):  # a resident module (a VAE) takes no model calls
            self._forwards[request.slot] = ForwardClient(request.info.model_family.call_spec, request.slot)

    def _forget(self, slot: str) -> None:
        super()._forget(slot)
        self._forwards.pop(slot, None)

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


def _engine_fields(opts: LoadOptions, info: CheckpointInfo) -> dict[str, str]:
    """The request's engine fields, checked (models/options.py): the comfy engine's ComfyUI resolved and
    the file one it reads."""
    from ..models.options import check_engine, check_engine_file, detection_text, resolve_comfyui

    if check_engine(opts.engine) == "diffusers":
        if opts.comfyui is not None or opts.detection:
            raise ConfigError("comfyui= and detection= go with engine='comfy' only")
        return {}
    check_engine_file(info)
    return {
        "engine": "comfy",
        "comfyui": resolve_comfyui(opts.comfyui),
        "detection": detection_text(opts.detection),
    }
