"""Everything the ComfyUI nodes decide, in plain Python: input parsing, the handle, the worker registry.

No ComfyUI and no torch at import time: the pack's entry point imports this module, and the CI tests
run it without ComfyUI. The node classes in `classes.py` only translate between ComfyUI and these
functions; the backend is imported lazily, when a node first runs.
"""

from __future__ import annotations

import dataclasses
import math
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
# The loader's weight_dtype choices, ComfyUI UNETLoader's names (config.WEIGHT_DTYPE_BYTES says what each does).
WEIGHT_DTYPES = ("default", "fp8_e4m3fn", "fp8_e5m2")
PRELOAD_LAYOUTS = ("none", "tp", "context", "auto")
MODEL_LAYOUTS = ("tp", "context", "auto")  # the ROCm Parallel Model node's choices
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


def weight_dtype(choice: str) -> str | None:
    """The loader's weight_dtype widget -> ParallelFlux.load's weight_dtype ('default' -> None: an fp8
    checkpoint's weights stay fp8)."""
    if choice not in WEIGHT_DTYPES:
        raise ConfigError(f"weight_dtype={choice!r} is not offered; use one of {', '.join(WEIGHT_DTYPES)}")
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
    """What flows over a PARALLEL_FLUX link: which checkpoint, on which devices, in which compute dtype
    (`dtype`) and weight dtype (`weight_dtype`, None: the checkpoint's own fp8 stays fp8).

    Plain, hashable data: the resident worker group itself stays in the registry, so a handle from a
    cached node output still finds (or restarts) the group that serves its devices.
    """

    checkpoint: str  # absolute path
    name: str  # as listed in ComfyUI's diffusion_models
    devices: tuple[str, ...]
    dtype: str | None
    loras: tuple[tuple[str, float], ...] = ()  # (absolute path, strength), applied in this order
    weight_dtype: str | None = None

    def __repr__(self) -> str:
        with_loras = "".join(f" + {os.path.basename(p)} x{s:g}" for p, s in self.loras)
        return f"<{HANDLE_TYPE} {self.name}{with_loras} on {', '.join(self.devices)}>"

    def with_lora(self, path: str, strength: float) -> ParallelHandle:
        """This handle plus one LoRA (the ROCm Parallel LoRA node; chainable). Strength 0 changes nothing,
        as with ComfyUI's LoraLoaderModelOnly."""
        if strength == 0:
            return self
        return dataclasses.replace(self, loras=(*self.loras, (path, float(strength))))


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


def checkpoint_info(flux: ParallelFlux, handle: ParallelHandle) -> Any:
    """The handle's CheckpointInfo: the resident one when it is that file, else read from its header."""
    from ..backend.checkpoint import inspect_checkpoint

    resident = flux.resident
    if resident is not None and resident.checkpoint == handle.checkpoint:
        return resident.info
    return inspect_checkpoint(handle.checkpoint)


def auto_layout(
    registry: Registry,
    flux: ParallelFlux,
    handle: ParallelHandle,
    width: int,
    height: int,
    batch: int,
    context_only: bool,
    reference_tokens: int = 0,
) -> ParallelLayout:
    """The planner's layout for this image (link and memory measured once per group); its reason is shown.
    `reference_tokens`: the tokens of reference latents (ReferenceLatent) each step carries too."""
    from ..backend.checkpoint import planned_weight_dtype

    info = checkpoint_info(flux, handle)
    choice = flux.auto_layout(
        info.dims, width, height, batch, handle.dtype, context_only=context_only,
        weight_dtype=planned_weight_dtype(handle.weight_dtype, info), family=info.family,
        reference_tokens=reference_tokens,
    )  # fmt: skip
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
            flux.check_load(handle.checkpoint, layout=layout, dtype=handle.dtype, **load_kwargs(handle))
            if not flux.started:  # started only once the load is known to be valid
                registry.update(phase="starting workers")
                flux.start()
                registry.update(phase="loading")
            reports = flux.load(
                handle.checkpoint, layout=layout, dtype=handle.dtype, progress=check, **load_kwargs(handle)
            )
        finally:
            registry.update(loading=None)
            registry.record_resident(flux)
    registry.record_ranks(reports)


