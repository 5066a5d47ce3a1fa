"""What the caller checks before any rank runs: a sampling job (once) and the pieces every family's call
checks are made of (backend/diffusion/call.py runs a call's checks on every step: cheap ones only), each against the
resident checkpoint; messages name ComfyUI's inputs and nodes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..checkpoint import CheckpointInfo
from ..config import ConfigError
from ..family import families
from .sampling import SamplingPlan, SamplingRequest

# An additive mask value at or below this drops its key (exp of it is 0 in float32): ComfyUI's own masks are
# 0 / -finfo.max (comfy/ldm/qwen_image/model.py turns an integer mask into that form).
DROPPED_KEY = -1e4


def check_sample(
    info: CheckpointInfo, positive: Any, latent: Mapping[str, Any], request: SamplingRequest
) -> SamplingPlan:
    """A sampling job validated and decided (noise, sigmas, the call's inputs) by the checkpoint's family."""
    if not isinstance(latent, Mapping) or "samples" not in latent:
        fmt = info.model_family.latent
        raise ConfigError(
            f"latent must be a LATENT dict with 'samples' as {fmt.empty_node} or VAE Encode make it; got "
            f"{type(latent).__name__}"
        )
    family = info.model_family
    if info.input_channels != family.latent_channels(info.config):
        raise ConfigError(
            f"{info.model_name} takes the masked image and mask in every step ({info.input_channels} input "
            "channels), which sample() does not supply: drive it step by step with forward() (in ComfyUI: "
            "the ROCm Parallel Model with InpaintModelConditioning and KSampler)"
        )
    return family.sampling(info, latent, positive, request)


# --- pieces of a family's call checks (backend/diffusion/call.py `CallSpec.check`) ------------------------------


def latent_shaped(x: Any, channels: int, info: CheckpointInfo) -> bool:
    """[B, C, H, W], or the format's [B, C, T, H, W] (T = 1 unless the family takes several frames)."""
    family = info.model_family
    if not torch.is_tensor(x) or x.shape[1:2] != (channels,) or 0 in x.shape:
        return False
    if x.ndim == 4:
        return True
    return x.ndim == 2 + family.latent.dimensions == 5 and (x.shape[2] == 1 or family.geometry.frames)


def latent_dims(channels: int, info: CheckpointInfo) -> str:
    family = info.model_family
    if family.latent.dimensions == 3:
        frames = "frames" if family.geometry.frames else "1"
        return f"[batch, {channels}, {frames}, height, width] (or [batch, {channels}, height, width])"
    return f"[batch, {channels}, height, width]"


def check_latent_input(info: CheckpointInfo, x: Any) -> int:
    """x as the checkpoint's model takes it (its input channels: the latent's plus any a ComfyUI node
    concatenates); returns its batch."""
    family = info.model_family
    channels, latent = info.input_channels, family.latent_channels(info.config)
    if not latent_shaped(x, channels, info):
        shape = tuple(x.shape) if torch.is_tensor(x) else type(x).__name__
        if channels == latent:
            raise ConfigError(
                f"x has shape {shape}; {info.model_name} takes {latent_dims(channels, info)} latents (encode "
                f"with {family.latent.vae}, or use {family.latent.empty_node})"
            )
        raise ConfigError(
            f"x has shape {shape}; {info.model_name} takes [batch, {channels}, height, width]: the {latent}-channel "
            f"latent with the {channels - latent} channels of the masked image and mask appended "
            "(ComfyUI's InpaintModelConditioning supplies them)"
        )
    return int(x.shape[0])


def check_timestep(timestep: Any, batch: int) -> None:
    if not torch.is_tensor(timestep) or timestep.numel() != batch:
        raise ConfigError(f"timestep must hold one value per latent ({batch}); got {timestep!r}")


def check_text(info: CheckpointInfo, context: Any, batch: int, name: str = "context") -> None:
    """The text features [batch, tokens, text_dim] of the checkpoint's encoder."""
    width, encoder = info.dims.text_dim, info.model_family.text.encoder
    if (
        not torch.is_tensor(context)
        or context.ndim != 3
        or context.shape[0] != batch
        or context.shape[-1] != width
    ):
        shape = tuple(context.shape) if torch.is_tensor(context) else type(context).__name__
        raise ConfigError(
            f"{name} has shape {shape}; {info.model_name} expects [{batch}, tokens, {width}] (text "
            f"features for each latent): encode the prompt with {encoder}"
        )


def check_vector(info: CheckpointInfo, name: str, value: Any, batch: int, width: int, what: str) -> None:
    """A [batch, width] vector input (a pooled text vector, an image embedding)."""
    if not torch.is_tensor(value) or tuple(value.shape) != (batch, width):
        shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
        raise ConfigError(
            f"{name} has shape {shape}; {info.model_name} expects [{batch}, {width}] ({what}): encode the "
            f"prompt with {info.model_family.text.encoder}"
        )


def text_key_mask(mask: Any, context: torch.Tensor, info: CheckpointInfo) -> torch.Tensor | None:
    """ComfyUI's text `attention_mask` [B, T] as a boolean key mask (True = a real token), or None when no
    token is padding. ComfyUI passes integers (1 real, 0 padding) or its additive form (0, or a value that
    removes the key: -finfo.max); anything else would weigh keys, which no text mask does."""
    if mask is None:
        return None
    family = info.model_family
    batch, tokens = context.shape[:2]
    if not torch.is_tensor(mask) or tuple(mask.shape) != (batch, tokens) or mask.is_complex():
        shape = tuple(mask.shape) if torch.is_tensor(mask) else type(mask).__name__
        raise ConfigError(
            f"attention_mask has shape {shape}; {info.model_name} takes [{batch}, {tokens}] (one flag per text "
            f"token of each prompt, 1 = real, 0 = padding) as {family.text.encoder} gives it"
        )
    if mask.is_floating_point():
        keys = mask == 0
        if not bool((keys | (mask <= DROPPED_KEY)).all()):
            raise ConfigError(
                "attention_mask holds additive values other than 0 and large negatives; a text mask keeps or "
                "drops whole tokens: pass 1 / 0 per token (the text encoder's mask)"
            )
    else:
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ConfigError("attention_mask must hold 1 (a real token) or 0 (padding) per token")
        keys = mask != 0
    return None if bool(keys.all()) else keys.cpu()


# --- reference latents ------------------------------------------------------------------------------


def check_refs(
    refs: Sequence[torch.Tensor],
    method: str,
    batch: int,
    channels: int,
    latent: int,
    info: CheckpointInfo,
    guided: bool = False,
) -> None:
    """Reference latents (ReferenceLatent, ComfyUI's edit models): what the family's ComfyUI model can
    concatenate, placed by a method ComfyUI's own model of the checkpoint's family runs (`references`).
    `guided`: the checkpoint has a guidance embedder (some placements then run at batch 1 only)."""
    if not refs:
        return
    family = info.model_family
    if family.references is None:
        raise ConfigError(
            f"{info.model_name} takes no reference latents (ReferenceLatent); remove the ReferenceLatent node "
            "from the conditioning"
        )
    check_ref_method(method, batch, info, guided)
    if channels != latent:
        raise ConfigError(
            f"reference latents (ReferenceLatent) cannot be combined with a {channels}-channel model "
            f"({info.model_name}): its tokens are wider than a reference latent's; remove the ReferenceLatent "
            "node or load a checkpoint that takes references"
        )
    for i, ref in enumerate(refs):
        ok = latent_shaped(ref, latent, info)
        if not ok or ref.shape[0] != batch:
            shape = tuple(ref.shape) if torch.is_tensor(ref) else type(ref).__name__
            raise ConfigError(
                f"ref_latents[{i}] has shape {shape}; a reference latent is [{batch}, {latent}, height, width] "
                "(one per latent in the batch): connect a VAE Encode of the reference image to ReferenceLatent"
            )


# ComfyUI's node that sets ref_latents_method (comfy_extras/nodes_flux.py; its display name since 0.17)
METHOD_NODE = "Edit Model Reference Method (FluxKontextMultiReferenceLatentMethod)"


def check_ref_method(method: str, batch: int, info: CheckpointInfo, guided: bool = False) -> None:
    """`method` is a placement ComfyUI's own model of `info`'s family runs, at this batch; else a
    ConfigError naming why (the family's own reason when another family runs it) and what to set."""
    family = info.model_family
    refs = family.references
    assert refs is not None
    shown = ", ".join("uxo/uno" if m == "uxo" else m for m in refs.methods)
    if method in refs.methods:
        reason = refs.batch_one_with_guidance.get(method)
        if reason is not None and batch > 1 and guided:
            raise ConfigError(
                f"ref_latents_method={method!r} with {info.model_name} at batch {batch}: {reason}. Sample one "
                f"image at a time with cfg 1 ({info.model_name} is guided by FluxGuidance; cfg > 1 batches the "
                f"negative prompt with the positive), or set the {METHOD_NODE} node to "
                f"{family.ref_method!r}"
            )
        return
    others = [f.title for f in families() if f.references is not None and method in f.references.methods]
    if others:
        why = refs.refused.get(method, f"ComfyUI's own {family.title} does not run it")
        raise ConfigError(
            f"ref_latents_method={method!r} is a {' and '.join(others)} placement, not one of {family.title}'s "
            f"({shown}): {why}. Set the {METHOD_NODE} node to one of {shown}, or load a "
            f"{' or '.join(others)} checkpoint"
        )
    known = sorted({m for f in families() if f.references is not None for m in f.references.methods})
    raise ConfigError(
        f"ref_latents_method={method!r} is not a reference placement ComfyUI's models run ({', '.join(known)}); "
        f"it came with the conditioning (the {METHOD_NODE} node, or a custom node that sets it): set that "
        f"node to one of {shown} for {info.model_name}"
    )


def reference_inputs(
    info: CheckpointInfo, x: torch.Tensor, inputs: dict[str, Any], batch: int, guided: bool = False
) -> tuple[tuple[torch.Tensor, ...], str]:
    """The call's reference latents (a tuple, empty when none) and their placement (the checkpoint's default
    when the call names none), checked."""
    refs = tuple(inputs.get("ref_latents") or ())
    method = inputs.get("ref_latents_method") or info.model_family.default_ref_method(info.config)
    channels, latent = info.input_channels, info.model_family.latent_channels(info.config)
    check_refs(refs, method, batch, channels, latent, info, guided)
    return refs, method
