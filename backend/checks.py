"""What the caller checks before any rank runs: a model call's shapes and values (every step, so cheap:
the latent, sigma and guidance are scanned for NaN and inf each call, the conditioning once per prompt,
when it is sent) and a sampling job (once), each against the resident checkpoint; messages name
ComfyUI's inputs and nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .checkpoint import CheckpointInfo
from .config import ConfigError
from .family import ModelFamily, families
from .flux.sampling import SamplingPlan, check_finite, check_real
from .messages import LoadRequest

# An additive mask value at or below this drops its key (exp of it is 0 in float32): ComfyUI's own masks are
# 0 / -finfo.max (comfy/ldm/qwen_image/model.py turns an integer mask into that form).
DROPPED_KEY = -1e4


def check_sample(
    info: CheckpointInfo,
    positive: Any,
    latent: dict[str, Any],
    *,
    seed: int,
    steps: int,
    denoise: float = 1.0,
    sigmas: Sequence[float] | torch.Tensor | None = None,
    shift_mu: float | None = None,
) -> SamplingPlan:
    """A sampling job validated and decided (noise, sigmas, conditioning) by the checkpoint's family."""
    if not isinstance(latent, dict) or "samples" not in latent:
        raise ConfigError("latent must be a LATENT dict with 'samples' [batch, 16, height/8, width/8]")
    family = info.model_family
    if info.input_channels != family.latent_channels(info.config):
        raise ConfigError(
            f"{info.model_name} takes the masked image and mask in every step ({info.input_channels} input "
            "channels), which sample() does not supply: drive it step by step with forward() (in ComfyUI: "
            "the ROCm Parallel Model with InpaintModelConditioning and KSampler)"
        )
    return family.sampling(
        info, latent["samples"], positive, seed=seed, steps=steps, denoise=denoise, sigmas=sigmas,
        noise_mask=latent.get("noise_mask"), batch_index=latent.get("batch_index"), shift_mu=shift_mu,
    )  # fmt: skip