def add_lora(handle: ParallelHandle, path: str, strength: float) -> ParallelHandle:
    """The ROCm Parallel LoRA node: `handle` plus this LoRA, after the backend checked from the file's
    header against the handle's checkpoint (no worker starts) that every key fits this model."""
    from ..backend.checkpoint import check_loras, inspect_checkpoint

    check_loras([(path, strength)], inspect_checkpoint(handle.checkpoint))
    return handle.with_lora(path, strength)


def load_kwargs(handle: ParallelHandle) -> dict[str, Any]:
    """`loras=` and `weight_dtype=` for ParallelFlux.load / check_load, passed only when set."""
    kwargs: dict[str, Any] = {"loras": list(handle.loras)} if handle.loras else {}
    if handle.weight_dtype is not None:
        kwargs["weight_dtype"] = handle.weight_dtype
    return kwargs


# --------------------------------------------------------------------------------------------------
# The parallel MODEL: ComfyUI samples, the workers run each transformer forward


@dataclass(frozen=True)
class LayoutRequest:
    """The layout a node asks for: a fixed one, or `None` for the planner's choice for the latent being
    sampled (`context_only`: among ring x Ulysses splits, the Ring Attention Sampler's auto)."""

    layout: ParallelLayout | None
    context_only: bool = False

    def describe(self) -> str:
        if self.layout is not None:
            return self.layout.describe()
        return "auto (context parallel)" if self.context_only else "auto"


def model_layout(kind: str, ring: int, ulysses: int, devices: int) -> LayoutRequest:
    """The ROCm Parallel Model node's layout: 'tp', 'context' (degrees, 0 = fill / both 0 = auto) or 'auto'."""
    if kind not in MODEL_LAYOUTS:
        raise ConfigError(f"layout={kind!r} is not offered; use one of {', '.join(MODEL_LAYOUTS)}")
    if kind == "tp":
        return LayoutRequest(tp_layout(devices))
    if kind == "auto":
        return LayoutRequest(None)
    return LayoutRequest(context_layout(ring, ulysses, devices), context_only=True)


# What the proxy refuses: ComfyUI would pass these to its own Flux model, and ignoring them would change
# the image without a word. Each message names the node to remove.
CONTROLNET_MESSAGE = (
    "ControlNet is not supported by the ROCm Parallel Model yet: remove the ControlNet apply node "
    "(ControlNetApply / ControlNetApplyAdvanced) from the conditioning, or sample with ComfyUI's own "
    "Load Diffusion Model"
)
KONTEXT_MESSAGE = (
    "the TP / Ring Attention Sampler do not take FLUX Kontext's reference latents (the conditioning carries "
    "ReferenceLatent's): sample with the ROCm Parallel Model and ComfyUI's KSampler instead (see the "
    "flux1_kontext workflow), or remove the ReferenceLatent node"
)
FILL_MESSAGE = (
    "{model} needs the masked image and mask in every step, which the TP / Ring Attention Sampler do not "
    "supply: sample it with the ROCm Parallel Model, ComfyUI's InpaintModelConditioning and KSampler"
)
ATTENTION_MASK_MESSAGE = (
    "attention masks in the conditioning (e.g. StyleModelApply with strength_type 'attn_bias') are not "
    "supported by the ROCm Parallel Model: use strength_type 'multiply' or remove the node that adds the mask"
)
LORA_ON_MODEL_MESSAGE = (
    "LoraLoaderModelOnly (or any node that patches weights, e.g. model merging) cannot patch the ROCm "
    "Parallel Model: its weights live in the worker processes. Remove that node and put a 'ROCm Parallel "
    "LoRA' node between the ROCm Parallel Loader and the ROCm Parallel Model (or the TP / Ring Attention "
    "Sampler)"
)


