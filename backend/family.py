"""Model families as data: everything the pack knows about one transformer family, in one record.

A family is one folder (backend/flux/ for FLUX.1, backend/flux2/ for FLUX.2) whose `family.py` builds a
`ModelFamily` and registers it. The record carries every family-owned fact, and the generic code only
ever reads these fields:

* the checkpoint loader and LoRA code (backend/checkpoint/): `keys`, header detection, configs;
* tensor parallelism (parallel/tensor.py): `tp`, the plan as data with its block forwards;
* context parallelism (parallel/context.py): `cp`, the attention processors it may rebuild;
* the planner (backend/plan/): `dims`, `config_from_dims` (its meta model), `planner` (calibration);
* the command line: `presets`;
* the patch-parallel VAE (backend/vae/): `vae`, the family's VAE kind;
* the model call (its inputs, checks and token geometry), read by the worker's forward service, the
  checks, admission, the planner and the ComfyUI proxy MODEL: `call_spec`, `call`, `model_fn`,
  `geometry`, `latent`, `text`, `references`, `comfy_model`.

So adding a family touches its folder, `BUILTIN` below, its docs and its tests; nothing else branches on
a family. Style: torchtitan's plans-as-data and diffusers' `_tp_plan` / `_cp_plan`.

The registry imports no torch: a family's record holds its torch-free facts (configs, dims, planner units,
geometry, latent and text formats); its checkpoint key layout, header detection and configs from shapes
come from its `header()` (`FamilyHeader`, torch-free too), and the parts whose modules import torch,
diffusers or safetensors (model, TP / CP specs, call, sampling, VAE) from its `parts()` the first time one
is read (`FamilyParts`). So `python -m rocm_parallel plan` prices a released model, or a checkpoint's header
(`--checkpoint`), without torch (tests/test_cli.py).

How to add a family
-------------------
1. Make a folder like backend/flux2/: `facts.py` (torch-free: released configs, dims, latent format),
   `model.py` (`build`), `keys.py` (checkpoint layout, detection, configs from shapes), `tp.py` (the
   tensor-parallel spec and any fused block forwards), `forward.py` (ComfyUI's model call), and
   `family.py`, which builds the `ModelFamily(...)` from torch-free modules only, with a `header()` that
   imports `keys.py` (torch-free) and returns its `FamilyHeader`, a `parts()` that imports the rest and
   returns its `FamilyParts`, and calls `register(...)` at import time.
2. Add `family.py`'s module name to `BUILTIN` below: the registry imports the modules lazily, the first
   time a family is looked up, so importing this module stays cheap and free of cycles.
3. Make `matches_bfl` / `matches_diffusers` specific enough that no two families claim the same header:
   `detect_*` raises when two do, so an overlap is found by the first test that loads either.
4. Calibrate the planner's activation units (`PlannerFacts`) with `bench planner`'s tracer.

Lookups: `get_family(name)`, `families()`, `detect_bfl(keys)`, `detect_diffusers(keys)`,
`family_for_class(class_name)`, `family_of(model)`.
"""

from __future__ import annotations

import functools
import importlib
import math
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .config import ConfigError, ModelDims

if TYPE_CHECKING:  # the records' types; importing them here would make this module import torch
    from torch import nn

    from .checkpoint.keys import KeyLayout, Source
    from .diffusion.call import CallSpec
    from .parallel.context import ContextParallelSpec
    from .parallel.tensor import TensorParallelSpec
    from .vae.kind import VaeKind

# Modules (relative to this package) whose import registers the built-in families, in detection order.
BUILTIN: tuple[str, ...] = (".flux.family", ".flux2.family", ".qwen_image.family", ".wan.family")

Shapes = Mapping[str, tuple[int, ...]]


