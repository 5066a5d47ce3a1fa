"""FLUX.2 ([dev], [klein] 4B / 9B and fine-tunes with their shapes) as a model family.

diffusers' Flux2Transformer2DModel, FLUX2_TP (flux2/tp.py), the BFL / ComfyUI key layout of flux2/keys.py,
ComfyUI's `Flux2` latent format (128 channels at 1/16, identity process_in/out) and its model call
(flux2/forward.py). ComfyUI's own detection (comfy/model_detection.py) keys FLUX.2 on
`double_stream_modulation_img.lin.weight`; FLUX.1's entry excludes that key, so the two never overlap.

Every FLUX.2 file loads through the shared loader (backend/checkpoint/), ComfyUI's fp8 "mixed" files included
(per-tensor `weight_scale`, declared by `comfy_quant` tensors or the `_quantization_metadata` header).
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
from .facts import (
    FLUX2_DEV,
    FLUX2_KLEIN_4B,
    FLUX2_KLEIN_9B,
    LATENT,
    REF_METHODS,
    TIMESTEP_ZERO,
    config_from_dims,
    dims,
)

TEXT_TOKENS = 512  # comfy/model_base.py Flux2.extra_conds pads the text features to 512 tokens
# ComfyUI 0.3.75's FLUX.2 text: CLIPLoader type "flux2" with Mistral 3 Small ([dev]) or Qwen 3 ([klein]),
# three hidden layers stacked (15360 / 7680 / 12288 wide); no pooled vector (model_detection: vec_in_dim
# None). Workflow templates image_flux2*.json, comfyui-workflow-templates 0.11.97.
TEXT = TextInputs(
    encoder="a CLIPLoader of type flux2 (mistral_3_small_flux2 for [dev], qwen_3_4b / qwen_3_8b for [klein])",
    tokens=TEXT_TOKENS,
    encoders={"flux2-dev": "mistral3-24b", "flux2-klein": "qwen3-4b", "flux2-klein-9b": "qwen3-8b"},
)

# Live activations at a forward's peak (PlannerFacts), calibrated as FLUX.1's (flux/family.py) on
# FLUX.2 [dev], 1024x1024 + 512 text tokens, bf16: single 21.6 units, TP 2 12.6, TP 4 and 8 8.25; ring 4,
# Ulysses 4 and ring 2 x Ulysses 2 within 4 % with the planner's ring terms. Its single block is wider
# before the split: one packed projection of 3 + 2 x 3 = 9 x hidden ([q | k | v | gate | up]) where FLUX.1
# has 3 + 4 + 4 (GELU).
PLANNER = PlannerFacts(table_name="FLUX.2", attention_full=3.55, attention_sharded=18.0, block_full=8.25)


# FLUX.2's reference images: index (its default), offset, uxo and, since ComfyUI 0.17, index_timestep_zero
# (flux2/forward.py). The shipped FLUX.2 graph samples with SamplerCustomAdvanced; ReferenceLatent goes on
# its conditioning.
REFERENCES = ReferenceLatents(
    methods=REF_METHODS,
    what="FLUX.2's reference images",
    workflow="flux2_dev_parallel_model_tp4",
    batch_one_with_guidance={
        TIMESTEP_ZERO: (
            "ComfyUI's own FLUX.2 runs it only at batch 1 when the model has a guidance embedder "
            "(comfy/ldm/flux/model.py adds the guidance embedding of the batch to the timestep embedding "
            "of twice the batch: a shape error), so there is no result of ComfyUI's to match"
        )
    },
)


def variant(config: Mapping[str, Any]) -> str:
    """ "dev" takes a guidance value ([dev]); [klein] has no guidance embedder ("schnell"-like)."""
    return "dev" if config["guidance_embeds"] else "schnell"


def describe(config: Mapping[str, Any]) -> str:
    heads, blocks = config["num_attention_heads"], (config["num_layers"], config["num_single_layers"])
    known = {
        (48, (8, 48)): "FLUX.2 [dev]",
        (24, (5, 20)): "FLUX.2 [klein] 4B",
        (32, (8, 24)): "FLUX.2 [klein] 9B",
    }
    return known.get((heads, blocks), f"FLUX.2 ({heads} heads, {blocks[0]}+{blocks[1]} blocks)")


def input_channels(config: Mapping[str, Any]) -> int:
    return int(config["in_channels"])  # patch size 1: one token per latent pixel


def comfy_model(config: Mapping[str, Any]) -> ComfyModel:
    """comfy/model_detection.py's FLUX.2 unet_config for this header; supported_models.Flux2."""
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    unet = {
        "image_model": "flux2",
        "axes_dim": list(config["axes_dims_rope"]),
        "num_heads": config["num_attention_heads"],
        "mlp_ratio": config["mlp_ratio"],
        "theta": config["rope_theta"],
        "out_channels": config.get("out_channels") or config["in_channels"],
        "global_modulation": True,
        "mlp_silu_act": True,
        "qkv_bias": False,
        "ops_bias": False,
        "default_ref_method": "index",
        "ref_index_scale": 10.0,
        "txt_ids_dims": [3],
        "patch_size": 1,
        "in_channels": config["in_channels"],
        "hidden_size": hidden,
        "context_in_dim": config["joint_attention_dim"],
        "vec_in_dim": None,
        "depth": config["num_layers"],
        "depth_single_blocks": config["num_single_layers"],
        "guidance_embed": bool(config["guidance_embeds"]),
        "yak_mlp": False,
        "txt_norm": False,
    }
    return ComfyModel(config_class="Flux2", unet_config=unet)