def patches_message(kind: str, names: Sequence[str]) -> str:
    return (
        f"a model patch ({kind}: {', '.join(sorted(names))}) would change the FLUX transformer's blocks or "
        "attention, which run in the ROCm Parallel workers and cannot be patched from ComfyUI; remove the node "
        "that adds it (e.g. a PAG, attention-couple or block-patch node) from the ROCm Parallel Model's path"
    )


def unknown_input_message(name: str) -> str:
    return (
        f"ComfyUI passed '{name}' to the FLUX model; the ROCm Parallel Model does not implement it and "
        "ignoring it would change the image. Remove the node that adds it to the conditioning or the model"
    )


# Keyword inputs of ComfyUI's Flux.forward the proxy receives and understands (ref_latents is an argument).
_UNDERSTOOD = {"ref_latents_method"}  # Kontext: how reference latents are placed (passed to the workers)


def unsupported_forward_inputs(
    control: Any, transformer_options: dict[str, Any], extra: dict[str, Any]
) -> str | None:
    """Why the proxy cannot run this forward as ComfyUI's Flux would, or None when it can."""
    if control is not None:
        return CONTROLNET_MESSAGE
    if extra.get("attention_mask") is not None:
        return ATTENTION_MASK_MESSAGE
    for name, value in extra.items():
        if name not in _UNDERSTOOD and value is not None:
            return unknown_input_message(name)
    for key in ("patches", "patches_replace"):
        patches = {k: v for k, v in (transformer_options.get(key) or {}).items() if v}
        if patches:
            return patches_message(key, list(patches))
    wrappers = (transformer_options.get("wrappers") or {}).get("diffusion_model") or {}
    if any(wrappers.values()):
        return patches_message("diffusion_model wrappers", [str(k) for k, v in wrappers.items() if v])
    return None


def _conditioning_entries(name: str, conditioning: Any) -> list[tuple[Any, dict[str, Any]]]:
    if not isinstance(conditioning, list) or not conditioning:
        raise ConfigError(
            f"{name} must be a CONDITIONING (a list of [tensor, dict]); got {type(conditioning).__name__}"
        )
    entries = []
    for i, entry in enumerate(conditioning):
        if not isinstance(entry, (list, tuple)) or len(entry) != 2 or not isinstance(entry[1], dict):
            raise ConfigError(f"{name}[{i}] is not a [tensor, dict] CONDITIONING entry")
        entries.append((entry[0], entry[1]))
    return entries


def check_conditioning(name: str, conditioning: Any, info: Any) -> None:
    """Widths against the checkpoint `info` (a SD or SDXL text encoder is the usual mistake), and the
    extras the proxy refuses at run time, refused here before anything starts."""
    text, text_dim, pooled_dim = info.model_family.text, info.dims.text_dim, info.dims.pooled_dim
    for i, (cond, extras) in enumerate(_conditioning_entries(name, conditioning)):
        where = f"{name}[{i}]" if len(conditioning) > 1 else name
        if getattr(cond, "ndim", 0) != 3 or cond.shape[-1] != text_dim:
            raise ConfigError(
                f"{where}: the text embedding is {list(getattr(cond, 'shape', []))} but {info.model_name} takes "
                f"[batch, tokens, {text_dim}]; encode the prompt with {text.encoder} and CLIPTextEncode"
            )
        pooled = extras.get("pooled_output")
        if text.pooled and pooled is not None and pooled.shape[-1] != pooled_dim:
            raise ConfigError(
                f"{where}: pooled_output is {list(pooled.shape)} but {info.model_name} takes [batch, "
                f"{pooled_dim}] (CLIP-L); encode the prompt with {text.encoder}"
            )
        if extras.get("control") is not None:
            raise ConfigError(CONTROLNET_MESSAGE)
        if extras.get("reference_latents") is not None:
            raise ConfigError(KONTEXT_MESSAGE)
        if extras.get("attention_mask") is not None:
            raise ConfigError(ATTENTION_MASK_MESSAGE)


