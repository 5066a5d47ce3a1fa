"""Wan 2.1 and Wan 2.2 (T2V, I2V, the A14B experts, TI2V-5B) as a model family.

diffusers' WanTransformer3DModel with ComfyUI's RoPE, timestep embedding and I2V context split (forward.py,
attention.py), WAN_TP (tp.py: heads and FFN split, the shared time projection gathered, Q/K norms across
heads), WAN_CP (cp.py: the video tokens split, the text cross-attended whole), ComfyUI's key layout
(keys.py), ComfyUI's Wan 2.1 latent format (Wan 2.2's for TI2V-5B: sampling.py) and ComfyUI's model call.

What the proxy MODEL is (comfy/supported_models.py, 0.33.0, matched in its order): out_dim 48 -> WAN22_T2V
(TI2V-5B: model_base.WAN22, per-frame timesteps from a noise mask); an image embedder -> WAN21_I2V (36
channels in; 48: WAN21_FunControl2V); otherwise WAN21_T2V, also for Wan 2.2 I2V A14B's 36 channels (its
`concat_cond` appends WanImageToVideo's mask and image latent). ComfyUI's WAN21.concat_cond reads the input
channels from `diffusion_model.patch_embedding.weight`, which the proxy carries as an empty meta tensor
(`ComfyModel.weights`).
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
    TextInputs,
    TokenGeometry,
    register,
)
from .facts import (
    PATCH,
    WAN21_I2V_14B,
    WAN21_LATENT,
    WAN21_T2V_1_3B,
    WAN21_T2V_14B,
    WAN22_I2V_A14B,
    WAN22_TI2V_5B,
    config_from_dims,
    dims,
)

# ComfyUI's Wan text (comfy/text_encoders/wan.py): umt5-xxl's last hidden state, padded to at least 512
# tokens (min_length=512), never cut; no pooled vector. Cross-attended: the video tokens are the sequence.
TEXT = TextInputs(
    encoder="a CLIPLoader of type wan (umt5_xxl) and CLIPTextEncode",
    tokens=512,
    joint=False,
)

# Live activations at a forward's peak (PlannerFacts), calibrated with torch's MemTracker on the meta device
# by `bench planner --model wan2.1-t2v-14b` (BENCHMARKS.md "Planner vs measurement: Wan"). A Wan block's
# peak is its self-attention: the block input and its float32 norm/modulation temporaries at full width
# (diffusers' block computes the modulation in float32), q/k/v with their float32 RoPE temporaries, which TP
# splits; the FFN's 13824-wide GELU branch (2.7 x hidden) peaks lower.
PLANNER = PlannerFacts(table_name="Wan", attention_full=7.0, attention_sharded=11.0, block_full=7.0)

# (heads, blocks, FFN, in, out, image embedder) of the released transformers -> their names
RELEASED = {
    (12, 30, 8960, 16, 16, False): "Wan 2.1 T2V 1.3B",
    (40, 40, 13824, 16, 16, False): "Wan 2.1 T2V 14B / Wan 2.2 T2V A14B expert",
    (40, 40, 13824, 36, 16, True): "Wan 2.1 I2V 14B",
    (40, 40, 13824, 36, 16, False): "Wan 2.2 I2V A14B expert",
    (24, 30, 14336, 48, 48, False): "Wan 2.2 TI2V 5B",
}


def _shape(config: Mapping[str, Any]) -> tuple[int, int, int, int, int, bool]:
    return (
        int(config["num_attention_heads"]),
        int(config["num_layers"]),
        int(config["ffn_dim"]),
        int(config["in_channels"]),
        latent_channels(config),
        config.get("image_dim") is not None,
    )


def variant(config: Mapping[str, Any]) -> str:
    """'t2v', 'i2v' (CLIP image embedder and image latent), 'i2v-concat' (the image latent only: Wan 2.2 I2V
    A14B) or 'ti2v' (TI2V-5B's 48 channels); an image embedder ComfyUI has no model class for is refused."""
    _, _, _, inp, out, image = _shape(config)
    if image and inp not in (36, 48):
        from ..checkpoint.files import CheckpointError

        raise CheckpointError(
            f"this Wan checkpoint has a CLIP image embedder and {inp} input channels; ComfyUI loads such a "
            "model only with 36 (I2V) or 48 (Fun Control), so ROCm Parallel does not run it either"
        )
    if out == 48:
        return "ti2v"
    if image:
        return "i2v"
    return "i2v-concat" if inp != out else "t2v"


def describe(config: Mapping[str, Any]) -> str:
    shape = _shape(config)
    if shape in RELEASED:
        return RELEASED[shape]
    heads, blocks = shape[:2]
    return f"Wan {variant(config).upper()} ({heads} heads, {blocks} blocks)"


def input_channels(config: Mapping[str, Any]) -> int:
    return int(config["in_channels"])


def latent_channels(config: Mapping[str, Any]) -> int:
    return int(config.get("out_channels") or config["in_channels"])


def comfy_model(config: Mapping[str, Any]) -> ComfyModel:
    """comfy/model_detection.py's wan2.1 unet_config of this checkpoint and the supported_models class
    ComfyUI's loader picks for it (module doc)."""
    heads, blocks, ffn, inp, out, image = _shape(config)
    hidden = heads * int(config["attention_head_dim"])
    unet: dict[str, Any] = {
        "image_model": "wan2.1",
        "model_type": "i2v" if image else "t2v",
        "dim": hidden,
        "out_dim": out,
        "num_heads": heads,
        "ffn_dim": ffn,
        "num_layers": blocks,
        "patch_size": PATCH,
        "freq_dim": int(config["freq_dim"]),
        "text_dim": int(config["text_dim"]),
        "window_size": (-1, -1),
        "qk_norm": True,
        "cross_attn_norm": bool(config.get("cross_attn_norm", True)),
        "eps": float(config.get("eps", 1e-6)),
        "in_dim": inp,
    }
    if out == 48:
        name = "WAN22_T2V"
    elif image:
        name = "WAN21_I2V" if inp == 36 else "WAN21_FunControl2V"
    else:
        name = "WAN21_T2V"
    return ComfyModel(
        config_class=name, unet_config=unet, weights={"patch_embedding.weight": (hidden, inp, *PATCH)}
    )


def header() -> FamilyHeader:
    """Wan's checkpoint key layout and header detection (ModelFamily.header): torch-free."""
    from . import keys

    return FamilyHeader(
        keys=keys.WAN_KEYS,
        matches_bfl=keys.matches,
        config_from_bfl=keys.config_from_shapes,
        matches_diffusers=keys.matches_diffusers,
        config_from_diffusers=keys.config_from_diffusers,
        config_with_metadata=keys.config_with_metadata,
    )


def parts() -> FamilyParts:
    """Wan's parts that import torch (ModelFamily.parts): imported the first time one is read."""
    from .call import WAN_CALL
    from .cp import WAN_CP
    from .forward import wan_call, wan_model_fn
    from .model import build_wan
    from .sampling import plan_for
    from .tp import WAN_TP

    return FamilyParts(
        build=build_wan,
        tp=WAN_TP,
        cp=WAN_CP,
        call_spec=WAN_CALL,
        call=wan_call,
        model_fn=wan_model_fn,
        sampling=plan_for,  # ModelSamplingSD3 8 (5: the A14B templates) + euler / simple (sampling.py)
    )


WAN_FAMILY = register(
    ModelFamily(
        name="wan",
        title="Wan",
        diffusers_class="WanTransformer3DModel",
        presets={
            "wan2.1-t2v-1.3b": WAN21_T2V_1_3B,
            "wan2.1-t2v-14b": WAN21_T2V_14B,
            "wan2.1-i2v-14b": WAN21_I2V_14B,
            "wan2.2-i2v-a14b": WAN22_I2V_A14B,
            "wan2.2-ti2v-5b": WAN22_TI2V_5B,
        },
        # each Wan 2.2 T2V A14B expert is the Wan 2.1 T2V 14B transformer
        aliases={"wan2.2-t2v-a14b": "wan2.1-t2v-14b"},
        dims=dims,
        config_from_dims=config_from_dims,
        variant=variant,
        describe=describe,
        input_channels=input_channels,
        latent_channels=latent_channels,
        planner=PLANNER,
        latent=WAN21_LATENT,
        geometry=TokenGeometry(PATCH, frames=True),  # 2 x 2 latent pixels of one latent frame per token
        text=TEXT,
        comfy_model=comfy_model,
        parts=parts,
        header=header,
    )
)

__all__ = ["PLANNER", "TEXT", "WAN_FAMILY", "comfy_model", "describe", "input_channels", "variant"]
