"""Small models and random inputs for tests and benchmarks, for any registered family.

* `tiny_flux_config` / `tiny_flux2_config` / `tiny_qwen_image_config` / `tiny_wan_config`: structurally
  complete FLUX.1 / FLUX.2 / Qwen-Image / Wan configs with small widths (every code path of the real model,
  in milliseconds);
* `random_inputs`: the keyword arguments of one diffusers forward, built through the family's own model
  call (`ModelFamily.call`, ComfyUI's semantics) from a random latent and text, so they are exactly
  what the worker's forward service gives the model, for any family.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..backend.family import ModelFamily, get_family
from ..backend.flux.dims import FluxDims
from ..backend.flux.keys import rope_axes
from ..backend.flux.model import FLUX_DEV
from ..backend.flux2.model import FLUX2_DEV
from ..backend.qwen_image.keys import rope_axes as qwen_rope_axes
from ..backend.qwen_image.model import QWEN_IMAGE
from ..backend.wan.model import HEAD_DIM as WAN_HEAD_DIM
from ..backend.wan.model import IMAGE_DIM as WAN_IMAGE_DIM
from ..backend.wan.model import WAN21_T2V_1_3B


def tiny_flux_config(
    heads: int = 4,
    head_dim: int = 16,
    double_blocks: int = 2,
    single_blocks: int = 2,
    guidance: bool = True,
    text_dim: int = 32,
    pooled_dim: int = 24,
    in_channels: int = 64,
    out_channels: int | None = None,
) -> dict[str, Any]:
    """A structurally complete FLUX.1 with small widths: every code path of the real one, in milliseconds.

    RoPE axes must sum to head_dim and be even: split head_dim like FLUX's (16, 56, 56) of 128.
    `in_channels=384, out_channels=64` is FLUX.1 Fill's shape (96 channels per latent pixel in, 16 out).
    """
    if head_dim % 8:
        raise ValueError(f"head_dim={head_dim} must be a multiple of 8 for the 3-axis rotary embedding")
    extra = {} if out_channels is None else {"out_channels": out_channels}
    return {
        **FLUX_DEV,
        **extra,
        "in_channels": in_channels,
        "num_layers": double_blocks,
        "num_single_layers": single_blocks,
        "attention_head_dim": head_dim,
        "num_attention_heads": heads,
        "joint_attention_dim": text_dim,
        "pooled_projection_dim": pooled_dim,
        "guidance_embeds": guidance,
        "axes_dims_rope": rope_axes(head_dim),
    }


def tiny_flux2_config(
    heads: int = 4,
    head_dim: int = 16,
    double_blocks: int = 2,
    single_blocks: int = 2,
    guidance: bool = True,
    text_dim: int = 32,
    in_channels: int = 16,
) -> dict[str, Any]:
    """A structurally complete FLUX.2 with small widths (every code path of [dev], in milliseconds).

    RoPE: four even axes summing to head_dim, like [dev]'s (32, 32, 32, 32) of 128.
    """
    if head_dim % 8:
        raise ValueError(f"head_dim={head_dim} must be a multiple of 8 for the 4-axis rotary embedding")
    return {
        **FLUX2_DEV,
        "in_channels": in_channels,
        "num_layers": double_blocks,
        "num_single_layers": single_blocks,
        "attention_head_dim": head_dim,
        "num_attention_heads": heads,
        "joint_attention_dim": text_dim,
        "axes_dims_rope": (head_dim // 4,) * 4,
        "guidance_embeds": guidance,
    }


def tiny_qwen_image_config(
    heads: int = 4,
    head_dim: int = 16,
    blocks: int = 2,
    text_dim: int = 32,
    zero_cond_t: bool = False,
) -> dict[str, Any]:
    """A structurally complete Qwen-Image with small widths (every code path of the released one).

    16 latent channels (the Wan 2.1 latent format's) in 2 x 2 patches, RoPE axes in the released
    proportions of head_dim ((4, 6, 6) for 16); `zero_cond_t`: Edit-2511's shape.
    """
    if head_dim % 8:
        raise ValueError(f"head_dim={head_dim} must be a multiple of 8 for the 3-axis rotary embedding")
    config = {
        **QWEN_IMAGE,
        "num_layers": blocks,
        "attention_head_dim": head_dim,
        "num_attention_heads": heads,
        "joint_attention_dim": text_dim,
        "axes_dims_rope": qwen_rope_axes(head_dim),
    }
    return {**config, "zero_cond_t": True} if zero_cond_t else config


def tiny_wan_config(
    heads: int = 2,
    blocks: int = 2,
    ffn: int = 512,
    text_dim: int = 64,
    in_channels: int = 16,
    out_channels: int = 16,
    image: bool = False,
) -> dict[str, Any]:
    """A structurally complete Wan with small widths: 128 per head as every released Wan (ComfyUI and the
    family read heads as width / 128), `heads` of them. `in_channels=36, image=True` is Wan 2.1 I2V's shape
    (CLIP-H image embedder, image key/value per cross-attention), `in_channels=36` alone Wan 2.2 I2V A14B's,
    48 in and out TI2V-5B's. `text_dim` 4096 (umt5) for a model ComfyUI loads: it hard-codes that width."""
    return {
        **WAN21_T2V_1_3B,
        "num_attention_heads": heads,
        "attention_head_dim": WAN_HEAD_DIM,
        "num_layers": blocks,
        "ffn_dim": ffn,
        "text_dim": text_dim,
        "in_channels": in_channels,
        "out_channels": out_channels,
        "image_dim": WAN_IMAGE_DIM if image else None,
        "added_kv_proj_dim": heads * WAN_HEAD_DIM if image else None,
    }


# The inputs that carry activations (they take the compute dtype); timesteps, guidance and position ids
# stay float32: the model casts the former itself and computes RoPE from the latter in float.
ACTIVATIONS = ("hidden_states", "encoder_hidden_states", "pooled_projections")


@dataclass(frozen=True)
class ModelInputs:
    """Keyword arguments of one diffusers transformer forward (without `return_dict`)."""

    kwargs: Mapping[str, torch.Tensor | None]

    def as_kwargs(self) -> dict[str, Any]:
        return dict(self.kwargs)

    @property
    def hidden_states(self) -> torch.Tensor:
        return self.kwargs["hidden_states"]

    def to(self, device: str | torch.device, dtype: torch.dtype | None = None) -> ModelInputs:
        """On `device`, the activations in `dtype` (the rest keeps its dtype)."""
        return ModelInputs(
            {
                k: None if v is None else v.to(device=device, dtype=dtype if k in ACTIVATIONS else None)
                for k, v in self.kwargs.items()
            }
        )


class _Recorder:
    """Stands in for the model inside a family's call: keeps the keyword arguments it is called with."""

    def __init__(self) -> None:
        self.kwargs: dict[str, Any] = {}

    def __call__(self, **kwargs: Any) -> tuple[torch.Tensor]:
        kwargs.pop("return_dict", None)
        self.kwargs = kwargs
        return (kwargs["hidden_states"],)


def random_inputs(
    dims: FluxDims,
    batch: int = 1,
    height: int = 64,
    width: int = 64,
    text_tokens: int = 16,
    seed: int = 1,
    device: str | torch.device = "cpu",
    family: ModelFamily | str = "flux1",
) -> ModelInputs:
    """Random inputs of one forward of the `family` transformer with `dims`, for an image of height x
    width pixels (a multiple of 16: one image token per 16 x 16 pixels in FLUX.1 and FLUX.2 alike).

    A latent [batch, C, height/s, width/s] (C and s: the family's input channels and VAE scale), the text
    [batch, text_tokens, text_dim] and, for a family that takes one, the pooled vector are drawn from
    `seed` in that order (empty on 'meta'); timestep 0.75 and, with a guidance embedder, guidance 3.5.
    The family's own call turns them into the model's keyword arguments.
    """
    fam = get_family(family) if isinstance(family, str) else family
    if height % 16 or width % 16:
        raise ValueError(f"image size {width}x{height} must be a multiple of 16 pixels")
    scale = fam.latent.downscale
    x_shape = (batch, fam.input_channels(fam.config_from_dims(dims)), height // scale, width // scale)
    # the family's example inputs: text features and vectors are drawn after x, in the call's order;
    # a per-latent scalar (guidance) is 3.5
    inputs = fam.call_spec.example(dims, batch, text_tokens, "meta")
    drawn = {
        "x": x_shape,
        **{k: tuple(v.shape) for k, v in inputs.items() if torch.is_tensor(v) and v.ndim >= 2},
    }
    if str(device) == "meta":
        values = {k: torch.empty(shape, device="meta") for k, shape in drawn.items()}
    else:
        g = torch.Generator().manual_seed(seed)
        values = {k: torch.randn(shape, generator=g).to(device) for k, shape in drawn.items()}
    for name, value in inputs.items():
        if torch.is_tensor(value):
            inputs[name] = values[name] if name in values else torch.full(value.shape, 3.5, device=device)
    timestep = torch.full((batch,), 0.75, device=device)
    model = _Recorder()
    fam.call(fam.model_fn(model), values["x"], timestep, **inputs)
    return ModelInputs(model.kwargs)


__all__ = [
    "ModelInputs",
    "random_inputs",
    "tiny_flux2_config",
    "tiny_flux_config",
    "tiny_qwen_image_config",
    "tiny_wan_config",
]
