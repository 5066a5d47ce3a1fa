"""FLUX.1 as a model family: dev, schnell, Krea, Kontext, Fill and any fine-tune with their shapes.

One entry covers them all because they share diffusers' `FluxTransformer2DModel`, the TP plan and the
BFL key layout; they differ only in what the header shows and in the extra inputs of a model call:

- schnell: no `guidance_in` (ComfyUI's `FluxSchnell`: discrete flow, shift 1).
- Fill: `img_in` takes 96 channels per latent pixel (384 after 2x2 patchify) and ComfyUI appends the
  masked image (16) and the mask (64) to `x` through `c_concat` (comfy/model_base.py `Flux.concat_cond`;
  comfy/model_detection.py reads `in_channels = img_in.weight.shape[1] // 4`, and comfy/supported_models
  `FluxInpaint` matches `in_channels: 96`). Output stays 16 channels.
- Kontext: the same shapes as dev, so the header cannot tell it apart (ComfyUI cannot either); any FLUX.1
  accepts reference latents (ReferenceLatent -> `ref_latents`), which `flux.forward.flux_call` appends
  as extra tokens with their own ids, as comfy/ldm/flux/model.py `Flux._forward` does.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch

from ..family import ComfyModel, LatentFormat, ModelFamily, Shapes, TextInputs, register
from ..parallel.tensor import FLUX_TP_PLAN, apply_tensor_parallel
from .convert import bfl_sources, diffusers_to_bfl, flux_config_from_bfl
from .forward import PATCH, REF_METHODS, flux_call
from .model import build_flux
from .sampling import SCALE_FACTOR, SHIFT_FACTOR, diffusers_model_fn, plan_for

# comfy/supported_models.py FluxInpaint: the Fill model's channels per latent pixel (16 latent + 16 masked
# image + 64 mask, the 8x8 mask pixels under each latent pixel).
FILL_CHANNELS = 96
LATENT = LatentFormat(
    comfy_name="Flux",
    channels=16,
    scale=SCALE_FACTOR,
    shift=SHIFT_FACTOR,
    downscale=8,
    vae="the FLUX VAE (ae.safetensors)",
    empty_node="EmptySD3LatentImage",
)
# T5-XXL tokens (ComfyUI pads a short prompt to 256) and CLIP-L's pooled vector, both from DualCLIPLoader.
TEXT = TextInputs(
    encoder="a FLUX DualCLIPLoader (clip_l + t5xxl, type flux)",
    tokens=256,
    pooled=True,
)


def matches_bfl(keys: Collection[str]) -> bool:
    """BFL double/single blocks with an `img_in` (Chroma has none) and FLUX.1's per-block modulation."""
    blocks = any(k.startswith(("double_blocks.", "single_blocks.")) for k in keys)
    shared_modulation = any(k.startswith("double_stream_modulation") for k in keys)  # FLUX.2's layout
    return blocks and "img_in.weight" in keys and not shared_modulation


def matches_diffusers(keys: Collection[str]) -> bool:
    shared_modulation = any(k.startswith("double_stream_modulation") for k in keys)
    return (
        "x_embedder.weight" in keys
        and any(k.startswith("single_transformer_blocks.") for k in keys)
        and not shared_modulation
    )


def config_from_diffusers(shapes: Shapes) -> dict[str, Any]:
    """The config of a diffusers-keyed single file: derived from the BFL view of its shapes."""
    meta = {k: torch.empty(s, device="meta") for k, s in shapes.items()}
    return flux_config_from_bfl(diffusers_to_bfl(meta))  # ValueError when it is not FLUX.1


def sources(config: Mapping[str, Any]) -> Mapping[str, Any]:
    from ..config import FluxDims

    return bfl_sources(FluxDims.from_diffusers_config(config))


def variant(config: Mapping[str, Any]) -> str:
    return "dev" if config["guidance_embeds"] else "schnell"


def input_channels(config: Mapping[str, Any]) -> int:
    return int(config["in_channels"]) // (PATCH * PATCH)


def describe(config: Mapping[str, Any]) -> str:
    channels = input_channels(config)
    if channels == FILL_CHANNELS:
        return "FLUX.1 Fill"
    if channels != LATENT.channels:
        return f"FLUX.1 with {channels} input channels"
    return f"FLUX.1-{variant(config)}"


def comfy_model(config: Mapping[str, Any]) -> ComfyModel:
    """comfy/model_detection.py's unet_config for this header and the supported_models class it picks."""
    channels = input_channels(config)
    guidance = bool(config["guidance_embeds"])
    if not guidance:
        name = "FluxSchnell"
    elif channels == FILL_CHANNELS:
        name = "FluxInpaint"
    else:
        name = "Flux"
    unet = {
        "image_model": "flux",
        "guidance_embed": guidance,
        "in_channels": channels,
        "out_channels": LATENT.channels,
        "patch_size": PATCH,
    }
    return ComfyModel(config_class=name, unet_config=unet)


FLUX1 = register(
    ModelFamily(
        name="flux1",
        title="FLUX.1",
        diffusers_class="FluxTransformer2DModel",
        build=build_flux,
        tp_plan=FLUX_TP_PLAN,
        apply_tp=lambda model, group: apply_tensor_parallel(model, group, FLUX_TP_PLAN),
        latent=LATENT,
        matches_bfl=matches_bfl,
        config_from_bfl=flux_config_from_bfl,
        bfl_sources=sources,
        matches_diffusers=matches_diffusers,
        config_from_diffusers=config_from_diffusers,
        variant=variant,
        describe=describe,
        input_channels=input_channels,
        latent_channels=lambda config: LATENT.channels,  # Fill's extra inputs are not output channels
        patch=PATCH,
        text=TEXT,
        ref_method=REF_METHODS[0],  # "offset": comfy/ldm/flux/model.py's default for FLUX.1
        comfy_model=comfy_model,
        call=flux_call,
        model_fn=diffusers_model_fn,
        sampling=plan_for,  # KSampler(euler, simple) on the dev / schnell table (flux/sampling.py)
    )
)

__all__ = ["FILL_CHANNELS", "FLUX1", "LATENT", "comfy_model", "describe", "input_channels"]
