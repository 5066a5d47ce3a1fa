"""Qwen-Image transformer configurations (the released checkpoints') and the builder.

Sources (checked 2026-11-23):
* diffusers 0.42.1 `models/transformers/transformer_qwenimage.py`: the defaults of
  `QwenImageTransformer2DModel.__init__` are Qwen-Image's: 60 dual-stream blocks, 24 heads x 128 (hidden
  3072), joint_attention_dim 3584 (Qwen2.5-VL-7B), in_channels 64 (16 latent channels x 2 x 2),
  out_channels 16, RoPE axes (16, 56, 56). 20,430,401,088 parameters.
* Qwen-Image-Edit and -Edit-2509 (and 2512) share that config: an edit changes the inputs (reference
  latents after the image tokens, vision tokens in the prompt), not the transformer. Qwen-Image-Edit-2511
  adds `zero_cond_t` (its reference tokens are modulated at timestep 0); ComfyUI marks such a file with an
  empty `__index_timestep_zero__` tensor (comfy/ldm/qwen_image/model.py, 0.33), which the model built here
  carries too, so the files it writes are ComfyUI's.
* Qwen-Image-Layered (`use_additional_t_cond`, `use_layer3d_rope`) is not supported (keys.py refuses it).

The family never uses diffusers' own RoPE: ComfyUI numbers the patches of an odd-sized latent differently
(forward.py), so `build` installs `forward.ComfyRope` as `pos_embed` on every model it builds, meta ones
included (before any parallelism wraps a forward).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .facts import (
    QWEN_IMAGE,
    QWEN_IMAGE_EDIT_2511,
    TIMESTEP_ZERO_MARKER,
)  # the released configs (torch-free: plan reads them)
from .forward import ComfyRope


def build_qwen_image(
    config: dict[str, Any],
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    seed: int | None = 0,
) -> nn.Module:
    """diffusers' QwenImageTransformer2DModel with ComfyUI's RoPE; random weights from `seed`, none on 'meta'.

    Random weights are drawn on the CPU in parameter order (every process builds the identical model):
    linear weights N(0, 1/fan_in), so activations stay O(1) through the blocks and a 1e-5 tolerance means
    something; biases N(0, 0.05^2); RMS norm scales 1 + N(0, 0.05^2). Every weight is drawn (training
    initialises the modulation and output projections to zero) so that parity tests exercise all of them.
    """
    from diffusers import QwenImageTransformer2DModel

    dtype = torch.float32 if dtype is None else dtype
    if str(device) == "meta":
        with torch.device("meta"):
            model = QwenImageTransformer2DModel(**config)
    else:
        model = QwenImageTransformer2DModel(**config)
        if seed is not None:
            _randomize(model, seed)
    model.pos_embed = ComfyRope(config.get("axes_dims_rope", QWEN_IMAGE["axes_dims_rope"]))
    # nn.Module.to, not ModelMixin.to: the latter warns about float32-kept modules this model does not have
    model = nn.Module.to(model, dtype=dtype) if str(device) == "meta" else nn.Module.to(model, device, dtype)
    if config.get("zero_cond_t"):
        # an empty tensor, real even on a meta model: the loader fills parameters only
        model.register_buffer(
            TIMESTEP_ZERO_MARKER, torch.empty(0, device="cpu" if str(device) == "meta" else device)
        )
    return model.eval()


def _randomize(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.ndim == 2:
                p.copy_(noise * p.shape[1] ** -0.5)
            elif name.endswith("norm.weight") or "norm_q" in name or "norm_k" in name or "norm_added" in name:
                p.copy_(1.0 + 0.05 * noise)
            else:
                p.copy_(0.05 * noise)


__all__ = ["QWEN_IMAGE", "QWEN_IMAGE_EDIT_2511", "TIMESTEP_ZERO_MARKER", "build_qwen_image"]
