"""What the nodes refuse before anything runs, and what the parallel MODEL refuses at run time: inputs
ComfyUI's own model would use and the workers cannot (ControlNet, inputs the family's call does not take,
model patches), bad conditioning widths, latents of another family. Each message names the node to change.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..backend.config import ConfigError
from .inputs import LayoutRequest, ParallelHandle
from .loading import load_options, read_checkpoint
from .registry import Registry

if TYPE_CHECKING:
    from ..backend.checkpoint import CheckpointInfo
    from ..backend.family import ModelFamily

# What the proxy refuses: ComfyUI would pass these to its own Flux model, and ignoring them would change
# the image without a word. Each message names the node to remove.
CONTROLNET_MESSAGE = (
    "ControlNet is not supported by the ROCm Parallel Model yet: remove the ControlNet apply node "
    "(ControlNetApply / ControlNetApplyAdvanced) from the conditioning, or sample with ComfyUI's own "
    "Load Diffusion Model"
)
KV_CACHE_MESSAGE = (
    "ComfyUI's Flux KV Cache node (FluxKVCache) cannot patch the ROCm Parallel Model: it keeps the reference "
    "tokens' keys and values inside the transformer's attention, which runs in the ROCm Parallel workers. "
    "Remove the Flux KV Cache node; the Edit Model Reference Method node set to index_timestep_zero (what "
    "the cache node sets) runs on the ROCm Parallel Model, computing the reference tokens in every step"
)


def references_message(family: ModelFamily) -> str:
    """Why the TP / Ring Attention Sampler refuse the family's reference latents, and the family's own way."""
    refs = family.references
    if refs is None:
        return (
            f"{family.title} takes no reference latents (ReferenceLatent): remove the ReferenceLatent node from "
            "the conditioning"
        )
    graph = (
        f"the {refs.workflow} workflow's graph"
        if refs.workflow
        else f"ComfyUI's own {family.title} edit template with the ROCm Parallel Loader and Model as its model"
    )
    return (
        f"the TP / Ring Attention Sampler do not take {refs.what} (the conditioning carries ReferenceLatent's): "
        f"sample with the ROCm Parallel Model and ComfyUI's own sampler nodes instead ({graph}, with "
        "ReferenceLatent on its conditioning), or remove the ReferenceLatent node"
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
        f"a model patch ({kind}: {', '.join(sorted(names))}) would change the transformer's blocks or "
        "attention, which run in the ROCm Parallel workers and cannot be patched from ComfyUI; remove the node "
        "that adds it (e.g. a PAG, attention-couple or block-patch node) from the ROCm Parallel Model's path"
    )


def unknown_input_message(name: str) -> str:
    return (
        f"ComfyUI passed '{name}' to the diffusion model; the ROCm Parallel Model does not implement it and "
        "ignoring it would change the image. Remove the node that adds it to the conditioning or the model"
    )


def unsupported_forward_inputs(
    control: Any, transformer_options: dict[str, Any], inputs: dict[str, Any], takes: Sequence[str]
) -> str | None:
    """Why the proxy cannot run this forward as ComfyUI's own model would, or None when it can. `takes`:
    the input names the family's model call declares (anything else with a value is refused)."""
    if control is not None:
        return CONTROLNET_MESSAGE
    for name, value in inputs.items():
        if name not in takes and value is not None:
            return ATTENTION_MASK_MESSAGE if name == "attention_mask" else unknown_input_message(name)
    attn1 = (transformer_options.get("patches") or {}).get("attn1_patch") or ()
    if any(type(p).__name__ == "KV_Attn_Input" for p in attn1):  # comfy_extras/nodes_flux.py FluxKVCache
        return KV_CACHE_MESSAGE
    for key in ("patches", "patches_replace"):
        patches = {k: v for k, v in (transformer_options.get(key) or {}).items() if v}
        if patches:
            return patches_message(key, list(patches))
    # diffusion_model wrappers (EasyCache's) are not refused here: the proxy runs them around the call to
    # the workers as ComfyUI's Flux.forward does, and refuses one that reaches for the blocks (comfy_model.py).
    return None


