"""Qwen-Image sampling as ComfyUI's Qwen-Image template runs it: ModelSamplingAuraFlow, KSampler euler/simple.

The template (comfyui-workflow-templates `image_qwen_image`, in 0.3.75's and 0.33's packages): UNETLoader,
CLIPLoader (qwen_image) + CLIPTextEncode, EmptySD3LatentImage, **ModelSamplingAuraFlow shift 3.1**, KSampler
(euler, simple; cfg 2.5 with an empty negative prompt). Read in comfy_extras/nodes_model_advanced.py and
comfy/model_sampling.py (0.3.75 and 0.33.0, the same):

- ModelSamplingAuraFlow = ModelSamplingSD3 with multiplier 1: `ModelSamplingDiscreteFlow`, sigma(t) =
  shift t / (1 + (shift - 1) t) over t = 1/1000 .. 1, the timestep handed to the model is sigma itself.
  Without the node the model's own default is ModelSamplingFlux with shift 1.15 (supported_models.QwenImage);
  the template always sets it, so `ParallelFlux.sample` follows the template (`shift_mu` replaces 3.1, as
  the node's `shift` input does).
- latent_formats.Wan21: 16 channels at 1/8, per-channel mean/std, 5-D latents [B, 16, 1, H, W]; an
  EmptySD3LatentImage's 4-D zeros are taken as ComfyUI takes them (fix_empty_latent_channels unsqueezes).

`ParallelFlux.sample` runs the positive prompt only (cfg 1): ComfyUI's KSampler on the ROCm Parallel Model
runs every cfg (nodes/comfy_model.py). Noise and the Euler loop are FLUX.1's (flux/sampling.py), as in
ComfyUI.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..config import ConfigError
from ..flux.sampling import (
    FluxConditioning,
    SamplingPlan,
    check_finite,
    check_real,
    make_plan,
    repeat_to_batch_size,
    simple_schedule,
    single_entry,
)

if TYPE_CHECKING:
    from ..checkpoint import CheckpointInfo

TEMPLATE_SHIFT = 3.1  # image_qwen_image's ModelSamplingAuraFlow
TIMESTEPS = 1000  # ModelSamplingDiscreteFlow's table
# CLIPTextEncode with the qwen_image text encoder sets no pooled vector (None) and a mask only when the
# tokens have padding, which one prompt never has (comfy/text_encoders/qwen_image.py drops an all-ones mask)
SUPPORTED_COND_KEYS = ("pooled_output",)


def time_snr_shift(shift: float, t: torch.Tensor) -> torch.Tensor:
    """comfy/model_sampling.py `time_snr_shift`, operation for operation (float32 rounds alike)."""
    if shift == 1.0:
        return t
    return shift * t / (1 + (shift - 1) * t)


def aura_flow_table(shift: float = TEMPLATE_SHIFT, timesteps: int = TIMESTEPS) -> torch.Tensor:
    """ModelSamplingAuraFlow's sigmas: ModelSamplingDiscreteFlow.set_parameters(shift, multiplier=1.0)."""
    multiplier = 1.0
    t = (torch.arange(1, timesteps + 1, 1) / timesteps) * multiplier
    return time_snr_shift(shift, t / multiplier)


def convert_conditioning(positive: Any, batch: int, info: CheckpointInfo) -> FluxConditioning:
    """A Qwen-Image CONDITIONING `[[features, {"pooled_output": None}]]` -> model inputs (no pooled vector,
    no guidance), repeated to the latent batch."""
    cond, _ = single_entry(positive, SUPPORTED_COND_KEYS)
    text_dim, encoder = info.dims.text_dim, info.model_family.text.encoder
    if not torch.is_tensor(cond) or cond.ndim != 3 or cond.shape[-1] != text_dim or min(cond.shape[:2]) < 1:
        shape = tuple(cond.shape) if torch.is_tensor(cond) else type(cond).__name__
        raise ConfigError(
            f"conditioning tensor has shape {shape}; {info.model_name} expects [batch, tokens, {text_dim}]: "
            f"encode the prompt with {encoder}"
        )
    check_real("conditioning tensor", cond)
    check_finite(
        "conditioning tensor", cond, "re-encode the prompt (a broken text encoder or a bad upstream node)"
    )
    return FluxConditioning(
        encoder_hidden_states=repeat_to_batch_size(cond.to(torch.float32), batch),
        pooled_projections=torch.zeros(batch, 0),
        guidance=None,
    )


def plan_for(
    info: CheckpointInfo,
    latent: torch.Tensor,
    positive: Any,
    *,
    seed: int,
    steps: int,
    denoise: float = 1.0,
    sigmas: Sequence[float] | torch.Tensor | None = None,
    noise_mask: torch.Tensor | None = None,
    batch_index: Sequence[int] | None = None,
    shift_mu: float | None = None,
) -> SamplingPlan:
    """Qwen-Image's `ModelFamily.sampling`: KSampler(euler, simple) on ModelSamplingAuraFlow's table, shift
    3.1 as the template sets it (`shift_mu`: another shift, as the node's input)."""
    shift = TEMPLATE_SHIFT if shift_mu is None else shift_mu
    if isinstance(shift, bool) or not isinstance(shift, int | float) or not 0.0 <= shift <= 100.0:
        raise ConfigError(
            f"shift_mu={shift_mu!r} is ModelSamplingAuraFlow's shift for {info.model_name}: a number from 0 to "
            f"100 (the template's is {TEMPLATE_SHIFT})"
        )
    table = aura_flow_table(float(shift))
    family = info.model_family
    return make_plan(
        latent, seed, steps, denoise, sigmas, noise_mask, batch_index, fmt=family.latent, model=info.model_name,
        channels=family.latent_channels(info.config),
        schedule=lambda n, shape: simple_schedule(table, n),
        conditioning=lambda batch: convert_conditioning(positive, batch, info),
    )  # fmt: skip


__all__ = ["TEMPLATE_SHIFT", "aura_flow_table", "convert_conditioning", "plan_for", "time_snr_shift"]
