"""Qwen-Image (and Qwen-Image-Edit, -Edit-2509, -Edit-2511, fine-tunes with their shapes) as a model family.

diffusers' QwenImageTransformer2DModel with ComfyUI's RoPE (forward.py), QWEN_TP (tp.py: the modulation
sharded too), QWEN_CP (cp.py: the text mask as key validity), the identity key layout (keys.py), ComfyUI's
Wan 2.1 latent format (16 channels at 1/8, per-channel mean/std, 5-D latents) and ComfyUI's model call.
ComfyUI detects Qwen-Image by `txt_norm.weight` (comfy/model_detection.py); FLUX.1's and FLUX.2's matchers
need `img_in` + double/single blocks, which Qwen-Image has not, so no two families claim one header.

The Edit models differ from Qwen-Image only in their inputs: reference latents after the image's tokens
(ReferenceLatent, TextEncodeQwenImageEdit[Plus]) and the vision tokens in the prompt. Edit-2511 files carry
ComfyUI's `__index_timestep_zero__` marker, which makes "index_timestep_zero" their default placement.
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
from .facts import LATENT, PATCH, QWEN_IMAGE, QWEN_IMAGE_EDIT_2511, REF_METHODS, config_from_dims, dims

# ComfyUI's Qwen-Image text (comfy/text_encoders/qwen_image.py): Qwen2.5-VL-7B's last hidden state, the chat
# template's prefix cut off, not padded: the prompt's own tokens (a long prompt ~ 250; an edit adds the
# image's vision tokens: ~1340 for TextEncodeQwenImageEdit, ~200 per image for ...EditPlus). No pooled
# vector; a mask only where a batch of prompts has padding.
TEXT = TextInputs(
    encoder="a CLIPLoader of type qwen_image (qwen_2.5_vl_7b) and CLIPTextEncode or TextEncodeQwenImageEdit",
    tokens=256,
    encoders={"qwen-image": "qwen2.5-vl-7b", "qwen-image-edit-2511": "qwen2.5-vl-7b"},
)

# Live activations at a forward's peak (PlannerFacts): FLUX.1's units (flux/family.py), checked with
# torch's MemTracker on the meta device (testing/meta.py), Qwen-Image bf16 at 1024x1024 + 256 text tokens,
# by `bench planner --model qwen-image`: within 10 % but unsplit (+20 %) and tp 4 (-9.5 %); see BENCHMARKS.md
# "Planner vs measurement: Qwen-Image". Qwen-Image has dual-stream blocks only: the
# attention peak holds the block input and both streams' norms (full width) and q/k/v with their float32
# RoPE temporaries; the MLP's 4 x hidden GELU branch is sharded too.
# Qwen-Image-Edit's reference images (comfy/ldm/qwen_image/model.py): every placement ComfyUI's QwenImage
# runs, at any batch (its modulation takes the [t, 0] timesteps without a guidance embedder).
REFERENCES = ReferenceLatents(methods=REF_METHODS, what="Qwen-Image-Edit's reference images")

PLANNER = PlannerFacts(table_name="Qwen-Image", attention_full=3.35, attention_sharded=14.0, block_full=8.35)


def variant(config: Mapping[str, Any]) -> str:
    """'edit-2511' (the references modulated at timestep 0 by default) or 'image'; Qwen-Image-Layered is
    refused here, whatever layout it came in."""
    if config.get("use_additional_t_cond") or config.get("use_layer3d_rope"):
        from . import keys

        keys.checked([keys.LAYERED_KEY])
    if config.get("guidance_embeds"):
        from ..checkpoint.files import CheckpointError

        raise CheckpointError(
            "this Qwen-Image config has guidance_embeds=True (a guidance-distilled variant ComfyUI does not "
            "load); use a Qwen-Image or Qwen-Image-Edit transformer"
        )
    return "edit-2511" if config.get("zero_cond_t") else "image"


def describe(config: Mapping[str, Any]) -> str:
    heads, blocks = config["num_attention_heads"], config["num_layers"]
    name = "Qwen-Image-Edit-2511" if config.get("zero_cond_t") else "Qwen-Image"
    if (heads, blocks, config["joint_attention_dim"]) == (24, 60, 3584):
        return name
    return f"{name} ({heads} heads, {blocks} blocks)"


def input_channels(config: Mapping[str, Any]) -> int:
    return int(config["in_channels"]) // (PATCH * PATCH)


def latent_channels(config: Mapping[str, Any]) -> int:
    return int(config.get("out_channels") or input_channels(config))


def comfy_model(config: Mapping[str, Any]) -> ComfyModel:
    """comfy/model_detection.py's qwen_image unet_config (it reads in_channels and num_layers, and the
    2511 marker on 0.33) with the widths ComfyUI hard-codes written out (a proxy creates no model from
    them); supported_models.QwenImage."""
    unet: dict[str, Any] = {
        "image_model": "qwen_image",
        "in_channels": int(config["in_channels"]),
        "num_layers": int(config["num_layers"]),
        "patch_size": PATCH,
        "out_channels": latent_channels(config),
        "num_attention_heads": int(config["num_attention_heads"]),
        "attention_head_dim": int(config["attention_head_dim"]),
        "joint_attention_dim": int(config["joint_attention_dim"]),
        "axes_dims_rope": list(config["axes_dims_rope"]),
    }
    if config.get("zero_cond_t"):
        unet["default_ref_method"] = "index_timestep_zero"
    return ComfyModel(config_class="QwenImage", unet_config=unet)


def header() -> FamilyHeader:
    """Qwen-Image's checkpoint key layout and header detection (ModelFamily.header): torch-free."""
    from . import keys

    return FamilyHeader(
        keys=keys.QWEN_KEYS,
        matches_bfl=keys.matches,
        config_from_bfl=keys.config_from_shapes,
        matches_diffusers=keys.matches,
        config_from_diffusers=keys.config_from_shapes,
    )