@dataclass(frozen=True)
class LatentFormat:
    """ComfyUI's `comfy.latent_formats` entry of the family: `process_in(x) = (x - shift) * scale`, or with
    per-channel statistics (`mean`, `std`: Wan 2.1's, Qwen-Image's) `(x - mean) * scale / std`."""

    comfy_name: str  # class name in comfy.latent_formats, e.g. "Flux"
    channels: int  # channels of the VAE latent the sampler works on (the model's output channels)
    scale: float
    shift: float
    downscale: int  # image pixels per latent pixel on each side (the VAE's): 8 for FLUX.1, 16 for FLUX.2
    vae: str  # the VAE file ComfyUI users encode with (messages name it)
    empty_node: str  # ComfyUI's node for an empty latent of this format
    mean: tuple[float, ...] | None = None  # per channel, replacing `shift` (latents_mean)
    std: tuple[float, ...] | None = None  # per channel (latents_std)
    # ComfyUI's latent_dimensions: 2 for [B, C, H, W]; 3 for [B, C, T, H, W] (T = 1 for an image)
    dimensions: int = 2
    # video frames per latent frame after the first (Wan's VAE: 4; 1 + 4k frames make 1 + k latent frames)
    temporal_downscale: int = 1

    def latent_frames(self, frames: int) -> int:
        """Latent frames of a video of `frames` frames (1 for an image)."""
        return (frames - 1) // self.temporal_downscale + 1

    def process_in(self, x: Any) -> Any:
        """VAE latent -> the space the sampler works in, in ComfyUI's operation order (x: a tensor, channels
        on dim 1, any number of dimensions after them)."""
        if self.mean is None:
            return (x - self.shift) * self.scale
        mean, std = self._per_channel(x)
        return (x - mean) * self.scale / std

    def process_out(self, x: Any) -> Any:
        """The sampler's space -> VAE latent (inverse of `process_in`)."""
        if self.mean is None:
            return (x / self.scale) + self.shift
        mean, std = self._per_channel(x)
        return x * std / self.scale + mean

    def _per_channel(self, x: Any) -> tuple[Any, Any]:
        view = (1, -1) + (1,) * (x.ndim - 2)
        # float32 first, as ComfyUI's statistics are float32 tensors cast to the latent's dtype
        import torch

        mean, std = (
            torch.tensor(v, dtype=torch.float32).to(x.device, x.dtype).view(view)
            for v in (self.mean, self.std)
        )
        return mean, std


