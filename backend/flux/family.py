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

from collections.abc import Mapping
from typing import Any

from ..family import (
    ComfyModel,
    FamilyHeader,
    FamilyParts,
    ModelFamily,
    PlannerFacts,
    ReferenceLatents,
    TextInputs,
    TokenGeometry,
    register,
)
from .facts import FLUX_DEV, FLUX_SCHNELL, LATENT, PATCH, REF_METHODS, config_from_dims, dims
from .facts import variant as variant

# comfy/supported_models.py FluxInpaint: the Fill model's channels per latent pixel (16 latent + 16 masked
# image + 64 mask, the 8x8 mask pixels under each latent pixel).
FILL_CHANNELS = 96
# T5-XXL tokens (ComfyUI pads a short prompt to 256) and CLIP-L's pooled vector, both from DualCLIPLoader.
TEXT = TextInputs(
    encoder="a FLUX DualCLIPLoader (clip_l + t5xxl, type flux)",
    tokens=256,
    # CLIP-L (0.25 GB) stays in ComfyUI beside the T5 and is not priced
    encoders={"flux1-dev": "t5-xxl", "flux1-schnell": "t5-xxl"},
)

# Live activations at a forward's peak (PlannerFacts). Calibrated with torch's MemTracker on the meta device
# (the GPU's flash attention standing in, no score matrix), bf16; a FLUX with 24 heads x 16 and FLUX.1-dev
# gave the same units to 1 % (see `bench planner` and BENCHMARKS.md "Planner vs measurement").
#
# * Peak 1, inside a single-stream block's attention (RoPE): the block input, its concatenation and its
#   norm at full width, never sharded (3 + 0.35 for RoPE tables and norms), plus the MLP branch (4 x
#   hidden: projection and GELU), q/k/v and their float32 norm/RoPE temporaries: 14 units, which TP splits.
# * Peak 2, in the fused double-stream block when TP has shrunk peak 1: the row-parallel partial sums,
#   their concatenation for the one all-reduce, the bias-added outputs and both residual streams, all at
#   full width: 8.35 units whatever the TP degree (measured at TP 4 and 8).
PLANNER = PlannerFacts(table_name="FLUX", attention_full=3.35, attention_sharded=14.0, block_full=8.35)


# Kontext's placements. Not "index_timestep_zero" (ComfyUI 0.33's fourth): it needs the shared modulation of
# FLUX.2; ComfyUI's own FLUX.1 fails on it (modulation of [2B] rows against a [B] image stream).
REFERENCES = ReferenceLatents(
    methods=REF_METHODS,
    what="FLUX.1 Kontext's reference latents",
    workflow="flux1_kontext_dev_ksampler_parallel_model",
    refused={
        "index_timestep_zero": (
            "it modulates the reference tokens as at timestep 0, which takes FLUX.2's shared modulation; "
            "FLUX.1 modulates in every block from one timestep, and ComfyUI's own FLUX.1 fails on it with a "
            "shape error"
        )
    },
)


# BFL's Canny / Depth control LoRAs: ComfyUI recognises them by these bare keys (comfy/lora_convert.py) and
# turns them into reshape_weight + set_weight + diff_b patches that widen img_in.
CONTROL_MARKERS = ("img_in.lora_A.weight", "single_blocks.0.norm.key_norm.scale")
LORA_REFUSALS = {
    CONTROL_MARKERS: (
        f"a FLUX control LoRA (Canny/Depth: '{CONTROL_MARKERS[0]}' widens the image input, '{CONTROL_MARKERS[1]}' "
        "replaces norm scales)",
        "Use the matching FLUX control checkpoint (flux1-canny-dev, flux1-depth-dev) instead",
    )
}


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


def header() -> FamilyHeader:
    """FLUX.1's checkpoint key layout and header detection (ModelFamily.header): torch-free."""
    from . import keys

    return FamilyHeader(
        keys=keys.FLUX1_KEYS,
        matches_bfl=keys.matches_bfl,
        config_from_bfl=keys.config_from_bfl,
        matches_diffusers=keys.matches_diffusers,
        config_from_diffusers=keys.config_from_diffusers,
    )


def parts() -> FamilyParts:
    """FLUX.1's parts that import torch (ModelFamily.parts): imported the first time one is read."""
    from ..parallel.context import ContextParallelSpec
    from .call import FLUX1_CALL
    from .forward import flux_call
    from .model import build_flux
    from .sampling import diffusers_model_fn, plan_for
    from .tp import FLUX_TP
    from .vae import FLUX1_VAE

    return FamilyParts(
        build=build_flux,
        tp=FLUX_TP,
        # Context parallelism rebuilds diffusers' FluxAttnProcessor (double and single blocks alike).
        cp=ContextParallelSpec(
            processors={"FluxAttnProcessor": "diffusers.models.transformers.transformer_flux"}
        ),
        call_spec=FLUX1_CALL,
        call=flux_call,
        model_fn=diffusers_model_fn,
        sampling=plan_for,  # KSampler(euler, simple) on the dev / schnell table (flux/sampling.py)
        vae=FLUX1_VAE,  # ae.safetensors: AutoencoderKL, 16 channels (flux/vae.py)
    )


FLUX1 = register(
    ModelFamily(
        name="flux1",
        title="FLUX.1",
        diffusers_class="FluxTransformer2DModel",
        presets={"flux1-dev": FLUX_DEV, "flux1-schnell": FLUX_SCHNELL},
        aliases={"dev": "flux1-dev", "schnell": "flux1-schnell"},  # the names before FLUX.2
        dims=dims,
        config_from_dims=config_from_dims,
        variant=variant,
        describe=describe,
        input_channels=input_channels,
        latent_channels=lambda config: LATENT.channels,  # Fill's extra inputs are not output channels
        planner=PLANNER,
        latent=LATENT,
        geometry=TokenGeometry((1, PATCH, PATCH)),  # 2 x 2 latent pixels per token
        text=TEXT,
        ref_method=REF_METHODS[0],  # "offset": comfy/ldm/flux/model.py's default for FLUX.1
        references=REFERENCES,
        comfy_model=comfy_model,
        parts=parts,
        header=header,
        lora_refusals=LORA_REFUSALS,
        demo=".flux.demo",  # `python -m rocm_parallel demo`: FLUX.1-dev-shaped random weights
    )
)

__all__ = ["FILL_CHANNELS", "FLUX1", "LATENT", "comfy_model", "describe", "input_channels"]