def diffusion_model_wrappers(transformer_options: dict[str, Any]) -> list[str]:
    """The keys of the diffusion_model wrappers (ComfyUI's WrappersMP.DIFFUSION_MODEL) set on this call."""
    wrappers = (transformer_options.get("wrappers") or {}).get("diffusion_model") or {}
    return [str(k) for k, v in wrappers.items() if v]


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


def check_conditioning(name: str, conditioning: Any, info: CheckpointInfo) -> None:
    """Widths against the checkpoint `info` (a SD or SDXL text encoder is the usual mistake), and the
    extras the proxy refuses at run time, refused here before anything starts."""
    family = info.model_family
    text, text_dim, spec = family.text, info.dims.text_dim, family.call_spec
    for i, (cond, extras) in enumerate(_conditioning_entries(name, conditioning)):
        where = f"{name}[{i}]" if len(conditioning) > 1 else name
        if getattr(cond, "ndim", 0) != 3 or cond.shape[-1] != text_dim:
            raise ConfigError(
                f"{where}: the text embedding is {list(getattr(cond, 'shape', []))} but {info.model_name} takes "
                f"[batch, tokens, {text_dim}]; encode the prompt with {text.encoder} and CLIPTextEncode"
            )
        if spec.check_prompt is not None:
            spec.check_prompt(info, cond, extras, where)
        if extras.get("control") is not None:
            raise ConfigError(CONTROLNET_MESSAGE)
        if extras.get("reference_latents") is not None:
            raise ConfigError(references_message(family))
        if extras.get("attention_mask") is not None and "attention_mask" not in spec.names:
            raise ConfigError(ATTENTION_MASK_MESSAGE)


def check_latent(latent: Any, info: CheckpointInfo) -> None:
    """A LATENT ComfyUI's sampling accepts for the checkpoint `info`: any height and width (the model pads
    to the patch size); the family's channels, or an all-zero latent of another width that ComfyUI widens
    itself."""
    family = info.model_family
    channels, scale = family.latent_channels(info.config), family.latent.downscale
    samples = latent.get("samples") if isinstance(latent, dict) else None
    ndims = (4,) if family.latent.dimensions == 2 else (4, 2 + family.latent.dimensions)
    if samples is None or getattr(samples, "ndim", 0) not in ndims:
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
) -> CheckpointInfo:
    """Everything the TP / Ring Attention Sampler can check before a worker starts or a weight loads:
    the checkpoint's header, the layout against it, the conditioning widths, the latent, cfg vs negative.
    Returns the header read (the run carries it: nothing reads it again)."""
    info = read_checkpoint(handle)
    if info.input_channels != info.model_family.latent_channels(info.config):
        raise ConfigError(FILL_MESSAGE.format(model=info.model_name))
    check_latent(latent, info)
    check_conditioning("positive", positive, info)
    if negative is not None:
        check_conditioning("negative", negative, info)
    elif not math.isclose(cfg, 1.0):
        raise ConfigError(
            f"cfg={cfg:g} needs a negative prompt: connect a CONDITIONING to 'negative' (e.g. CLIPTextEncode "
            "with an empty text, or ConditioningZeroOut), or set cfg to 1.0 (guidance-distilled models run at cfg "
            "1.0 with FluxGuidance instead)"
        )
    if sigmas is not None and (getattr(sigmas, "ndim", 0) != 1 or len(sigmas) < 1):
        raise ConfigError(
            f"sigmas must be a 1-D SIGMAS schedule; got shape {list(getattr(sigmas, 'shape', []))}"
        )
    if request.layout is not None:
        model = registry.group_for(handle.devices)  # does not start workers
        model.check_load(info, load_options(handle, request.layout))
    return info
