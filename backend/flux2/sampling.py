"""FLUX.2 sampling as ComfyUI's FLUX.2 template runs it: Flux2Scheduler's sigmas, euler, FLUX.2's latents.

The template (image_flux2_text_to_image): EmptyFlux2LatentImage, a FLUX.2 CLIPTextEncode, FluxGuidance
([dev]), RandomNoise, BasicGuider, KSamplerSelect(euler), Flux2Scheduler(steps, width, height) and
SamplerCustomAdvanced. Read in comfy_extras/nodes_flux.py and comfy/model_base.py at ComfyUI 0.3.75
(commit 9d8a8179) and 0.33.0, where the schedule is the same:

- `Flux2Scheduler`: mu from the image's tokens and the step count (`empirical_mu`), then
  `e^mu / (e^mu + (1/t - 1))` over `linspace(1, 0, steps + 1)` (the last sigma is 0).
- `model_base.Flux2.extra_conds`: the text features are padded with zeros at the front to 512 tokens;
  guidance is the conditioning's (3.5 when FluxGuidance set none) for models with a guidance embedder.
- `latent_formats.Flux2`: 128 channels at 1/16 of the pixels, process_in/out the identity.

Noise, the empty-latent rule and the Euler loop are every family's (backend/diffusion/sampling.py), as in ComfyUI.
`denoise` < 1 schedules steps/denoise steps and keeps the tail, as ComfyUI's KSampler does with every
scheduler; `shift_mu` (ModelSamplingFlux) does not apply: Flux2Scheduler sets its own shift.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ..config import ConfigError
from ..diffusion.sampling import (
    SamplingPlan,
    SamplingRequest,
    make_plan,
    repeat_to_batch_size,
    single_entry,
    text_features,
)
from ..flux.sampling import SUPPORTED_COND_KEYS, guidance_tensor

if TYPE_CHECKING:
    from ..checkpoint import CheckpointInfo

TEXT_TOKENS = 512  # comfy/model_base.py Flux2.extra_conds pads the text features to 512 tokens


def empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """comfy_extras/nodes_flux.py `compute_empirical_mu`, constant for constant."""
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    if image_seq_len > 4300:
        return float(a2 * image_seq_len + b2)
    m_200 = a2 * image_seq_len + b2
    m_10 = a1 * image_seq_len + b1
    a = (m_200 - m_10) / 190.0
    b = m_200 - 200.0 * a
    return float(a * num_steps + b)


def flux2_schedule(steps: int, width: int, height: int) -> torch.Tensor:
    """`Flux2Scheduler.execute(steps, width, height)` (width and height in pixels): float32 [steps + 1]."""
    mu = empirical_mu(round(width * height / (16 * 16)), steps)
    t = torch.linspace(1, 0, steps + 1)
    # generalized_time_snr_shift(t, mu, 1.0), written as ComfyUI writes it so float32 rounds alike
    return math.exp(mu) / (math.exp(mu) + (1 / t - 1) ** 1.0)


def convert_conditioning(positive: Any, batch: int, info: CheckpointInfo) -> dict[str, Any]:
    """A FLUX.2 CONDITIONING `[[features, {"guidance": ..., "pooled_output": None}]]` -> the model call's
    inputs: the features padded to 512 tokens as ComfyUI pads them, no pooled vector (FLUX.2 takes none)."""
    cond, extras = single_entry(positive, SUPPORTED_COND_KEYS)
    cond = text_features(cond, info.dims.text_dim, info.model_name, info.model_family.text.encoder)
    if cond.shape[1] < TEXT_TOKENS:
        cond = F.pad(cond, (0, 0, TEXT_TOKENS - cond.shape[1], 0))
    return {
        "context": repeat_to_batch_size(cond, batch),
        "y": None,
        "guidance": guidance_tensor(extras, batch, info.model_name) if info.dims.guidance else None,
    }


def plan_for(
    info: CheckpointInfo, latent: Mapping[str, Any], positive: Any, request: SamplingRequest
) -> SamplingPlan:
    """FLUX.2's `ModelFamily.sampling`: the template's schedule for the latent's size, euler, its latents."""
    if request.shift_mu is not None:
        raise ConfigError(
            f"shift_mu is FLUX.1's ModelSamplingFlux shift; {info.model_name} samples with Flux2Scheduler's "
            "schedule, which sets its own shift from the image size and steps: leave shift_mu unset, or pass sigmas"
        )
    family = info.model_family
    fmt = family.latent
    return make_plan(
        latent, request, fmt=fmt, model=info.model_name, channels=family.latent_channels(info.config),
        schedule=lambda n, shape: flux2_schedule(n, shape[-1] * fmt.downscale, shape[-2] * fmt.downscale),
        conditioning=lambda batch: convert_conditioning(positive, batch, info),
    )  # fmt: skip