def check_latent(latent: Any, info: Any) -> None:
    """A LATENT ComfyUI's sampling accepts for the checkpoint `info`: any height and width (the model pads
    to the patch size); the family's channels, or an all-zero latent of another width that ComfyUI widens
    itself."""
    family = info.model_family
    channels, scale = family.latent_channels(info.config), family.latent.downscale
    samples = latent.get("samples") if isinstance(latent, dict) else None
    if samples is None or getattr(samples, "ndim", 0) != 4:
        raise ConfigError(
            f"latent_image must be a LATENT with 'samples' [batch, {channels}, height/{scale}, width/{scale}]; "
            f"got {list(getattr(samples, 'shape', [])) if samples is not None else type(latent).__name__}"
        )
    if samples.shape[1] != channels and bool(samples.any()):
        raise ConfigError(
            f"latent_image has {samples.shape[1]} channels but {info.model_name} latents have {channels}: "
            f"encode the image with {family.latent.vae}, or use {family.latent.empty_node} for text-to-image"
        )
    if min(samples.shape[-2:]) < 1:
        raise ConfigError(f"latent_image is empty: samples {list(samples.shape)}")


def reference_shapes(conds: Any) -> list[tuple[int, ...]]:
    """Shapes of the reference latents (ReferenceLatent's `reference_latents`) one model call carries: the
    conds entry with the most reference elements (positive and negative are called separately or batched
    side by side, never with both sets), from a guider's `conds` {"positive": [{...}], ...}."""
    best: list[tuple[int, ...]] = []
    for entries in (conds or {}).values() if isinstance(conds, dict) else ():
        for entry in entries or ():
            refs = entry.get("reference_latents") if isinstance(entry, dict) else None
            shapes = [tuple(r.shape) for r in refs or () if hasattr(r, "shape")]
            if sum(math.prod(s) for s in shapes) > sum(math.prod(s) for s in best):
                best = shapes
    return best


def check_sampler_inputs(
    registry: Registry,
    handle: ParallelHandle,
    request: LayoutRequest,
    positive: Any,
    negative: Any,
    latent: Any,
    *,
    cfg: float,
    sigmas: Any = None,
) -> None:
    """Everything the TP / Ring Attention Sampler can check before a worker starts or a weight loads:
    the checkpoint's header, the layout against it, the conditioning widths, the latent, cfg vs negative."""
    from ..backend.checkpoint import inspect_checkpoint

    info = inspect_checkpoint(handle.checkpoint)
    if info.input_channels != info.model_family.latent_channels(info.config):
        raise ConfigError(FILL_MESSAGE.format(model=info.model_name))
    check_latent(latent, info)
    check_conditioning("positive", positive, info)
    if negative is not None:
        check_conditioning("negative", negative, info)
    elif not math.isclose(cfg, 1.0):
        raise ConfigError(
            f"cfg={cfg:g} needs a negative prompt: connect a CONDITIONING to 'negative' (e.g. CLIPTextEncode "
            "with an empty text, or ConditioningZeroOut), or set cfg to 1.0 (FLUX dev is usually run at cfg "
            "1.0 with FluxGuidance instead)"
        )
    if sigmas is not None and (getattr(sigmas, "ndim", 0) != 1 or len(sigmas) < 1):
        raise ConfigError(
            f"sigmas must be a 1-D SIGMAS schedule; got shape {list(getattr(sigmas, 'shape', []))}"
        )
    if request.layout is not None:
        flux = registry.flux_for(handle.devices)  # does not start workers
        flux.check_load(handle.checkpoint, layout=request.layout, dtype=handle.dtype, **load_kwargs(handle))


