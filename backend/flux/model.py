"""FLUX transformer configurations and builders (real sizes, and small random ones for tests/demos)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..config import FluxDims

# diffusers `FluxTransformer2DModel` configs of the released checkpoints (black-forest-labs/FLUX.1-*).
FLUX_DEV: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}
FLUX_SCHNELL: dict[str, Any] = {**FLUX_DEV, "guidance_embeds": False}
# FLUX.1 Fill [dev]: the masked image (16) and the 8x8 mask (64) enter with the latent (16), 2x2 patched.
FLUX_FILL: dict[str, Any] = {**FLUX_DEV, "in_channels": 384, "out_channels": 64}


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
    """A structurally complete FLUX with small widths: every code path of the real one, in milliseconds.

    RoPE axes must sum to head_dim and be even: split head_dim like FLUX's (16, 56, 56) of 128.
    `in_channels=384, out_channels=64` is FLUX.1 Fill's shape (96 channels per latent pixel in, 16 out).
    """
    if head_dim % 8:
        raise ValueError(f"head_dim={head_dim} must be a multiple of 8 for the 3-axis rotary embedding")
    b = (head_dim - head_dim // 8) // 4 * 2
    axes = (head_dim - 2 * b, b, b)
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
        "axes_dims_rope": axes,
    }


def build_flux(
    config: dict[str, Any],
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int | None = 0,
    init_scale: float = 0.05,
) -> torch.nn.Module:
    """Build diffusers' FluxTransformer2DModel; random weights when `seed` is set, none on 'meta'.

    Random weights are drawn on the CPU from `seed` so every process builds the identical model.
    FLUX initialises AdaLN-zero and output projections to zero in training; we draw everything so that
    a parity test exercises every weight.
    """
    from diffusers import FluxTransformer2DModel

    return build_random(FluxTransformer2DModel, config, device, dtype, seed, init_scale)


def build_random(
    model_class: type[nn.Module],
    config: dict[str, Any],
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int | None = 0,
    init_scale: float = 0.05,
) -> nn.Module:
    """`model_class(**config)` (a diffusers transformer) with random weights from `seed`, none on 'meta'.

    Every family's builder: the weights are drawn on the CPU in parameter order, so every process builds
    the identical model.
    """
    if str(device) == "meta":
        with torch.device("meta"):
            return nn.Module.to(model_class(**config), dtype=dtype).eval()
    model = model_class(**config).eval()
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * init_scale)
    # nn.Module.to, not ModelMixin.to: the latter warns about float32-kept modules FLUX does not have.
    return nn.Module.to(model, device=device, dtype=dtype)


@dataclass(frozen=True)
class FluxInputs:
    """Keyword arguments of one FluxTransformer2DModel forward, all on one device."""

    hidden_states: torch.Tensor
    encoder_hidden_states: torch.Tensor
    pooled_projections: torch.Tensor
    timestep: torch.Tensor
    img_ids: torch.Tensor
    txt_ids: torch.Tensor
    guidance: torch.Tensor | None

    def as_kwargs(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def to(self, device: str | torch.device, dtype: torch.dtype | None = None) -> FluxInputs:
        # Activations take the compute dtype; timesteps, guidance and position ids stay float32 (the model
        # casts the former itself and computes RoPE from the latter in float).
        activations = ("hidden_states", "encoder_hidden_states", "pooled_projections")

        def move(name: str, t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            return t.to(device=device, dtype=dtype if name in activations else None)

        return FluxInputs(**{k: move(k, v) for k, v in self.as_kwargs().items()})


def image_ids(latent_height: int, latent_width: int) -> torch.Tensor:
    """Position ids of the 2x2-patched latent: [(H/2)(W/2), 3] with (0, row, column)."""
    h, w = latent_height // 2, latent_width // 2
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    return ids.reshape(h * w, 3)


def random_inputs(
    dims: FluxDims,
    batch: int = 1,
    height: int = 64,
    width: int = 64,
    text_tokens: int = 16,
    seed: int = 1,
    device: str | torch.device = "cpu",
    family: str = "flux1",
) -> Any:
    """Random inputs of one forward of the `family` transformer ("flux1": FluxInputs, "flux2":
    Flux2Inputs) for an image of height x width pixels.

    Both families have one image token per 16 x 16 pixels (FLUX.1: 2x2 patches of the 1/8 latent;
    FLUX.2: the 1/16 latent). The activations are drawn from `seed` in the order image, text, pooled
    (FLUX.1 only); on 'meta' they are empty. Guidance is the families' usual default (3.5 / 4.0) when the
    model has a guidance embedder.
    """
    if height % 16 or width % 16:
        raise ValueError(f"image size {width}x{height} must be a multiple of 16 pixels")
    if family not in ("flux1", "flux2"):
        raise ValueError(f"family={family!r} is not a model family with inputs here; use 'flux1' or 'flux2'")
    rows, cols = height // 16, width // 16
    shapes = {
        "hidden_states": (batch, rows * cols, dims.in_channels),
        "encoder_hidden_states": (batch, text_tokens, dims.text_dim),
    }
    if family == "flux1":
        shapes["pooled_projections"] = (batch, dims.pooled_dim)
    if str(device) == "meta":
        tensors = {k: torch.empty(s, device="meta") for k, s in shapes.items()}
    else:
        g = torch.Generator().manual_seed(seed)
        tensors = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    timestep = torch.full((batch,), 0.75)
    if family == "flux1":
        return FluxInputs(
            timestep=timestep,
            img_ids=image_ids(height // 8, width // 8),
            txt_ids=torch.zeros(text_tokens, 3),
            guidance=torch.full((batch,), 3.5) if dims.guidance else None,
            **tensors,
        ).to(device)
    from ..flux2.model import Flux2Inputs, flux2_image_ids, flux2_text_ids  # that module imports this one

    return Flux2Inputs(
        timestep=timestep,
        img_ids=flux2_image_ids(rows, cols),
        txt_ids=flux2_text_ids(text_tokens),
        guidance=torch.full((batch,), 4.0) if dims.guidance else None,
        **tensors,
    ).to(device)
