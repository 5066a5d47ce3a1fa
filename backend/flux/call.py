"""FLUX.1's model call as data: ComfyUI's `Flux.forward(x, timestep, context, y, guidance, ref_latents,
ref_latents_method=)` inputs, and the checks one call passes before any rank runs it (backend/diffusion/call.py).

FLUX.2 takes the same inputs but the pooled vector (flux2/family.py builds its spec from `flux_call_spec`).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

from ..config import ConfigError
from ..diffusion.call import LATENT_TOKENS, TEXT_TOKENS, CallInput, CallSpec, Inputs
from ..diffusion.checks import check_latent_input, check_text, check_timestep, check_vector, reference_inputs

if TYPE_CHECKING:
    import torch

    from ..checkpoint import CheckpointInfo
    from ..config import ParallelLayout
    from .dims import FluxDims

REFERENCE_FIX = "encode the reference image again (VAE Encode into ReferenceLatent)"


def flux_inputs() -> tuple[CallInput, ...]:
    """ComfyUI's Flux.forward inputs: the text features, CLIP-L's pooled vector (FLUX.1; FLUX.2's model
    ignores it), FluxGuidance's value (every step), Kontext / FLUX.2 reference latents and their placement."""
    return (
        CallInput("context", tokens=TEXT_TOKENS),
        CallInput("y", shown="y (pooled_output)"),
        CallInput("guidance", held=False, fix="set a finite value with FluxGuidance (e.g. 3.5)"),
        CallInput("ref_latents", many=True, tokens=LATENT_TOKENS, fix=REFERENCE_FIX),
        CallInput("ref_latents_method", held=False, batched=False, cast=False),
    )


def check_flux_call(
    info: CheckpointInfo,
    layout: ParallelLayout,
    x: torch.Tensor,
    timestep: torch.Tensor,
    inputs: Inputs,
    pooled: bool = True,
) -> Inputs:
    """One FLUX call's shapes, named by ComfyUI's argument names; cheap enough for every step. `pooled`:
    the model takes CLIP-L's pooled vector (FLUX.1); otherwise `y` is dropped, as ComfyUI's Flux2 drops it."""
    dims = info.dims
    batch = check_latent_input(info, x)
    check_text(info, inputs.get("context"), batch)
    if pooled:
        check_vector(info, "y (pooled_output)", inputs.get("y"), batch, dims.pooled_dim, "CLIP-L pooled")
    check_timestep(timestep, batch)
    guidance = inputs.get("guidance")
    if not dims.guidance:
        guidance = None  # ComfyUI's Flux ignores it without a guidance embedder (schnell, FLUX.2 [klein])
    elif guidance is None:
        raise ConfigError(
            f"guidance is None; {info.model_name} needs one per latent (FluxGuidance, e.g. 3.5)"
        )
    refs, method = reference_inputs(info, x, inputs, batch, guided=dims.guidance)
    y = inputs["y"] if pooled else None
    return {
        "context": inputs["context"],
        "y": y,
        "guidance": guidance,
        "ref_latents": refs,
        "ref_latents_method": method,
    }


def flux_example(dims: FluxDims, batch: int, text_tokens: int, device: Any) -> Inputs:
    """Empty inputs of a FLUX call of `dims` (the planner's meta probe)."""
    import torch

    return {
        "context": torch.empty(batch, text_tokens, dims.text_dim, device=device),
        "y": torch.empty(batch, dims.pooled_dim, device=device),
        "guidance": torch.empty(batch, device=device) if dims.guidance else None,
        "ref_latents": (),
    }


def check_pooled_prompt(info: CheckpointInfo, cond: Any, extras: Any, where: str) -> None:
    """A FLUX.1 CONDITIONING's pooled_output is CLIP-L's width (a SD / SDXL encoder is the usual mistake)."""
    pooled = extras.get("pooled_output")
    if pooled is not None and pooled.shape[-1] != info.dims.pooled_dim:
        raise ConfigError(
            f"{where}: pooled_output is {list(pooled.shape)} but {info.model_name} takes [batch, "
            f"{info.dims.pooled_dim}] (CLIP-L); encode the prompt with {info.model_family.text.encoder}"
        )


def flux_call_spec(pooled: bool) -> CallSpec:
    """FLUX.1's call (`pooled`) or FLUX.2's."""
    return CallSpec(
        inputs=flux_inputs(),
        check=partial(check_flux_call, pooled=pooled),
        example=flux_example,
        # ComfyUI's Flux.forward order (our API's before the family declared its call)
        positional=("context", "y", "guidance", "ref_latents", "ref_latents_method"),
        aliases={"ref_method": "ref_latents_method"},
        check_prompt=check_pooled_prompt if pooled else None,
    )


FLUX1_CALL = flux_call_spec(pooled=True)

__all__ = ["FLUX1_CALL", "check_flux_call", "flux_call_spec", "flux_inputs"]
