"""Qwen-Image's VAE (qwen_image_vae.safetensors): the Wan 2.1 causal 3-D VAE, diffusers'
AutoencoderKLQwenImage, the original Wan key layout (`decoder.middle.0.residual.0.gamma`, ...).

ComfyUI builds it as comfy/ldm/wan/vae.py `WanVAE` (comfy/sd.py: `decoder.middle.0.residual.0.gamma` without
Wan 2.2's keys); its LATENT is [B, 16, T, H, W], an image one frame (T = 1). Both implementations compute
the same for one frame: the causal Conv3d pads two zero frames in front (ComfyUI 0.33 skips them by
truncating the kernel, the same sum), RMS norms over the channels of each pixel (`F.normalize` x sqrt(C) x
gamma: nothing across rows, so the bands need no statistics), nearest-exact x2 upsampling, the (0, 1, 0, 1)
zero pad before each stride-2 convolution, one-head attention over each frame's pixels in the middle block
(SDPA in both), and the temporal up/down-sampling convolutions skipped for the first frame. diffusers clamps
the decoded frame to -1..1 where ComfyUI clamps (x + 1) / 2 to 0..1: the same pixels. Keys are converted by
diffusers' `convert_wan_vae_to_diffusers`, whose names are AutoencoderKLQwenImage's.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from ..vae.kind import VaeKind, VaePlannerFacts, diffusers_decode, diffusers_encode

Shapes = Mapping[str, tuple[int, ...]]


RELEASED = {  # qwen_image_vae.safetensors (Qwen/Qwen-Image, vae/config.json)
    "base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
    "temperal_downsample": [False, True, True],
}  # fmt: skip


def build_vae(config: Mapping[str, Any], device: Any = "cpu", dtype: Any = None) -> Any:
    from diffusers import AutoencoderKLQwenImage

    from ..family import build_diffusers

    return build_diffusers(AutoencoderKLQwenImage, config, device=device, dtype=dtype, seed=None)


def matches(keys: Collection[str]) -> bool:
    """The Wan 2.1 VAE in its original layout (Wan 2.2's has `decoder.upsamples.0.upsamples...`)."""
    return "decoder.middle.0.residual.0.gamma" in keys and not any(
        k.startswith("decoder.upsamples.0.upsamples.") for k in keys
    )


def config_from_shapes(shapes: Shapes) -> dict[str, Any]:
    """AutoencoderKLQwenImage's config: the base width from the decoder head's norm (ComfyUI reads the same
    key), the latent channels from the post-quant conv; Wan 2.1's multipliers, blocks and temporal scales."""
    return {
        "base_dim": shapes["decoder.head.0.gamma"][0],
        "z_dim": shapes["conv2.weight"][0],
        "dim_mult": [1, 2, 4, 4],
        "num_res_blocks": 2,
        "attn_scales": [],
        "temperal_downsample": [False, True, True],
    }


def decode(model: Any, z: Any) -> Any:
    """diffusers' decode; one frame without its causal caches: they only matter from the second frame on,
    and each would keep a copy of a convolution's input alive (16 full-resolution maps per band instead of
    6, measured on the meta device). ComfyUI 0.33 decodes one frame without them too."""
    if z.shape[2] != 1:
        return diffusers_decode(model, z)
    return model.decoder(model.post_quant_conv(z)).clamp(-1.0, 1.0)


def encode(model: Any, x: Any) -> Any:
    """diffusers' encode (the posterior's mean); one frame without its causal caches, as `decode`."""
    if x.shape[2] != 1:
        return diffusers_encode(model, x)
    return model.quant_conv(model.encoder(x))[:, : model.config.z_dim]


def convert(state: dict[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    return convert_wan_vae_to_diffusers(state)


QWEN_IMAGE_VAE = VaeKind(
    name="wan21-vae",
    title="Qwen-Image's VAE (qwen_image_vae.safetensors, the Wan 2.1 VAE)",
    diffusers_class="AutoencoderKLQwenImage",
    build=build_vae,
    matches=matches,
    config_from_shapes=config_from_shapes,
    convert=convert,
    latent_channels=lambda config: int(config["z_dim"]),
    downscale=8,
    frames=True,
    decode=decode,
    encode=encode,
    released=RELEASED,
    # live full-resolution maps at a band's peak: torch's MemTracker on the meta device, 512 px, 1 and 4
    # ranks, the released config (`bench vae`), in float32 and in bfloat16
    planner=VaePlannerFacts(decode_units=6.0, encode_units=5.1, decode_units_half=7.0, encode_units_half=6.1),
    widths=lambda c: (c["base_dim"], c["base_dim"] * c["dim_mult"][-1]),
)