def check_forward(
    x: torch.Tensor,
    timestep: torch.Tensor,
    context: torch.Tensor,
    y: torch.Tensor,
    guidance: torch.Tensor | None,
    resident: LoadRequest,
    refs: Sequence[torch.Tensor] = (),
    ref_method: str = "offset",
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The shapes a model call needs, named by ComfyUI's argument names; cheap enough for every step.
    Returns the text's key mask (`text_key_mask`) for a family that takes one."""
    info = resident.info
    dims, family = info.dims, info.model_family
    channels, latent = info.input_channels, family.latent_channels(info.config)
    given = {"x": x, "timestep": timestep, "context": context, "y (pooled_output)": y, "guidance": guidance}
    for i, ref in enumerate(refs):
        given[f"ref_latents[{i}]"] = ref
    for name, tensor in given.items():
        if torch.is_tensor(tensor):
            check_real(name, tensor)
    if not _latent_shaped(x, channels, family):
        shape = tuple(x.shape) if torch.is_tensor(x) else type(x).__name__
        if channels == latent:
            raise ConfigError(
                f"x has shape {shape}; {info.model_name} takes {_latent_dims(channels, family)} "
                f"latents (encode with {family.latent.vae}, or use {family.latent.empty_node})"
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
    check_refs(refs, ref_method, batch, channels, latent, info)
    tokens = family.image_tokens(*x.shape[-2:]) + sum(family.image_tokens(*r.shape[-2:]) for r in refs)
    resident.layout.validate_sequence(tokens)
    check_finite(
        "x", x, "the latent entering this model call is broken: check the nodes before the sampler (a VAE "
        "Encode of a broken image, a latent upscale, a noise node)",
    )  # fmt: skip
    check_finite("timestep", timestep, "it is the sampler's sigma: check the scheduler or SIGMAS input")
    if guidance is not None:
        check_finite("guidance", guidance, "set a finite value with FluxGuidance (e.g. 3.5)")

    return text_key_mask(attention_mask, context, info)


def check_conditioning_values(
    context: torch.Tensor, pooled: torch.Tensor, refs: Sequence[torch.Tensor] = ()
) -> None:
    """No NaN or inf in a prompt's tensors (checked once per prompt, when it is first sent)."""
    fix = "re-encode the prompt (a broken text encoder or a bad upstream node)"
    check_finite("context", context, fix)
    check_finite("y (pooled_output)", pooled, fix)
    for i, ref in enumerate(refs):
        check_finite(
            f"ref_latents[{i}]", ref, "encode the reference image again (VAE Encode into ReferenceLatent)"
        )


def _latent_shaped(x: Any, channels: int, family: ModelFamily) -> bool:
    """[B, C, H, W], or the format's [B, C, 1, H, W] (an image in a 3-D latent format: Wan 2.1's)."""
    if not torch.is_tensor(x) or x.shape[1:2] != (channels,) or 0 in x.shape:
        return False
    return x.ndim == 4 or (x.ndim == 2 + family.latent.dimensions == 5 and x.shape[2] == 1)


def _latent_dims(channels: int, family: ModelFamily) -> str:
    if family.latent.dimensions == 3:
        return f"[batch, {channels}, 1, height, width] (or [batch, {channels}, height, width])"
    return f"[batch, {channels}, height, width]"


def text_key_mask(mask: Any, context: torch.Tensor, info: CheckpointInfo) -> torch.Tensor | None:
    """ComfyUI's text `attention_mask` [B, T] as a boolean key mask (True = a real token), or None when no
    token is padding. ComfyUI passes integers (1 real, 0 padding) or its additive form (0, or a value that
    removes the key: -finfo.max); anything else would weigh keys, which no Qwen-Image input does."""
    if mask is None:
        return None
    family = info.model_family
    if not family.text.mask:
        raise ConfigError(
            f"attention_mask is not None; {info.model_name} takes no text mask (ComfyUI's own model would not "
            "use one): remove the node that adds it to the conditioning"
        )
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


def check_refs(
    refs: Sequence[torch.Tensor], method: str, batch: int, channels: int, latent: int, info: CheckpointInfo
) -> None:
    """Reference latents (Kontext, FLUX.2, Qwen-Image-Edit): what the family's ComfyUI model can concatenate,
    placed by a method ComfyUI's own model of the checkpoint's family runs (`ModelFamily.references`)."""
    if not refs:
        return
    check_ref_method(method, batch, info)
    if channels != latent:
        raise ConfigError(
            f"reference latents (ReferenceLatent) cannot be combined with a {channels}-channel model (FLUX.1 "
            "Fill): its tokens are wider than a reference latent's; remove the ReferenceLatent node or load a "
            "FLUX.1 Kontext checkpoint"
        )
    for i, ref in enumerate(refs):
        ok = _latent_shaped(ref, latent, info.model_family)
        if not ok or ref.shape[0] != batch:
            shape = tuple(ref.shape) if torch.is_tensor(ref) else type(ref).__name__
            raise ConfigError(
                f"ref_latents[{i}] has shape {shape}; a reference latent is [{batch}, {latent}, height, width] "
                "(one per latent in the batch): connect a VAE Encode of the reference image to ReferenceLatent"
            )


# ComfyUI's node that sets ref_latents_method (comfy_extras/nodes_flux.py; its display name since 0.17)
METHOD_NODE = "Edit Model Reference Method (FluxKontextMultiReferenceLatentMethod)"


def check_ref_method(method: str, batch: int, info: CheckpointInfo) -> None:
    """`method` is a placement ComfyUI's own model of `info`'s family runs, at this batch; else a
    ConfigError naming why (the family's own reason when another family runs it) and what to set."""
    family = info.model_family
    refs = family.references
    shown = ", ".join("uxo/uno" if m == "uxo" else m for m in refs.methods)
    if method in refs.methods:
        reason = refs.batch_one_with_guidance.get(method)
        if reason is not None and batch > 1 and info.variant == "dev":
            raise ConfigError(
                f"ref_latents_method={method!r} with {info.model_name} at batch {batch}: {reason}. Sample one "
                f"image at a time with cfg 1 ({info.model_name} is guided by FluxGuidance; cfg > 1 batches the "
                f"negative prompt with the positive), or set the {METHOD_NODE} node to "
                f"{family.ref_method!r}"
            )
        return
    others = [f.title for f in families() if method in f.references.methods]
    if others:
        why = refs.refused.get(method, f"ComfyUI's own {family.title} does not run it")
        raise ConfigError(
            f"ref_latents_method={method!r} is a {' and '.join(others)} placement, not one of {family.title}'s "
            f"({shown}): {why}. Set the {METHOD_NODE} node to one of {shown}, or load a "
            f"{' or '.join(others)} checkpoint"
        )
    known = sorted({m for f in families() for m in f.references.methods})
    raise ConfigError(
        f"ref_latents_method={method!r} is not a reference placement ComfyUI's models run ({', '.join(known)}); "
        f"it came with the conditioning (the {METHOD_NODE} node, or a custom node that sets it): set that "
        f"node to one of {shown} for {info.model_name}"
    )