def header() -> FamilyHeader:
    """FLUX.2's checkpoint key layout and header detection (ModelFamily.header): torch-free."""
    from . import keys

    return FamilyHeader(
        keys=keys.FLUX2_KEYS,
        matches_bfl=keys.matches_bfl,
        config_from_bfl=keys.config_from_bfl,
        matches_diffusers=keys.matches_diffusers,
        config_from_diffusers=keys.config_from_diffusers,
    )


def parts() -> FamilyParts:
    """FLUX.2's parts that import torch (ModelFamily.parts): imported the first time one is read."""
    from ..flux.call import flux_call_spec
    from ..parallel.context import ContextParallelSpec
    from .forward import flux2_call, flux2_model_fn
    from .model import build_flux2
    from .sampling import plan_for
    from .tp import FLUX2_TP
    from .vae import FLUX2_VAE

    # diffusers 0.42.1 transformer_flux2.py: double blocks, and single blocks whose packed QKV+MLP projection
    # feeds the same attention call; the forward returns its own output class.
    cp = ContextParallelSpec(
        processors={
            "Flux2AttnProcessor": "diffusers.models.transformers.transformer_flux2",
            "Flux2ParallelSelfAttnProcessor": "diffusers.models.transformers.transformer_flux2",
        },
        output_class="diffusers.models.transformers.transformer_flux2.Flux2Transformer2DModelOutput",
    )
    return FamilyParts(
        build=build_flux2,
        tp=FLUX2_TP,
        cp=cp,
        # ComfyUI's Flux.forward inputs; the pooled vector `y` is dropped (model_detection: vec_in_dim None)
        call_spec=flux_call_spec(pooled=False),
        call=flux2_call,
        model_fn=flux2_model_fn,
        sampling=plan_for,  # Flux2Scheduler + euler, as ComfyUI's FLUX.2 template (flux2/sampling.py)
        vae=FLUX2_VAE,  # flux2-vae.safetensors: AutoencoderKLFlux2, batch-norm latent (flux2/vae.py)
    )


FLUX2 = register(
    ModelFamily(
        name="flux2",
        title="FLUX.2",
        diffusers_class="Flux2Transformer2DModel",
        presets={"flux2-dev": FLUX2_DEV, "flux2-klein": FLUX2_KLEIN_4B, "flux2-klein-9b": FLUX2_KLEIN_9B},
        dims=dims,
        config_from_dims=config_from_dims,
        variant=variant,
        describe=describe,
        input_channels=input_channels,
        latent_channels=lambda config: int(config.get("out_channels") or config["in_channels"]),
        planner=PLANNER,
        latent=LATENT,
        geometry=TokenGeometry((1, 1, 1)),  # one token per latent pixel
        text=TEXT,
        ref_method="index",  # comfy/model_detection.py flux2 `default_ref_method`
        references=REFERENCES,
        comfy_model=comfy_model,
        parts=parts,
        header=header,
    )
)

__all__ = ["FLUX2", "LATENT", "TEXT_TOKENS", "comfy_model", "describe", "input_channels"]
