"""FLUX.2 ([dev], [klein] 4B / 9B and fine-tunes with their shapes) as a model family.

diffusers' Flux2Transformer2DModel, FLUX2_TP_PLAN, the BFL / ComfyUI key layout of flux2/convert.py,
ComfyUI's `Flux2` latent format (128 channels at 1/16, identity process_in/out) and its model call
(flux2/forward.py). ComfyUI's own detection (comfy/model_detection.py) keys FLUX.2 on
`double_stream_modulation_img.lin.weight`; FLUX.1's entry excludes that key, so the two never overlap.

Every FLUX.2 file loads through the shared loader (flux/load.py), ComfyUI's fp8 "mixed" files included
(per-tensor `weight_scale`, declared by `comfy_quant` tensors or the `_quantization_metadata` header).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from ..config import FluxDims
from ..family import ComfyModel, LatentFormat, ModelFamily, Shapes, TextInputs, register
from ..parallel.tensor import FLUX2_TP_PLAN, apply_tensor_parallel
from .convert import FLUX2_MARKERS, flux2_config_from_bfl, flux2_sources
from .forward import flux2_call, flux2_model_fn
from .model import build_flux2
from .sampling import plan_for

LATENT = LatentFormat(
    comfy_name="Flux2", channels=128, scale=1.0, shift=0.0, downscale=16,
    vae="the FLUX.2 VAE (flux2-vae.safetensors)", empty_node="EmptyFlux2LatentImage",
)  # fmt: skip
TEXT_TOKENS = 512  # comfy/model_base.py Flux2.extra_conds pads the text features to 512 tokens
# ComfyUI 0.3.75's FLUX.2 text: CLIPLoader type "flux2" with Mistral 3 Small ([dev]) or Qwen 3 ([klein]),
# three hidden layers stacked (15360 / 7680 / 12288 wide); no pooled vector (model_detection: vec_in_dim
# None). Workflow templates image_flux2*.json, comfyui-workflow-templates 0.11.97.
TEXT = TextInputs(
    encoder="a CLIPLoader of type flux2 (mistral_3_small_flux2 for [dev], qwen_3_4b / qwen_3_8b for [klein])",
    tokens=TEXT_TOKENS,
    pooled=False,
)


def matches_bfl(keys: Collection[str]) -> bool:
    return "img_in.weight" in keys and any(k in keys for k in FLUX2_MARKERS)


def matches_diffusers(keys: Collection[str]) -> bool:
    return "x_embedder.weight" in keys and "double_stream_modulation_img.linear.weight" in keys


def config_from_diffusers(shapes: Shapes) -> dict[str, Any]:
    """The config of a diffusers-keyed FLUX.2 file: its shapes mapped to the BFL view, then read as BFL."""
    hidden, in_channels = shapes["x_embedder.weight"]
    head_dim = next(s[0] for k, s in shapes.items() if k.endswith("attn.norm_q.weight"))
    single = len({k.split(".")[1] for k in shapes if k.startswith("single_transformer_blocks.")})
    if single:
        mlp = (shapes["single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight"][0] - 3 * hidden) // 2
    else:
        mlp = shapes["transformer_blocks.0.ff.linear_out.weight"][1]
    dims = FluxDims(
        heads=hidden // head_dim,
        head_dim=head_dim,
        double_blocks=len({k.split(".")[1] for k in shapes if k.startswith("transformer_blocks.")}),
        single_blocks=single,
        guidance=any(k.startswith("time_guidance_embed.guidance_embedder.") for k in shapes),
        mlp_ratio=mlp / hidden,
        text_dim=shapes["context_embedder.weight"][1],
        in_channels=in_channels,
    )
    bfl: dict[str, tuple[int, ...]] = {}
    for name, source in flux2_sources(dims).items():
        shape = shapes[name]
        rows = max(b for _, b in source.rows) if source.rows else shape[0]
        bfl[source.key] = (max(rows, bfl.get(source.key, (0,))[0]), *shape[1:])
    return flux2_config_from_bfl(bfl)


def sources(config: Mapping[str, Any]) -> Mapping[str, Any]:
    return flux2_sources(FluxDims.from_diffusers_config(config))


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


FLUX2 = register(
    ModelFamily(
        name="flux2",
        title="FLUX.2",
        diffusers_class="Flux2Transformer2DModel",
        build=build_flux2,
        tp_plan=FLUX2_TP_PLAN,
        apply_tp=lambda model, group: apply_tensor_parallel(model, group, FLUX2_TP_PLAN),
        latent=LATENT,
        matches_bfl=matches_bfl,
        config_from_bfl=flux2_config_from_bfl,
        bfl_sources=sources,
        matches_diffusers=matches_diffusers,
        config_from_diffusers=config_from_diffusers,
        variant=variant,
        describe=describe,
        input_channels=input_channels,
        latent_channels=lambda config: int(config.get("out_channels") or config["in_channels"]),
        patch=1,
        text=TEXT,
        ref_method="index",  # comfy/model_detection.py flux2 `default_ref_method`
        comfy_model=comfy_model,
        call=flux2_call,
        model_fn=flux2_model_fn,
        sampling=plan_for,  # Flux2Scheduler + euler, as ComfyUI's FLUX.2 template (flux2/sampling.py)
    )
)

__all__ = ["FLUX2", "LATENT", "TEXT_TOKENS", "comfy_model", "describe", "input_channels"]