@dataclass(frozen=True)
class TokenGeometry:
    """How a latent becomes the transformer's tokens: `patch` latent pixels per token along (frames,
    height, width), a partial patch padded (ComfyUI's pad_to_patch_size); `frames`: the model takes latents
    of several frames ([B, C, T, H, W], T > 1: video). FLUX.1 and Qwen-Image: (1, 2, 2); FLUX.2: (1, 1, 1)."""

    patch: tuple[int, int, int]
    frames: bool = False

    def tokens(self, shape: Sequence[int]) -> int:
        """Tokens of one batch entry of a latent of `shape` ([B, C, H, W] or [B, C, T, H, W])."""
        t = int(shape[2]) if len(shape) == 5 else 1
        sizes = (t, int(shape[-2]), int(shape[-1]))
        return math.prod(-(-n // p) for n, p in zip(sizes, self.patch, strict=True))


@dataclass(frozen=True)
class TextInputs:
    """The text conditioning a model call takes, for messages and the planner."""

    encoder: str  # how a ComfyUI user makes it (errors name it), e.g. "a FLUX DualCLIPLoader (...)"
    tokens: int  # text tokens of a short prompt as ComfyUI passes it (the planner prices these)
    # whether the text joins the image tokens in one self-attention (FLUX, Qwen-Image: joint attention,
    # which context parallelism splits too) or is only attended to from them (cross-attention)
    joint: bool = True
    # the text encoder each released model's ComfyUI template loads (its CLIPLoader / DualCLIPLoader file), by
    # preset name: backend/plan/encoders.json's key, what `plan --encoder auto` prices beside the model
    encoders: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ReferenceLatents:
    """How the family's model takes ComfyUI's reference latents (ReferenceLatent: FLUX.1 Kontext's input
    image, FLUX.2's and Qwen-Image-Edit's reference images), placed by ComfyUI's `ref_latents_method` (its
    FluxKontextMultiReferenceLatentMethod node, "Edit Model Reference Method" since ComfyUI 0.17).

    `methods` are the placements ComfyUI's own model of the family runs in the versions the pack is checked
    against (comfy/ldm/flux/model.py `Flux._forward`, comfy/ldm/qwen_image/model.py); `backend/diffusion/checks.py` refuses any other before a rank
    runs, naming why ComfyUI cannot run it either. `what` and `workflow` are for messages: the feature's
    name and the shipped workflow (workflows/) whose graph samples this family with the ROCm Parallel Model.
    """

    methods: tuple[str, ...]
    what: str  # e.g. "FLUX.1 Kontext's reference latents"
    # e.g. "flux1_kontext_dev_ksampler_parallel_model"; None: no shipped workflow, messages point to
    # ComfyUI's own template for the family
    workflow: str | None = None
    # method another family runs -> why this family's model (ComfyUI's own included) cannot
    refused: Mapping[str, str] = field(default_factory=dict)
    # methods ComfyUI's own model runs only at batch 1 when it has a guidance embedder -> why
    batch_one_with_guidance: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ComfyModel:
    """What ComfyUI's own loader would build for a checkpoint: a `comfy.supported_models` class and the
    unet_config detected from its header (comfy/model_detection.py). The proxy MODEL is built from it
    with `disable_unet_model_creation`, so ComfyUI's samplers, latent format, `extra_conds` and
    `concat_cond` (Fill's masked image) behave as with ComfyUI's loader."""

    config_class: str  # attribute of comfy.supported_models, e.g. "Flux", "FluxSchnell", "FluxInpaint"
    unet_config: Mapping[str, Any]
    # weights of ComfyUI's own diffusion model that its model class reads from `diffusion_model` (Wan's
    # `concat_cond` takes the input channels from `patch_embedding.weight`): path -> shape; the proxy holds
    # each as an empty meta tensor (no storage, no parameter)
    weights: Mapping[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class PlannerFacts:
    """What the planner cannot derive from shapes: the peak of live activations, measured.

    Units are (batch x tokens x hidden x bytes) per rank, tokens being the rank's own (all of them under
    TP); backend/plan/cost.py `activation_bytes` says how they combine. Each family calibrates its own with
    torch's MemTracker on the meta device (`bench planner`, testing/meta.py); the family's folder says how.
    """

    table_name: str  # how `python -m rocm_parallel plan`'s table names the model, e.g. "FLUX"
    attention_full: float  # at the attention peak: what TP never shards (block input, norms, RoPE tables)
    attention_sharded: float  # at the attention peak: what TP splits (q/k/v, the MLP branch)
    block_full: float  # the fused double block's peak under TP: partial sums and residuals, full width


@dataclass(frozen=True)
class FamilyHeader:
    """The part of a family's record that reads checkpoint headers: its key layout, header detection and
    configs from shapes (`ModelFamily` describes each field under the same name). Its modules import no
    torch, so `plan --checkpoint` detects a file's family and dims without it; a family's `header()` builds
    it the first time one is read."""

    keys: KeyLayout
    matches_bfl: Callable[[Collection[str]], bool]
    config_from_bfl: Callable[[Shapes], dict[str, Any]]
    matches_diffusers: Callable[[Collection[str]], bool]
    config_from_diffusers: Callable[[Shapes], dict[str, Any]]
    # What the file's safetensors metadata changes in that config, as ComfyUI's detection reads it (Wan:
    # `metadata["config"]["transformer"]`'s head count); None: the family's files declare nothing there.
    config_with_metadata: Callable[[dict[str, Any], Mapping[str, str]], dict[str, Any]] | None = None


@dataclass(frozen=True)
class FamilyParts:
    """The part of a family's record whose modules import torch, diffusers or safetensors: the model, its
    checkpoint layout and detection, its parallel specs, its model call, sampling and VAE (`ModelFamily`
    describes each field under the same name).

    A family's `parts()` builds it, importing those modules then: the registry and the facts `plan` prices
    (presets, dims, planner units, token geometry, latent and text) stay importable without torch, which is
    most of `python -m rocm_parallel plan`'s time on a busy machine. `ModelFamily` reads every field through,
    so `family.tp` or `family.build(...)` import the parts the first time one of them is read.
    """

    build: Callable[..., nn.Module]
    tp: TensorParallelSpec
    cp: ContextParallelSpec
    call_spec: CallSpec
    call: Callable[..., Any]
    model_fn: Callable[[Any], Callable[..., Any]]
    sampling: Callable[..., Any]
    vae: VaeKind | None = None


@dataclass(frozen=True, eq=False)
class ModelFamily:
    """One transformer family. Every callable taking `config` takes the diffusers config (a dict).

    The fields below marked (header) are `FamilyHeader`'s (torch-free; `header()` builds them the first time
    one is read), those marked (parts) are `FamilyParts`' fields, read through this record: `parts()` builds
    them the first time one is read (their modules import torch); every other field is torch-free.

    Identity
    - `build(config, device=, dtype=, seed=)` (parts): the diffusers model; random weights when `seed` is set,
      none on the meta device (the loader builds on meta, shards, then fills from the file).
    - `presets`: released configs by the name `plan --model` offers ("flux1-dev"); `aliases`: older
      names for some of them ("dev" -> "flux1-dev").
    - `dims(config)`: the shape facts layouts depend on (a `ModelDims`, or the family's own subclass);
      `config_from_dims(dims)`: a config with those dims, from which the planner builds its meta model.
    Checkpoint
    - `keys` (header): the BFL <-> diffusers key layout (data); `matches_bfl(keys)` / `matches_diffusers(keys)`:
      header detection (keys without `model.diffusion_model.`); `config_from_bfl(shapes)` /
      `config_from_diffusers(shapes)`: the config from a header's shapes.
    - `variant(config)`: the family's word for the checkpoint's kind (messages, the panel; only the family
      reads it); `describe(config)`: the model's name for messages; `input_channels(config)`: channels of
      `x` in a model call (latent plus concatenated extras); `latent_channels(config)`: of the latent itself.
    Parallelism and planning
    - `tp` (parts): the tensor-parallel spec (plan, block forwards, modulation source, attention processors);
      `cp` (parts): what context parallelism may rebuild and returns; `planner`: the measured activation units.
    The model call (ComfyUI's)
    - `call_spec` (parts): the call as data (backend/diffusion/call.py `CallSpec`): its inputs by ComfyUI's names, which are a
      prompt's and which change every step, which carry the batch or add tokens, and the family's checks.
    - `call(model_fn, x, timestep, **inputs)` (parts): one model call with ComfyUI's semantics (pad, patchify, ids,
      crop) on the inputs `call_spec` declares; `model_fn(model)` adapts the diffusers model to it.
    - `geometry`: how a latent becomes tokens (`TokenGeometry`: patch per frame, row, column);
      `latent`, `text`: the latent format and the text conditioning (for messages and the planner).
    - `references`: the reference latents the family's model takes (`ReferenceLatents`: placements, and
      what messages say about them), None when it takes none; `ref_method`: ComfyUI's default placement (a
      checkpoint may set its own: `default_ref_method(config)`).
    - `comfy_model(config)`: the ComfyUI model config the proxy MODEL is built from.
    - `lora_prefixes`: key prefixes ComfyUI's LoRA loader maps onto the checkpoint's modules besides
      `diffusion_model.`, `lora_unet_` and the diffusers names (comfy/lora.py; Qwen-Image's bare names);
      `lora_refusals`: LoRA kinds recognised by their keys and refused by name (FLUX's control LoRAs).
    Sampling
    - `sampling(info, latent, positive, request)` (parts): the `sampling.SamplingPlan` `ParallelModel.sample` runs
      (its Euler loop) for a checkpoint of this family, from ComfyUI's LATENT dict, a CONDITIONING and a
      `sampling.SamplingRequest`: ComfyUI's default graph for it (FLUX.1: KSampler euler/simple on the
      dev/schnell table; FLUX.2: Flux2Scheduler; Qwen-Image: ModelSamplingAuraFlow).
    - `demo`: the module (relative to the backend package) whose `add_arguments(parser)` and `run(args)`
      are `python -m rocm_parallel demo`, for a family that has one (the CLI runs the first).
    The VAE
    - `vae` (parts): the VAE that decodes the family's latents (backend/vae/kind.py `VaeKind`: detection, diffusers
      class, key conversion, ComfyUI's latent around it), read by the patch-parallel VAE nodes; families
      that share a VAE name the same kind.
    """

    name: str
    title: str
    diffusers_class: str
    presets: Mapping[str, Mapping[str, Any]]
    dims: Callable[[Mapping[str, Any]], ModelDims]
    config_from_dims: Callable[[Any], dict[str, Any]]
    variant: Callable[[Mapping[str, Any]], str]
    describe: Callable[[Mapping[str, Any]], str]
    input_channels: Callable[[Mapping[str, Any]], int]
    latent_channels: Callable[[Mapping[str, Any]], int]
    planner: PlannerFacts
    latent: LatentFormat
    geometry: TokenGeometry
    text: TextInputs
    comfy_model: Callable[[Mapping[str, Any]], ComfyModel]
    parts: Callable[[], FamilyParts]
    header: Callable[[], FamilyHeader]  # torch-free: key layout, detection, configs from shapes
    references: ReferenceLatents | None = None
    ref_method: str = ""
    aliases: Mapping[str, str] = field(default_factory=dict)
    lora_prefixes: tuple[str, ...] = ()
    # LoRA kinds the family's users have that the pack cannot apply, known by keys that all appear in them:
    # (keys, ...) -> (what it is, what to use instead); every LoRA is checked against every family's
    lora_refusals: Mapping[tuple[str, ...], tuple[str, str]] = field(default_factory=dict)
    demo: str | None = None

    # The parts that import torch (FamilyParts), read through the record as if they were its fields
    @property
    def build(self) -> Callable[..., nn.Module]:
        return _parts_of(self).build

    @property
    def keys(self) -> KeyLayout:
        return _header_of(self).keys

    @property
    def matches_bfl(self) -> Callable[[Collection[str]], bool]:
        return _header_of(self).matches_bfl

    @property
    def config_from_bfl(self) -> Callable[[Shapes], dict[str, Any]]:
        return _header_of(self).config_from_bfl

    @property
    def config_with_metadata(self) -> Callable[[dict[str, Any], Mapping[str, str]], dict[str, Any]] | None:
        return _header_of(self).config_with_metadata

    @property
    def matches_diffusers(self) -> Callable[[Collection[str]], bool]:
        return _header_of(self).matches_diffusers

    @property
    def config_from_diffusers(self) -> Callable[[Shapes], dict[str, Any]]:
        return _header_of(self).config_from_diffusers

    @property
    def tp(self) -> TensorParallelSpec:
        return _parts_of(self).tp

    @property
    def cp(self) -> ContextParallelSpec:
        return _parts_of(self).cp

    @property
    def call_spec(self) -> CallSpec:
        return _parts_of(self).call_spec

    @property
    def call(self) -> Callable[..., Any]:
        return _parts_of(self).call

    @property
    def model_fn(self) -> Callable[[Any], Callable[..., Any]]:
        return _parts_of(self).model_fn

    @property
    def sampling(self) -> Callable[..., Any]:
        return _parts_of(self).sampling

    @property
    def vae(self) -> VaeKind | None:
        return _parts_of(self).vae

    def default_ref_method(self, config: Mapping[str, Any]) -> str:
        """How reference latents are placed when a call names no method: the checkpoint's own default
        (its ComfyUI unet_config's `default_ref_method`, e.g. Qwen-Image-Edit-2511's), else the family's."""
        return str(self.comfy_model(config).unet_config.get("default_ref_method", self.ref_method))

    def tokens(self, shape: Sequence[int]) -> int:
        """Tokens of one batch entry of a latent of `shape` (`geometry`)."""
        return self.geometry.tokens(shape)

    def token_pixels(self) -> tuple[int, int]:
        """Image pixels per token along (height, width): the patch times the VAE's scale (16 for FLUX.1,
        FLUX.2 and Qwen-Image alike)."""
        _, ph, pw = self.geometry.patch
        return ph * self.latent.downscale, pw * self.latent.downscale

    def planned_size(self, shape: Sequence[int]) -> tuple[int, int, int]:
        """(frames, height, width) in pixels the planner prices for a latent of `shape` ([B, C, H, W] or
        [B, C, T, H, W]): padded to whole patches, as the model pads it, so an odd latent is priced by the
        tokens it becomes. Frames are the video's (1 + temporal scale x (T - 1))."""
        t = int(shape[2]) if len(shape) == 5 else 1
        pt, ph, pw = self.geometry.patch
        rows, cols = -(-int(shape[-2]) // ph) * ph, -(-int(shape[-1]) // pw) * pw
        frames = -(-t // pt) * pt
        scale = self.latent.downscale
        return (frames - 1) * self.latent.temporal_downscale + 1, rows * scale, cols * scale

    def tensor_parallel(self, model: nn.Module, group: Any = None) -> nn.Module:
        """`model` (of this family) sharded in place across `group` (None: the world) with this family's
        TP spec: parallel/tensor.py `apply_tensor_parallel`, the specs passed down from here."""
        from .parallel.tensor import apply_tensor_parallel

        return apply_tensor_parallel(model, group, self.tp, self.dims(model.config))

    def context_parallel(
        self,
        model: nn.Module,
        ring: int = 1,
        ulysses: int = 1,
        *,
        mesh: Any = None,
        attention: str | None = None,
    ) -> nn.Module:
        """`model` (of this family) split over ring x ulysses ranks with this family's CP spec:
        parallel/context.py `apply_context_parallel`, the specs passed down from here."""
        from .parallel.context import apply_context_parallel

        return apply_context_parallel(
            model, ring, ulysses, spec=self.cp, dims=self.dims(model.config), mesh=mesh, attention=attention
        )

    def parameter_shapes(self, config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
        """diffusers parameter name -> shape of a model of `config`: its meta model's (built once per config)."""
        return dict(_parameter_shapes(self, _frozen(config)))

    def sources(self, config: Mapping[str, Any]) -> dict[str, Source]:
        """diffusers parameter name -> where it lives in a BFL checkpoint of `config` (no key prefix)."""
        return self.keys.sources(self.dims(config), self.parameter_shapes(config))

    def bfl_shapes(self, config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
        """BFL key -> shape a checkpoint of `config` has (a fused tensor has as many rows as its parts)."""
        return self.keys.bfl_shapes(self.dims(config), self.parameter_shapes(config))


# One build per family even when two threads read a part first at once (ComfyUI's status route beside a run):
# parts() makes some records afresh, and readers may compare them by identity.
_parts_lock = threading.RLock()


@functools.cache
def _built_parts(family: ModelFamily) -> FamilyParts:
    return family.parts()


def _parts_of(family: ModelFamily) -> FamilyParts:
    """The family's torch-side parts, imported and built once (the first read of any of them)."""
    with _parts_lock:
        return _built_parts(family)


@functools.cache
def _built_header(family: ModelFamily) -> FamilyHeader:
    return family.header()


def _header_of(family: ModelFamily) -> FamilyHeader:
    """The family's header readers (torch-free), imported and built once."""
    with _parts_lock:
        return _built_header(family)


def _frozen(config: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """A hashable copy of a diffusers config (lists, as config.json has them, become tuples)."""
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in config.items()))


@functools.lru_cache(maxsize=64)
def _parameter_shapes(
    family: ModelFamily, config: tuple[tuple[str, Any], ...]
) -> tuple[tuple[str, tuple[int, ...]], ...]:
    model = family.build(dict(config), device="meta")
    return tuple((name, tuple(p.shape)) for name, p in model.state_dict().items())


def build_diffusers(
    model_class: type[nn.Module],
    config: Mapping[str, Any],
    device: Any = "cpu",
    dtype: Any = None,
    seed: int | None = 0,
    init_scale: float = 0.05,
) -> nn.Module:
    """`model_class(**config)` (a diffusers transformer) with random weights from `seed`, none on 'meta'.

    Every family's `build`: the weights are drawn on the CPU in parameter order, so every process builds
    the identical model. Training initialises AdaLN-zero and output projections to zero; everything is
    drawn here so that a parity test exercises every weight. `dtype` defaults to float32.
    """
    import torch
    from torch import nn

    dtype = torch.float32 if dtype is None else dtype
    if str(device) == "meta":
        with torch.device("meta"):
            return nn.Module.to(model_class(**config), dtype=dtype).eval()
    model = model_class(**config).eval()
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * init_scale)
    # nn.Module.to, not ModelMixin.to: the latter warns about float32-kept modules FLUX does not have.
    return nn.Module.to(model, device=device, dtype=dtype)


# --------------------------------------------------------------------------------------------------
# The registry

_REGISTRY: dict[str, ModelFamily] = {}
_loaded = False


def register(family: ModelFamily) -> ModelFamily:
    """Add `family` (its module calls this at import time); a second family of the same name is a bug."""
    held = _REGISTRY.get(family.name)
    if held is not None and held is not family:
        raise ValueError(f"model family '{family.name}' is registered twice ({held.title}, {family.title})")
    _REGISTRY[family.name] = family
    return family


def _load_builtin() -> None:
    """Import the built-in families and put them first, in BUILTIN's order, whatever order their modules were
    imported in: a test or a tool that imports backend/flux2/ before the registry is first read registers
    FLUX.2 first, and "the first family" (detection order, `families()[0]`) must not depend on that."""
    global _loaded
    if not _loaded:
        _loaded = True
        builtin = []
        for module in BUILTIN:
            namespace = vars(importlib.import_module(module, __package__))
            builtin += [f for f in namespace.values() if isinstance(f, ModelFamily) and f not in builtin]
        order = [f for f in builtin if _REGISTRY.get(f.name) is f]
        order += [f for f in _REGISTRY.values() if f not in order]
        _REGISTRY.clear()
        _REGISTRY.update((f.name, f) for f in order)


def families() -> tuple[ModelFamily, ...]:
    """Every registered family, in detection order."""
    _load_builtin()
    return tuple(_REGISTRY.values())


def get_family(name: str) -> ModelFamily:
    """The family called `name`; ConfigError naming the known ones otherwise."""
    _load_builtin()
    if name not in _REGISTRY:
        raise ConfigError(f"model family '{name}' is not known; known families: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def family_for_class(class_name: str | None) -> ModelFamily | None:
    """The family built by the diffusers class named `class_name` (e.g. a config.json's `_class_name`)."""
    return next((f for f in families() if f.diffusers_class == class_name), None)


def family_of(model: Any) -> ModelFamily:
    """The family of a diffusers model, by its class; ConfigError naming the supported classes otherwise."""
    found = family_for_class(type(model).__name__)
    if found is None:
        known = ", ".join(f.diffusers_class for f in families())
        raise ConfigError(
            f"{type(model).__name__} is not the model class of a registered family ({known}); load the "
            "model with diffusers' class for its family"
        )
    return found


def _only(found: Sequence[ModelFamily], what: str) -> ModelFamily | None:
    if len(found) > 1:
        raise RuntimeError(f"{what} is claimed by several families: {', '.join(f.name for f in found)}")
    return found[0] if found else None


def detect_bfl(keys: Collection[str]) -> ModelFamily | None:
    """The family whose BFL / ComfyUI layout these header keys (prefix stripped) are, or None."""
    return _only([f for f in families() if f.matches_bfl(keys)], "this BFL checkpoint")


def detect_diffusers(keys: Collection[str]) -> ModelFamily | None:
    """The family whose diffusers layout these header keys are, or None."""
    return _only([f for f in families() if f.matches_diffusers(keys)], "this diffusers checkpoint")


__all__ = [
    "BUILTIN",
    "ComfyModel",
    "FamilyHeader",
    "FamilyParts",
    "LatentFormat",
    "ModelFamily",
    "PlannerFacts",
    "ReferenceLatents",
    "TextInputs",
    "TokenGeometry",
    "build_diffusers",
    "detect_bfl",
    "detect_diffusers",
    "families",
    "family_for_class",
    "family_of",
    "get_family",
    "register",
]
