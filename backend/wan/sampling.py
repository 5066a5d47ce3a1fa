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
TI2V-5B's 48 channels, Wan 2.2's (1/16). Noise and the loop are every family's (backend/sampling.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..config import ConfigError
from ..family import LatentFormat
from ..sampling import (
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

TEMPLATE_SHIFT = 8.0  # text_to_video_wan, image_to_video_wan, video_wan2_2_5B_ti2v (and WAN21's default)
A14B_TEMPLATE_SHIFT = 5.0  # video_wan2_2_14B_t2v / _i2v
TIMESTEPS = 1000
MULTIPLIER = 1000.0  # ModelSamplingSD3: the model gets sigma x 1000
# CLIPTextEncode with the wan (umt5) text encoder sets no pooled vector
SUPPORTED_COND_KEYS = ("pooled_output",)

# comfy/latent_formats.py Wan21 (Wan 2.1 VAE, also Wan 2.2 A14B's) and Wan22 (Wan 2.2 VAE, TI2V-5B)
WAN21_LATENT = LatentFormat(
    comfy_name="Wan21",
    channels=16,
    scale=1.0,
    shift=0.0,
    downscale=8,
    vae="the Wan 2.1 VAE (wan_2.1_vae.safetensors)",
    empty_node="EmptyHunyuanLatentVideo",
    mean=(-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
          0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921),
    std=(2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
         3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160),
    dimensions=3,
    temporal_downscale=4,
)  # fmt: skip
WAN22_LATENT = LatentFormat(
    comfy_name="Wan22",
    channels=48,
    scale=1.0,
    shift=0.0,
    downscale=16,
    vae="the Wan 2.2 VAE (wan2.2_vae.safetensors)",
    empty_node="Wan22ImageToVideoLatent",
    mean=(-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
          -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
          -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
          -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
          -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
          0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667),
    std=(0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
         0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
         0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
         0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
         0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
         0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744),
    dimensions=3,
    temporal_downscale=4,
)  # fmt: skip


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
