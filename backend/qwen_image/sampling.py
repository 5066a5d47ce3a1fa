"""Qwen-Image sampling as ComfyUI's Qwen-Image template runs it: ModelSamplingAuraFlow, KSampler euler/simple.

The template (comfyui-workflow-templates `image_qwen_image`, in 0.3.75's and 0.33's packages): UNETLoader,
CLIPLoader (qwen_image) + CLIPTextEncode, EmptySD3LatentImage, **ModelSamplingAuraFlow shift 3.1**, KSampler
(euler, simple; cfg 2.5 with an empty negative prompt). Read in comfy_extras/nodes_model_advanced.py and
comfy/model_sampling.py (0.3.75 and 0.33.0, the same):

- ModelSamplingAuraFlow = ModelSamplingSD3 with multiplier 1: `ModelSamplingDiscreteFlow`, sigma(t) =
  shift t / (1 + (shift - 1) t) over t = 1/1000 .. 1, the timestep handed to the model is sigma itself.
  Without the node the model's own default is ModelSamplingFlux with shift 1.15 (supported_models.QwenImage);
  the template always sets it, so `ParallelModel.sample` follows the template (`shift_mu` replaces 3.1, as
  the node's `shift` input does).
- latent_formats.Wan21: 16 channels at 1/8, per-channel mean/std, 5-D latents [B, 16, 1, H, W]; an
  EmptySD3LatentImage's 4-D zeros are taken as ComfyUI takes them (fix_empty_latent_channels unsqueezes).

`ParallelModel.sample` runs the positive prompt only (cfg 1): ComfyUI's KSampler on the ROCm Parallel Model
runs every cfg (nodes/comfy_model.py). Noise and the Euler loop are every family's (backend/diffusion/sampling.py), as in
ComfyUI.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..config import ConfigError
from ..diffusion.sampling import (
    SamplingPlan,
    SamplingRequest,
    make_plan,
    repeat_to_batch_size,
    simple_schedule,
    single_entry,
    text_features,
)

if TYPE_CHECKING:
    from ..checkpoint import CheckpointInfo

TEMPLATE_SHIFT = 3.1  # image_qwen_image's ModelSamplingAuraFlow
TIMESTEPS = 1000  # ModelSamplingDiscreteFlow's table
# CLIPTextEncode with the qwen_image text encoder sets no pooled vector (None) and a mask only when the
# tokens have padding (comfy/text_encoders/qwen_image.py drops an all-ones mask); ComfyUI 0.33's QwenImage
# hands the mask to the model (model_base.QwenImage.extra_conds; 0.3.75 dropped it), as `sample` does
SUPPORTED_COND_KEYS = ("pooled_output", "attention_mask")


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


def convert_conditioning(positive: Any, batch: int, info: CheckpointInfo) -> dict[str, Any]:
    """A Qwen-Image CONDITIONING `[[features, {"pooled_output": None, "attention_mask": mask?}]]` -> the
    model call's inputs (no pooled vector, no guidance; the text mask when the prompt has padding), repeated
    to the latent batch as ComfyUI's CONDRegular repeats them. The call's checks read the mask's shape and
    values (checks.text_key_mask) before a rank runs."""
    cond, extras = single_entry(positive, SUPPORTED_COND_KEYS)
    cond = text_features(cond, info.dims.text_dim, info.model_name, info.model_family.text.encoder)
    inputs = {"context": repeat_to_batch_size(cond, batch)}
    mask = extras.get("attention_mask")
    if mask is not None:
        shaped = torch.is_tensor(mask) and mask.ndim > 0  # any other value: the call's checks name it
        inputs["attention_mask"] = repeat_to_batch_size(mask, batch) if shaped else mask
    return inputs


def plan_for(
    info: CheckpointInfo, latent: Mapping[str, Any], positive: Any, request: SamplingRequest
) -> SamplingPlan:
    """Qwen-Image's `ModelFamily.sampling`: KSampler(euler, simple) on ModelSamplingAuraFlow's table, shift
    3.1 as the template sets it (the request's `shift_mu`: another shift, as the node's input)."""
    shift_mu = request.shift_mu
    shift = TEMPLATE_SHIFT if shift_mu is None else shift_mu
    if isinstance(shift, bool) or not isinstance(shift, int | float) or not 0.0 <= shift <= 100.0:
        raise ConfigError(
            f"shift_mu={shift_mu!r} is ModelSamplingAuraFlow's shift for {info.model_name}: a number from 0 to "
            f"100 (the template's is {TEMPLATE_SHIFT})"
        )
    table = aura_flow_table(float(shift))
    family = info.model_family
    return make_plan(
        latent, request, fmt=family.latent, model=info.model_name, channels=family.latent_channels(info.config),
        schedule=lambda n, shape: simple_schedule(table, n),
        conditioning=lambda batch: convert_conditioning(positive, batch, info),
    )  # fmt: skip


__all__ = ["TEMPLATE_SHIFT", "aura_flow_table", "convert_conditioning", "plan_for", "time_snr_shift"]
