"""Wan's model call as data: ComfyUI's WanModel `forward(x, timestep, context, clip_fea=None,
time_dim_concat=None, **kwargs)` inputs, and the checks one call passes before any rank runs it.

What ComfyUI's model classes hand the diffusion model (comfy/model_base.py WAN21 / WAN22, 0.33.0):
`context` (umt5), `clip_fea` (CLIPVisionEncode's penultimate states, through WanImageToVideo), `time_dim_concat`
(a latent appended along the frames) and, from WAN22 with a noise mask, `denoise_mask`, which ComfyUI's
WanModel takes and ignores (it already made the per-frame timesteps: `process_timestep`). The I2V image
latent and mask come inside x (`c_concat`). Whatever else ComfyUI passes with a value (reference_latent,
context_latents of other Wan graphs) is refused by name, as for every family.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..config import ConfigError
from ..diffusion.call import LATENT_TOKENS, TEXT_TOKENS, CallInput, CallSpec, Inputs
from ..diffusion.checks import check_latent_input, check_text

if TYPE_CHECKING:
    from ..checkpoint import CheckpointInfo
    from ..config import ParallelLayout
    from .keys import WanDims

CLIP_VISION = "a CLIPVisionLoader (clip_vision_h) and CLIPVisionEncode into WanImageToVideo"
WAN_INPUTS = (
    CallInput("context", tokens=TEXT_TOKENS),
    CallInput("clip_fea", fix=f"encode the start image again ({CLIP_VISION})"),
    CallInput(
        "time_dim_concat",
        tokens=LATENT_TOKENS,
        fix="encode the frames again (the node that sets time_dim_concat)",
    ),
    # WAN22's noise mask: taken and dropped by the check (ComfyUI's WanModel ignores it)
    CallInput("denoise_mask", cast=False),
)


def check_timesteps(timestep: Any, batch: int, frames: int) -> None:
    """One timestep per latent, or one per latent frame ([batch, frames]: Wan 2.2's noise mask)."""
    if torch.is_tensor(timestep) and (
        timestep.numel() == batch or (timestep.ndim == 2 and timestep.shape[0] == batch)
    ):
        if timestep.ndim == 2 and timestep.shape[1] not in (1, frames):
            raise ConfigError(
                f"timestep has shape {tuple(timestep.shape)}; per-frame timesteps are [{batch}, {frames}] "
                "(one per latent frame, as ComfyUI's Wan 2.2 makes them from the latent's noise mask)"
            )
        return
    shape = tuple(timestep.shape) if torch.is_tensor(timestep) else timestep
    raise ConfigError(
        f"timestep must hold one value per latent ({batch}) or per latent frame ([{batch}, {frames}]); got {shape}"
    )


def check_wan_call(
    info: CheckpointInfo, layout: ParallelLayout, x: torch.Tensor, timestep: torch.Tensor, inputs: Inputs
) -> Inputs:
    """One Wan call's shapes, by ComfyUI's argument names; `clip_fea` dropped where the checkpoint has no
    image embedder and `denoise_mask` always (ComfyUI's model ignores both there)."""
    dims = info.dims
    batch = check_latent_input(info, x)
    context = inputs.get("context")
    check_text(info, context, batch)
    frames = int(x.shape[2]) if x.ndim == 5 else 1
    check_timesteps(timestep, batch, frames)
    clip = inputs.get("clip_fea")
    if clip is not None and not dims.image:
        clip = None  # ComfyUI's WanModel without img_emb ignores it (e.g. Wan 2.2 I2V A14B)
    if clip is not None and (
        not torch.is_tensor(clip) or clip.ndim != 3 or clip.shape[0] != batch or clip.shape[-1] != 1280
    ):
        shape = tuple(clip.shape) if torch.is_tensor(clip) else type(clip).__name__
        raise ConfigError(
            f"clip_fea has shape {shape}; {info.model_name} takes [{batch}, tokens, 1280] (CLIP-H's penultimate "
            f"states): use {CLIP_VISION}"
        )
    concat = inputs.get("time_dim_concat")
    if concat is not None:
        want = (batch, int(x.shape[1]), int(x.shape[-2]), int(x.shape[-1]))
        got = tuple(concat.shape) if torch.is_tensor(concat) else ()
        if len(got) != 5 or (got[0], got[1], got[3], got[4]) != want:
            raise ConfigError(
                f"time_dim_concat has shape {got or type(concat).__name__}; {info.model_name} takes "
                f"[{batch}, {want[1]}, frames, {want[2]}, {want[3]}] (a latent of x's size, appended along the frames)"
            )
    return {"context": context, "clip_fea": clip, "time_dim_concat": concat, "denoise_mask": None}


def wan_example(dims: WanDims, batch: int, text_tokens: int, device: Any) -> Inputs:
    """Empty inputs of a Wan call of `dims` (the planner's meta probe): the text only."""
    return {"context": torch.empty(batch, text_tokens, dims.text_dim, device=device)}


WAN_CALL = CallSpec(
    inputs=WAN_INPUTS,
    check=check_wan_call,
    example=wan_example,
    positional=("context", "clip_fea", "time_dim_concat"),
)

__all__ = ["WAN_CALL", "WAN_INPUTS", "check_timesteps", "check_wan_call", "wan_example"]
