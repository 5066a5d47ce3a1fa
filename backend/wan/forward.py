"""One Wan model call as ComfyUI makes it, over diffusers' WanTransformer3DModel.

ComfyUI's `WanModel._forward` / `forward_orig` (comfy/ldm/wan/model.py, 0.33.0), in its order:

* x is [B, C_in, T, H, W]: the latent in sampler space with whatever `c_concat` appended on the channel axis
  (I2V: the mask and the start image's latent from WanImageToVideo, `model_base.WAN21.concat_cond`), padded
  circularly to (1, 2, 2) patches (`pad_to_patch_size`). `time_dim_concat` (a latent appended along the
  frames, `model_base.WAN21.extra_conds`) is padded the same way and concatenated on dim 2; the output is
  cropped back to x's own T, H and W.
* 3-D RoPE from ids (t, row, column) = `torch.linspace` over the padded grid in x's dtype, not centred
  (`WanModel.rope_encode`), angles as comfy/ldm/flux/math.py `rope` (omega in float64, float32 positions,
  cos/sin rounded to float32) over axes (d - 4 (d // 6), 2 (d // 6), 2 (d // 6)) of the head width d.
  diffusers' `WanRotaryPosEmbed` uses the same positions, split and (to float32 rounding) angles, but keeps
  its table as non-persistent buffers, which a model the loader builds on the meta device never gets, and
  caps positions at 1024: `ComfyRope3D` replaces it and computes ComfyUI's angles from the latent's shape.
* The timestep (sigma x 1000: ModelSamplingSD3's multiplier) goes through `sinusoidal_embedding_1d`
  (`torch.pow(10000, -k / half)`, cos then sin): `ComfySinusoid` replaces diffusers' `Timesteps`, whose
  exp(-log(10000) k / half) rounds differently at t ~ 1000 (1.7e-5 per forward of a tiny model against
  ComfyUI's, 1.3e-6 with ComfyUI's own formula). Wan 2.2's `process_timestep` (`model_base.WAN22`,
  with a noise mask: Wan22ImageToVideoLatent's start frame) gives one timestep per latent frame [B, T];
  ComfyUI's blocks repeat each frame's modulation over the frame's tokens (`repeat_e`), diffusers takes a
  timestep per token: `per_token_timesteps` repeats them as `repeat_e` does (equal frames stay one value).
* The text (umt5, [B, L, 4096]) and, for I2V checkpoints, CLIP-H's penultimate states `clip_fea`
  [B, 257, 1280] (through `img_emb`, before the text); the cross-attention splits at the image tokens'
  count (attention.py). A model without an image embedder ignores `clip_fea`, as ComfyUI's does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .attention import set_image_tokens
from .facts import PATCH  # torch-free: the family's record reads it

THETA = 10000.0

# model_fn(x [B, C, T, H, W] padded, timestep [B] or [B, tokens], context, clip_fea) -> [B, C_out, T, H, W]
ModelFn = Callable[..., torch.Tensor]


# --------------------------------------------------------------------------------------------------
# ComfyUI's positions and timestep embedding


def rope_axes(head_dim: int) -> tuple[int, int, int]:
    """ComfyUI's (and diffusers') split of a head's width over (frames, rows, columns)."""
    return head_dim - 4 * (head_dim // 6), 2 * (head_dim // 6), 2 * (head_dim // 6)


def grid_ids(frames: int, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """`WanModel.rope_encode`'s ids [frames * rows * cols, 3] for a grid of patches, in `dtype` (x's: ComfyUI
    builds them in the model's dtype, which rounds positions above 256 in bfloat16)."""
    ids = torch.zeros((frames, rows, cols, 3), dtype=dtype)
    ids[..., 0] += torch.linspace(0, frames - 1, steps=frames, dtype=dtype).reshape(-1, 1, 1)
    ids[..., 1] += torch.linspace(0, rows - 1, steps=rows, dtype=dtype).reshape(1, -1, 1)
    ids[..., 2] += torch.linspace(0, cols - 1, steps=cols, dtype=dtype).reshape(1, 1, -1)
    return ids.reshape(-1, 3)


def rope_angles(positions: torch.Tensor, dim: int, theta: float = THETA) -> torch.Tensor:
    """comfy/ldm/flux/math.py `rope` for one axis, as angles [S, dim / 2] in float64 (the einsum of float32
    positions and float64 omega)."""
    scale = torch.linspace(0, (dim - 2) / dim, steps=dim // 2, dtype=torch.float64)
    omega = 1.0 / (theta**scale)
    return positions.to(torch.float32).to(torch.float64)[:, None] * omega[None, :]


class ComfyRope3D(nn.Module):
    """Stands in for diffusers' WanRotaryPosEmbed: the same outputs (cos, sin [1, S, 1, head_dim], each angle
    twice, which diffusers' `_cp_plan` splits like the tokens) from ComfyUI's ids and angles. `pad` (set by
    context parallelism for one forward) pads both to whole per-rank pieces, as the tokens are padded."""

    def __init__(self, head_dim: int, patch: Sequence[int] = PATCH) -> None:
        super().__init__()
        self.axes = rope_axes(head_dim)
        self.patch = tuple(int(p) for p in patch)
        self.pad: Callable[[torch.Tensor, int], torch.Tensor] | None = None
        self._cached: tuple[Any, torch.Tensor, torch.Tensor] | None = None

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _, _, t, h, w = hidden_states.shape
        pt, ph, pw = self.patch
        key = (t // pt, h // ph, w // pw, hidden_states.dtype, hidden_states.device)
        if self._cached is None or self._cached[0] != key:  # every step of a run has the same grid
            ids = grid_ids(*key[:3], hidden_states.dtype)
            angles = torch.cat([rope_angles(ids[:, i], dim) for i, dim in enumerate(self.axes)], dim=-1)
            cos, sin = (
                f(angles).float().repeat_interleave(2, dim=-1)[None, :, None, :].to(key[4])
                for f in (torch.cos, torch.sin)
            )
            self._cached = (key, cos, sin)
        _, cos, sin = self._cached
        if self.pad is not None:
            cos, sin = self.pad(cos, 1), self.pad(sin, 1)
        return cos, sin


class ComfySinusoid(nn.Module):
    """comfy/ldm/wan/model.py `sinusoidal_embedding_1d(dim, t)` in place of diffusers' Timesteps: float32."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, timesteps: torch.Tensor) -> torch.Tensor:
        half = self.dim // 2
        position = timesteps.type(torch.float32)
        sinusoid = torch.outer(position, torch.pow(10000, -torch.arange(half).to(position).div(half)))
        return torch.cat([torch.cos(sinusoid), torch.sin(sinusoid)], dim=1)


def install_comfy_embeddings(model: nn.Module) -> None:
    """ComfyUI's RoPE and timestep embedding in `model` (every model `build_wan` makes, meta ones included)."""
    config = model.config
    model.rope = ComfyRope3D(int(config["attention_head_dim"]), config["patch_size"])
    model.condition_embedder.timesteps_proj = ComfySinusoid(int(config["freq_dim"]))


# --------------------------------------------------------------------------------------------------
# The call


def pad_to_patch(x: torch.Tensor, patch: Sequence[int] = PATCH) -> torch.Tensor:
    """comfy.ldm.common_dit.pad_to_patch_size(x, patch): circular padding of T, H, W to whole patches."""
    pad: tuple[int, ...] = ()
    for i in range(x.ndim - 2):
        pad = (0, (patch[i] - x.shape[i + 2] % patch[i]) % patch[i], *pad)
    return F.pad(x, pad, mode="circular") if any(pad) else x


def per_token_timesteps(timestep: torch.Tensor, tokens: int) -> torch.Tensor:
    """ComfyUI's per-frame timesteps [B, n] spread over the call's tokens as `repeat_e` spreads their
    modulation: each value repeated tokens // n times (or once more, cut to `tokens`, when n does not divide);
    one value per latent when every frame has the same (then the call is the plain one, as in ComfyUI)."""
    if timestep.ndim < 2:
        return timestep
    timestep = timestep.reshape(timestep.shape[0], -1)
    if bool((timestep == timestep[:, :1]).all()):
        return timestep[:, 0]
    n = timestep.shape[1]
    repeats = tokens // n
    if repeats * n == tokens:
        return timestep.repeat_interleave(repeats, dim=1)
    return timestep.repeat_interleave(repeats + 1, dim=1)[:, :tokens]


def wan_call(
    model_fn: ModelFn,
    x: torch.Tensor,
    timestep: torch.Tensor,
    context: torch.Tensor,
    clip_fea: torch.Tensor | None = None,
    time_dim_concat: torch.Tensor | None = None,
    denoise_mask: Any = None,
) -> torch.Tensor:
    """ComfyUI's WanModel `forward(x, timestep, context, clip_fea=None, time_dim_concat=None)` over a diffusers
    `model_fn` (`wan_model_fn`). `denoise_mask` (what model_base.WAN22 hands every call) is taken and unused,
    as ComfyUI's WanModel takes it in **kwargs.

    x: [B, C_in, T, H, W] (or [B, C_in, H, W]: one frame) in sampler space, any H and W; timestep: [B], or
    [B, frames] per latent frame (Wan 2.2's noise mask); context: [B, L, text_dim]; clip_fea: [B, N, 1280].
    Returns [B, C_out, T, H, W] (or 4-D, as x) in the model's dtype.
    """
    four_d = x.ndim == 4
    if four_d:
        x = x.unsqueeze(2)
    _, _, t, h, w = x.shape
    x = pad_to_patch(x)
    if time_dim_concat is not None:
        x = torch.cat([x, pad_to_patch(time_dim_concat.to(x.dtype))], dim=2)
    tokens = (x.shape[2] // PATCH[0]) * (x.shape[3] // PATCH[1]) * (x.shape[4] // PATCH[2])
    out = model_fn(x, per_token_timesteps(timestep, tokens), context, clip_fea)[:, :, :t, :h, :w]
    return out.squeeze(2) if four_d else out


def wan_model_fn(model: nn.Module) -> ModelFn:
    """Adapt diffusers' WanTransformer3DModel (as `build_wan` makes it) to the `model_fn` contract."""
    embedder = getattr(model, "condition_embedder", None)  # (a stand-in of the planner's probe has none)
    has_image_embedder = getattr(embedder, "image_embedder", None) is not None

    @torch.no_grad()
    def model_fn(x, timestep, context, clip_fea):
        if not has_image_embedder:
            clip_fea = None  # ComfyUI's WanModel without img_emb ignores it
        set_image_tokens(model, None if clip_fea is None else int(clip_fea.shape[-2]))
        return model(
            hidden_states=x,
            timestep=timestep,
            encoder_hidden_states=context,
            encoder_hidden_states_image=clip_fea,
            return_dict=False,
        )[0]

    return model_fn


__all__ = [
    "PATCH",
    "ComfyRope3D",
    "ComfySinusoid",
    "grid_ids",
    "install_comfy_embeddings",
    "pad_to_patch",
    "per_token_timesteps",
    "rope_angles",
    "rope_axes",
    "wan_call",
    "wan_model_fn",
]