class ModelRunner:
    """The plain-Python side of the parallel MODEL: which checkpoint (and LoRAs) in which layout, made
    resident before ComfyUI's sampling starts, then one `ParallelFlux.forward` per model call.

    `comfy_model` wraps it into ComfyUI's MODEL; nothing here imports ComfyUI. `interrupted()` raises on
    a pending Cancel (checked during loads); `make_room()` frees ComfyUI's own models from the GPUs.
    """

    def __init__(
        self,
        registry: Registry,
        handle: ParallelHandle,
        request: LayoutRequest,
        *,
        interrupted: Callable[[], None] | None = None,
        make_room: Callable[[], None] | None = None,
    ) -> None:
        self.registry, self.handle, self.request = registry, handle, request
        self.interrupted, self.make_room = interrupted, make_room
        self.layout: ParallelLayout | None = request.layout
        self._resident: Any = None  # what `prepare` made resident (the backend's record, by identity)
        self.calls = 0

    def comfy_model(self) -> Any:
        """The ComfyUI model config (`backend.family.ComfyModel`) ComfyUI's own loader would pick for the
        checkpoint: the family decides it from the header (e.g. FluxInpaint for FLUX.1 Fill)."""
        from ..backend.checkpoint import inspect_checkpoint

        info = inspect_checkpoint(self.handle.checkpoint)
        return info.model_family.comfy_model(info.config)

    def compute_dtype(self) -> Any:
        """The workers' compute dtype (ComfyUI casts the model inputs to it, as for its own model)."""
        from ..backend.checkpoint import resolve_dtype

        return resolve_dtype(self.handle.dtype, self.handle.devices[0])

    def prepare(self, shape: Sequence[int], references: Sequence[Sequence[int]] = ()) -> ParallelFlux:
        """Make the model resident for a latent of `shape` [B, C, H, W] (auto layouts are planned for it,
        with the tokens of the reference latents of shapes `references`, Kontext / FLUX.2 editing)."""
        if self.make_room is not None:
            self.make_room()
        flux = self.registry.flux_for(self.handle.devices)
        if self.request.layout is None:
            b, _, h, w = shape
            family = checkpoint_info(flux, self.handle).model_family
            width, height = family.planned_pixels(h, w)
            extra = sum(family.image_tokens(*ref[-2:]) for ref in references)
            self.layout = auto_layout(
                self.registry, flux, self.handle, width, height, b, context_only=self.request.context_only,
                reference_tokens=extra,
            )  # fmt: skip
        else:
            self.registry.update(auto=None)
        ensure_loaded(self.registry, flux, self.handle, self.layout, self.interrupted)
        self._resident = flux.resident
        return flux

    @contextmanager
    def sampling(
        self, shape: Sequence[int], total: int, references: Sequence[Sequence[int]] = ()
    ) -> Iterator[None]:
        """Around one ComfyUI sampling run: load first, then show 'sampling' (and how it ended)."""
        self.prepare(shape, references)
        with self.registry.phase("sampling", step=0, total=total):
            yield

    def forward(
        self,
        x: Any,
        timestep: Any,
        context: Any,
        y: Any,
        guidance: Any,
        step: tuple[int, int] | None = None,
        ref_latents: Any = None,
        ref_method: str | None = None,
    ) -> Any:
        """One transformer forward on every rank (ComfyUI's `Flux.forward(x, timestep, context, y,
        guidance, ref_latents, ref_latents_method=)`); `step` (done, total) is shown on the panel."""
        flux = self.registry.flux_for(self.handle.devices)
        if self._resident is None or flux.resident is not self._resident:
            # Called outside ComfyUI's sampling, or another node loaded something else meanwhile.
            self.prepare(x.shape, [r.shape for r in ref_latents or ()])
        if step is not None:
            self.registry.update(step=step[0], total=step[1])
        self.calls += 1
        return flux.forward(x, timestep, context, y, guidance, ref_latents=ref_latents, ref_method=ref_method)


def step_of(transformer_options: dict[str, Any]) -> tuple[int, int] | None:
    """(step, total) of the current model call from ComfyUI's transformer_options (sigmas of this call
    and of the whole run), for the panel; None when ComfyUI did not say."""
    run, now = transformer_options.get("sample_sigmas"), transformer_options.get("sigmas")
    if run is None or now is None or len(run) < 2 or len(now) < 1:
        return None
    total = len(run) - 1
    sigma = float(now[0])
    for i in range(total):
        if float(run[i]) >= sigma > float(run[i + 1]) or float(run[i]) == sigma:
            return (i + 1, total)
    return (total, total)


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
