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
from .flux.forward import REF_METHODS
from .flux.sampling import SamplingPlan, check_finite, check_real
from .messages import LoadRequest


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
) -> None:
    """The shapes a model call needs, named by ComfyUI's argument names; cheap enough for every step."""
    info = resident.info
    dims, family = info.dims, info.model_family
    channels, latent = info.input_channels, family.latent_channels(info.config)
    given = {"x": x, "timestep": timestep, "context": context, "y (pooled_output)": y, "guidance": guidance}
    for i, ref in enumerate(refs):
        given[f"ref_latents[{i}]"] = ref
    for name, tensor in given.items():
        if torch.is_tensor(tensor):
            check_real(name, tensor)
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
    check_refs(refs, ref_method, batch, channels, latent)
    tokens = family.image_tokens(*x.shape[-2:]) + sum(family.image_tokens(*r.shape[-2:]) for r in refs)
    resident.layout.validate_sequence(tokens)
    check_finite(
        "x", x, "the latent entering this model call is broken: check the nodes before the sampler (a VAE "
        "Encode of a broken image, a latent upscale, a noise node)",
    )  # fmt: skip
    check_finite("timestep", timestep, "it is the sampler's sigma: check the scheduler or SIGMAS input")
    if guidance is not None:
        check_finite("guidance", guidance, "set a finite value with FluxGuidance (e.g. 3.5)")


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


def check_refs(refs: Sequence[torch.Tensor], method: str, batch: int, channels: int, latent: int) -> None:
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
