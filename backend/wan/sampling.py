"""Wan sampling as ComfyUI's Wan templates run it headless: ModelSamplingSD3, the `simple` schedule, Euler.

The templates (comfyui-workflow-templates in 0.33.0's environment): text_to_video_wan (Wan 2.1 T2V 1.3B) and
video_wan2_2_5B_ti2v set **ModelSamplingSD3 shift 8** (also ComfyUI's own default for every Wan:
supported_models.WAN21_T2V `sampling_settings`) with KSampler uni_pc / simple at cfg 5-6;
video_wan2_2_14B_t2v / _i2v set shift 5 on both A14B experts (KSamplerAdvanced euler / simple, 4 steps with
the lightx2v LoRA). A Wan 2.2 A14B expert has the Wan 2.1 14B's shapes, so the header cannot tell them
apart: shift 8 unless the request's `shift_mu` says 5 (as the node's input does).

`ParallelModel.sample` runs one model (an A14B graph is two samplers: the ROCm Parallel Model with ComfyUI's
KSamplerAdvanced), the positive prompt only (cfg 1) and **Euler** rather than the templates' uni_pc:
ComfyUI's KSampler on the ROCm Parallel Model runs uni_pc, cfg and the two-expert split itself.
ModelSamplingSD3 is `ModelSamplingDiscreteFlow` with multiplier 1000: sigma(t) = shift t / (1 + (shift - 1) t)
over t = 1/1000 .. 1 computed as comfy/model_sampling.py does, and the model gets sigma x 1000
(`SamplingPlan.multiplier`). Latents: Wan 2.1's format (16 channels, 1/8, 4 frames per latent frame) or, for
TI2V-5B's 48 channels, Wan 2.2's (1/16). Noise and the loop are every family's (backend/diffusion/sampling.py).
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
from ..family import LatentFormat
from .facts import WAN21_LATENT, WAN22_LATENT  # comfy/latent_formats.py Wan21, Wan22 (torch-free)

if TYPE_CHECKING:
    from ..checkpoint import CheckpointInfo

TEMPLATE_SHIFT = 8.0  # text_to_video_wan, image_to_video_wan, video_wan2_2_5B_ti2v (and WAN21's default)
A14B_TEMPLATE_SHIFT = 5.0  # video_wan2_2_14B_t2v / _i2v
TIMESTEPS = 1000
MULTIPLIER = 1000.0  # ModelSamplingSD3: the model gets sigma x 1000
# CLIPTextEncode with the wan (umt5) text encoder sets no pooled vector
SUPPORTED_COND_KEYS = ("pooled_output",)


def latent_format(config: Mapping[str, Any]) -> LatentFormat:
    """The latent format of a checkpoint: Wan 2.2's for 48 output channels (TI2V-5B), Wan 2.1's otherwise
    (supported_models.WAN22_T2V matches out_dim 48)."""
    return WAN22_LATENT if int(config.get("out_channels") or config["in_channels"]) == 48 else WAN21_LATENT


def time_snr_shift(shift: float, t: torch.Tensor) -> torch.Tensor:
    """comfy/model_sampling.py `time_snr_shift`, operation for operation."""
    if shift == 1.0:
        return t
    return shift * t / (1 + (shift - 1) * t)


def sd3_table(shift: float = TEMPLATE_SHIFT, timesteps: int = TIMESTEPS) -> torch.Tensor:
    """ModelSamplingSD3's sigmas: ModelSamplingDiscreteFlow.set_parameters(shift, multiplier=1000)."""
    t = (torch.arange(1, timesteps + 1, 1) / timesteps) * MULTIPLIER
    return time_snr_shift(shift, t / MULTIPLIER)


def convert_conditioning(positive: Any, batch: int, info: CheckpointInfo) -> dict[str, Any]:
    """A Wan CONDITIONING `[[features, {"pooled_output": None}]]` -> the call's inputs, repeated to the
    latent batch (no image: ParallelModel.sample runs text-to-video)."""
    cond, _ = single_entry(positive, SUPPORTED_COND_KEYS)
    cond = text_features(cond, info.dims.text_dim, info.model_name, info.model_family.text.encoder)
    return {"context": repeat_to_batch_size(cond, batch)}


def plan_for(
    info: CheckpointInfo, latent: Mapping[str, Any], positive: Any, request: SamplingRequest
) -> SamplingPlan:
    """Wan's `ModelFamily.sampling`: Euler on ModelSamplingSD3's `simple` schedule, shift 8 as the 2.1 and
    TI2V-5B templates set it (the request's `shift_mu`: another shift, e.g. the A14B templates' 5)."""
    shift_mu = request.shift_mu
    shift = TEMPLATE_SHIFT if shift_mu is None else shift_mu
    if isinstance(shift, bool) or not isinstance(shift, int | float) or not 0.0 <= shift <= 100.0:
        raise ConfigError(
            f"shift_mu={shift_mu!r} is ModelSamplingSD3's shift for {info.model_name}: a number from 0 to 100 "
            f"(the Wan 2.1 and TI2V-5B templates' is {TEMPLATE_SHIFT:g}, the Wan 2.2 A14B ones' {A14B_TEMPLATE_SHIFT:g})"
        )
    table = sd3_table(float(shift))
    family = info.model_family
    return make_plan(
        latent, request, fmt=latent_format(info.config), model=info.model_name,
        channels=family.latent_channels(info.config), frames=True,
        schedule=lambda n, shape: simple_schedule(table, n),
        conditioning=lambda batch: convert_conditioning(positive, batch, info),
        multiplier=MULTIPLIER,
    )  # fmt: skip


__all__ = [
    "A14B_TEMPLATE_SHIFT",
    "TEMPLATE_SHIFT",
    "WAN21_LATENT",
    "WAN22_LATENT",
    "convert_conditioning",
    "latent_format",
    "plan_for",
    "sd3_table",
]
