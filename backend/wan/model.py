"""Wan transformer configurations (the released checkpoints') and the builder.

Sources (checked 2026-11-23): the `transformer/config.json` of Wan-AI's diffusers repositories and ComfyUI's
own reading of its files (comfy/model_detection.py: dim, ffn_dim, blocks, in/out channels from shapes; 128
per head, freq 256, eps 1e-6, cross-attention norm, text 4096 hard-coded), the same numbers:

* Wan 2.1 T2V 1.3B: 1536 = 12 heads x 128, FFN 8960, 30 blocks, 16 channels in and out.
* Wan 2.1 T2V 14B: 5120 = 40 x 128, FFN 13824, 40 blocks. Wan 2.2 T2V A14B's two experts (high noise, low
  noise) are this transformer twice, with other weights.
* Wan 2.1 I2V 14B (480p, 720p): the 14B with 36 channels in (16 latent + 4 mask + 16 start image, ComfyUI's
  WanImageToVideo) and an image embedder for CLIP-H's 1280-wide states with a second key/value per
  cross-attention (`image_dim` 1280, `added_kv_proj_dim` 5120).
* Wan 2.2 I2V A14B: the 14B with 36 channels in and no image embedder (ComfyUI loads it as T2V with the
  concatenated latent); two experts like the T2V A14B.
* Wan 2.2 TI2V 5B: 3072 = 24 x 128, FFN 14336, 30 blocks, 48 channels in and out (the Wan 2.2 VAE's).

`build_wan` returns diffusers' `WanTransformer3DModel` with ComfyUI's RoPE and timestep embedding
(forward.py) and ComfyUI's split of the I2V context (attention.py) installed, on every model it builds,
meta ones included (before any parallelism wraps a forward).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .attention import use_comfy_processors
from .facts import (  # the released configs (torch-free: plan reads them)
    HEAD_DIM,
    IMAGE_DIM,
    WAN21_I2V_14B,
    WAN21_T2V_1_3B,
    WAN21_T2V_14B,
    WAN22_I2V_A14B,
    WAN22_TI2V_5B,
)
from .forward import install_comfy_embeddings


def build_wan(
    config: dict[str, Any],
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    seed: int | None = 0,
) -> nn.Module:
    """diffusers' WanTransformer3DModel with ComfyUI's RoPE, timestep embedding and I2V context split; random
    weights from `seed`, none on 'meta'.

    Random weights are drawn on the CPU in parameter order (every process builds the identical model): linear
    weights N(0, 1/fan_in), so activations stay O(1) through the blocks and a 1e-5 tolerance means
    something; biases and modulation tables N(0, 0.05^2); norm scales 1 + N(0, 0.05^2). Every weight is drawn
    (training initialises some to zero) so that parity tests exercise all of them.
    """
    from diffusers import WanTransformer3DModel

    dtype = torch.float32 if dtype is None else dtype
    config = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}
    if str(device) == "meta":
        with torch.device("meta"):
            model = WanTransformer3DModel(**config)
    else:
        model = WanTransformer3DModel(**config)
        if seed is not None:
            _randomize(model, seed)
    install_comfy_embeddings(model)
    use_comfy_processors(model)
    # nn.Module.to, not ModelMixin.to (which would keep diffusers' float32 modules: the loader does that)
    model = nn.Module.to(model, dtype=dtype) if str(device) == "meta" else nn.Module.to(model, device, dtype)
    return model.eval()


def _randomize(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.ndim == 2:
                p.copy_(noise * p.shape[1] ** -0.5)
            elif p.ndim == 5:  # the patch embedding's Conv3d: fan-in = channels x patch volume
                p.copy_(noise * p[0].numel() ** -0.5)
            elif name.endswith(".weight"):  # RMS and layer norm scales
                p.copy_(1.0 + 0.05 * noise)
            else:
                p.copy_(0.05 * noise)


__all__ = [
    "HEAD_DIM",
    "IMAGE_DIM",
    "WAN21_I2V_14B",
    "WAN21_T2V_1_3B",
    "WAN21_T2V_14B",
    "WAN22_I2V_A14B",
    "WAN22_TI2V_5B",
    "build_wan",
]
