"""Qwen-Image's model call as data: ComfyUI's QwenImage `forward(x, timestep, context, attention_mask,
ref_latents, ref_latents_method=)` inputs, and the checks one call passes before any rank runs it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..diffusion.call import LATENT_TOKENS, TEXT_TOKENS, CallInput, CallSpec, Inputs
from ..diffusion.checks import check_latent_input, check_text, check_timestep, reference_inputs, text_key_mask

if TYPE_CHECKING:
    import torch

    from ..checkpoint import CheckpointInfo
    from ..config import ModelDims, ParallelLayout

REFERENCE_FIX = "encode the reference image again (VAE Encode into ReferenceLatent)"
QWEN_INPUTS = (
    CallInput("context", tokens=TEXT_TOKENS),
    # ComfyUI 0.33 passes the text encoder's mask (1 = a real token): a boolean key mask on the ranks, None
    # when no token is padding (the call is then the unmasked one, as in ComfyUI)
    CallInput("attention_mask", cast=False),
    CallInput("ref_latents", many=True, tokens=LATENT_TOKENS, fix=REFERENCE_FIX),
    CallInput("ref_latents_method", held=False, batched=False, cast=False),
)


def check_qwen_call(
    info: CheckpointInfo, layout: ParallelLayout, x: torch.Tensor, timestep: torch.Tensor, inputs: Inputs
) -> Inputs:
    """One Qwen-Image call's shapes, by ComfyUI's argument names; the text mask as a boolean key mask."""
    batch = check_latent_input(info, x)
    context = inputs.get("context")
    check_text(info, context, batch)
    check_timestep(timestep, batch)
    refs, method = reference_inputs(info, x, inputs, batch)
    mask = text_key_mask(inputs.get("attention_mask"), context, info)
    return {"context": context, "attention_mask": mask, "ref_latents": refs, "ref_latents_method": method}


def qwen_example(dims: ModelDims, batch: int, text_tokens: int, device: Any) -> Inputs:
    """Empty inputs of a Qwen-Image call of `dims` (the planner's meta probe)."""
    import torch

    return {"context": torch.empty(batch, text_tokens, dims.text_dim, device=device), "ref_latents": ()}


QWEN_CALL = CallSpec(
    inputs=QWEN_INPUTS,
    check=check_qwen_call,
    example=qwen_example,
    positional=("context", "attention_mask", "ref_latents", "ref_latents_method"),
    aliases={"ref_method": "ref_latents_method"},
)

__all__ = ["QWEN_CALL", "QWEN_INPUTS", "check_qwen_call"]