def parts() -> FamilyParts:
    """Qwen-Image's parts that import torch (ModelFamily.parts): imported the first time one is read."""
    from .call import QWEN_CALL
    from .cp import QWEN_CP
    from .forward import qwen_call, qwen_model_fn
    from .model import build_qwen_image
    from .sampling import plan_for
    from .tp import QWEN_TP
    from .vae import QWEN_IMAGE_VAE

    return FamilyParts(
        build=build_qwen_image,
        tp=QWEN_TP,
        cp=QWEN_CP,
        call_spec=QWEN_CALL,
        call=qwen_call,
        model_fn=qwen_model_fn,
        sampling=plan_for,  # ModelSamplingAuraFlow 3.1 + KSampler euler/simple, as the template (sampling.py)
        vae=QWEN_IMAGE_VAE,  # the Wan 2.1 causal 3-D VAE (qwen_image/vae.py)
    )


QWEN_IMAGE_FAMILY = register(
    ModelFamily(
        name="qwen_image",
        title="Qwen-Image",
        diffusers_class="QwenImageTransformer2DModel",
        presets={"qwen-image": QWEN_IMAGE, "qwen-image-edit-2511": QWEN_IMAGE_EDIT_2511},
        # Qwen-Image-Edit and -Edit-2509 are Qwen-Image's transformer with other inputs
        aliases={"qwen-image-edit": "qwen-image", "qwen-image-edit-2509": "qwen-image"},
        dims=dims,
        config_from_dims=config_from_dims,
        variant=variant,
        describe=describe,
        input_channels=input_channels,
        latent_channels=latent_channels,
        planner=PLANNER,
        latent=LATENT,
        geometry=TokenGeometry((1, PATCH, PATCH)),  # 2 x 2 latent pixels per token, one frame
        text=TEXT,
        ref_method="index",  # comfy/ldm/qwen_image/model.py's default (0.3.75: `kwargs.get(..., "index")`)
        references=REFERENCES,
        comfy_model=comfy_model,
        parts=parts,
        header=header,
        lora_prefixes=("",),  # comfy/lora.py maps QwenImage's bare module names (the Qwen / DiffSynth format)
    )
)

__all__ = ["LATENT", "QWEN_IMAGE_FAMILY", "TEXT", "comfy_model", "describe", "input_channels", "variant"]
