"""FLUX.1's sampling as ComfyUI runs it: its latent format, sigma tables (dev, schnell, ModelSamplingFlux),
conditioning (T5-XXL features, CLIP-L's pooled vector, FluxGuidance) and one-process helpers.

The target is bit-for-bit agreement with ComfyUI's own `KSampler(euler, simple, cfg 1.0)` (and
`SamplerCustom` with a SIGMAS input), so every formula repeats ComfyUI's arithmetic in the same order and
dtype (comfy/model_sampling.py, comfy/samplers.py at ComfyUI 0.3.64). Noise, masks, the plan and the Euler
loop every family shares are in backend/diffusion/sampling.py; FLUX.2 (flux2/sampling.py) reuses this module's
conditioning helpers with its own schedule.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..config import ConfigError
from ..diffusion.sampling import (
    ModelCall,
    SamplingPlan,
    SamplingRequest,
    check_finite,
    check_real,
    euler,
    make_plan,
    repeat_to_batch_size,
    simple_schedule,
    single_entry,
)
from ..family import LatentFormat
from .facts import LATENT, SCALE_FACTOR, SHIFT_FACTOR, VARIANTS, variant  # torch-free
from .forward import ModelFn, flux_call

if TYPE_CHECKING:
    from ..checkpoint import CheckpointInfo

# comfy/model_sampling.py `ModelSamplingFlux` default shift (mu) for FLUX.1-dev.
DEV_MU = 1.15
# Conditioning extras this sampler honours; anything else (areas, masks, strengths, hooks, ControlNets,
# reference latents, timestep ranges) changes ComfyUI's result and is refused rather than ignored.
SUPPORTED_COND_KEYS = ("pooled_output", "guidance")
DEFAULT_GUIDANCE = 3.5  # comfy/model_base.py Flux.extra_conds: kwargs.get("guidance", 3.5)

# --- latent format and tokens ---------------------------------------------------------------------


def process_in(latent: torch.Tensor) -> torch.Tensor:
    """VAE latent -> the space the sampler works in."""
    return (latent - SHIFT_FACTOR) * SCALE_FACTOR


def process_out(latent: torch.Tensor) -> torch.Tensor:
    """Sampler space -> VAE latent."""
    return (latent / SCALE_FACTOR) + SHIFT_FACTOR


# --- sigma tables and schedules --------------------------------------------------------------------


def resolution_mu(width: int, height: int, base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """The shift `ModelSamplingFlux` (comfy_extras/nodes_model_advanced.py) sets for an image size.

    width/height are in PIXELS; the line goes through (256 tokens, base_shift) and (4096 tokens,
    max_shift), tokens = pixels / (8*8*2*2). Same operation order as ComfyUI so the float is identical.
    """
    x1, x2 = 256, 4096
    mm = (max_shift - base_shift) / (x2 - x1)
    b = base_shift - mm * x1
    return (width * height / (8 * 8 * 2 * 2)) * mm + b


def flux_sigma_table(mu: float = DEV_MU, timesteps: int = 10000) -> torch.Tensor:
    """ComfyUI's `ModelSamplingFlux.sigmas`: e^mu / (e^mu + (1/t - 1)) for t = 1/10000 .. 1, float32."""
    t = torch.arange(1, timesteps + 1, 1) / timesteps
    # Written exactly as comfy's flux_time_shift(mu, 1.0, t) so float32 rounding matches bit for bit.
    return math.exp(mu) / (math.exp(mu) + (1 / t - 1) ** 1.0)


def schnell_sigma_table(timesteps: int = 1000) -> torch.Tensor:
    """ComfyUI's `ModelSamplingDiscreteFlow.sigmas` for schnell (shift 1, multiplier 1): t = 1/1000 .. 1."""
    return torch.arange(1, timesteps + 1, 1) / timesteps * 1.0 / 1.0


# sigma(t) = e^mu / (e^mu + 1/t - 1) is computed in float32 as ComfyUI does: e^mu overflows float32 above
# 88.7, and below -87 it underflows so that the last entry (t = 1) is 0 / 0. Both give NaN sigmas.
SHIFT_MU_LIMIT = 87.0


def check_shift_mu(shift_mu: Any) -> None:
    """A ModelSamplingFlux shift the sigma table can hold: a finite number within +-SHIFT_MU_LIMIT."""
    number = isinstance(shift_mu, int | float) and not isinstance(shift_mu, bool)
    if not number or not -SHIFT_MU_LIMIT <= shift_mu <= SHIFT_MU_LIMIT:  # NaN fails both comparisons
        raise ConfigError(
            f"shift_mu={shift_mu!r} must be a finite number from -{SHIFT_MU_LIMIT:g} to {SHIFT_MU_LIMIT:g} "
            "(beyond that e^mu leaves float32 and every sigma is NaN); ModelSamplingFlux sets 0.5 to 1.15 "
            "for 256x256 to 1024x1024 (resolution_mu(width, height)), or leave it unset for the model's default"
        )


def sigma_table(variant: str, shift_mu: float | None = None) -> torch.Tensor:
    """The table a FLUX model samples from; a `shift_mu` replaces it like the ModelSamplingFlux node does."""
    if shift_mu is not None:
        return flux_sigma_table(shift_mu)  # ModelSamplingFlux patches schnell to the FLUX table too
    return flux_sigma_table(DEV_MU) if variant == "dev" else schnell_sigma_table()


def guidance_tensor(extras: Mapping[str, Any], batch: int, model: str = "FLUX.1-dev") -> torch.Tensor:
    """comfy/model_base.py Flux.extra_conds: the conditioning's guidance (3.5 when FluxGuidance set none),
    one per latent."""
    value = extras.get("guidance", DEFAULT_GUIDANCE)
    if value is None:
        raise ConfigError(f"conditioning guidance is None; {model} needs one (FluxGuidance, e.g. 3.5)")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(
            f"conditioning guidance={value!r} is not a finite number; set it with FluxGuidance (e.g. 3.5)"
        )
    return repeat_to_batch_size(torch.tensor([float(value)], dtype=torch.float32), batch)


def convert_conditioning(
    positive: Any,
    batch: int,
    variant: str = "dev",
    text_dim: int | None = None,
    pooled_dim: int | None = None,
) -> dict[str, Any]:
    """ComfyUI CONDITIONING `[[cond, {"pooled_output": ..., "guidance": ...}]]` -> the model call's inputs
    (`context`, `y`, `guidance`: ComfyUI's Flux.forward names), repeated to the latent batch.

    `text_dim` / `pooled_dim` are the checkpoint's (FluxDims.text_dim / pooled_dim): the widths the
    text encoders must have produced (T5-XXL 4096, CLIP-L 768 for FLUX.1); None accepts any width."""
    cond, extras = single_entry(positive, SUPPORTED_COND_KEYS)
    width = lambda t, want: want is None or t.shape[-1] == want  # noqa: E731
    if not torch.is_tensor(cond) or cond.ndim != 3 or not width(cond, text_dim) or cond.shape[0] < 1:
        shape = tuple(cond.shape) if torch.is_tensor(cond) else type(cond).__name__
        raise ConfigError(
            f"conditioning tensor has shape {shape}; this model expects [batch, tokens, {text_dim or 4096}] "
            "(T5-XXL text features): encode the prompt with a FLUX DualCLIPLoader (clip_l + t5xxl)"
        )
    pooled = extras.get("pooled_output")
    if not torch.is_tensor(pooled) or pooled.ndim != 2 or not width(pooled, pooled_dim):
        got = f" (got {tuple(pooled.shape)})" if torch.is_tensor(pooled) else ""
        raise ConfigError(
            f"conditioning has no pooled_output [batch, {pooled_dim or 768}]{got}; encode the prompt with a FLUX "
            "DualCLIPLoader (clip_l + t5xxl) and CLIPTextEncode"
        )
    for name, tensor in (("conditioning tensor", cond), ("pooled_output", pooled)):
        check_real(name, tensor)
        check_finite(name, tensor, "re-encode the prompt (a broken text encoder or a bad upstream node)")
    return {
        "context": repeat_to_batch_size(cond.to(torch.float32), batch),
        "y": repeat_to_batch_size(pooled.to(torch.float32), batch),
        "guidance": guidance_tensor(extras, batch) if variant == "dev" else None,
    }


# --- the plan and the loop -------------------------------------------------------------------------


def plan_sampling(
    latent: Mapping[str, Any],
    positive: Any,
    request: SamplingRequest,
    variant: str = "dev",
    text_dim: int | None = None,
    pooled_dim: int | None = None,
    fmt: LatentFormat | None = None,
    model: str = "FLUX",
) -> SamplingPlan:
    """FLUX.1's plan for a LATENT dict: KSampler(euler, simple) on the variant's sigma table (the request's
    `shift_mu`: ModelSamplingFlux's). `text_dim` / `pooled_dim`: the checkpoint's conditioning widths (see
    convert_conditioning); `fmt`: the family's latent format (FLUX.1's own when None)."""
    if variant not in VARIANTS:
        raise ConfigError(f"variant={variant!r} is not a FLUX.1 variant; use 'dev' or 'schnell'")
    shift_mu, sigmas = request.shift_mu, request.sigmas
    if shift_mu is not None:
        check_shift_mu(shift_mu)
        if sigmas is not None:
            raise ConfigError(
                f"shift_mu={shift_mu!r} has no effect when sigmas are given (they are the whole schedule); "
                "leave shift_mu unset, or drop sigmas to sample from the shifted table"
            )
    table = sigma_table(variant, shift_mu) if sigmas is None else None
    return make_plan(
        latent, request, fmt=fmt or LATENT, model=model,
        schedule=lambda n, shape: simple_schedule(table, n),
        conditioning=lambda batch: convert_conditioning(positive, batch, variant, text_dim, pooled_dim),
    )  # fmt: skip


def plan_for(
    info: CheckpointInfo, latent: Mapping[str, Any], positive: Any, request: SamplingRequest
) -> SamplingPlan:
    """FLUX.1's `ModelFamily.sampling`: `plan_sampling` for the checkpoint `info` describes."""
    dims = info.dims
    return plan_sampling(
        latent, positive, request, variant(info.config), dims.text_dim, dims.pooled_dim,
        info.model_family.latent, info.model_name,
    )  # fmt: skip


def call_model(model_fn: ModelFn) -> ModelCall:
    """`euler`'s model call in this process: ComfyUI's FLUX.1 call around a diffusers-style `model_fn`."""
    return lambda x, timestep, inputs: flux_call(model_fn, x, timestep, **inputs)


def run_euler(
    model_fn: ModelFn,
    plan: SamplingPlan,
    callback: Callable[[int, int], None] | None = None,
    model_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`euler` in this process around a diffusers-style FLUX.1 `model_fn` (ComfyUI's model call around it)."""
    return euler(call_model(model_fn), plan, callback, model_dtype)


def sample_flux(
    model_fn: ModelFn,
    latent: torch.Tensor,
    positive: Any,
    seed: int,
    steps: int,
    denoise: float = 1.0,
    sigmas: Sequence[float] | torch.Tensor | None = None,
    noise_mask: torch.Tensor | None = None,
    batch_index: Sequence[int] | None = None,
    variant: str = "dev",
    shift_mu: float | None = None,
    callback: Callable[[int, int], None] | None = None,
    model_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """ComfyUI `KSampler(euler, simple, cfg 1.0)` for FLUX around any diffusers-style `model_fn`.

    latent: LATENT["samples"] [B, 16, H/8, W/8] in VAE space; positive: CONDITIONING with one entry;
    sigmas: a SIGMAS override (SamplerCustom); noise_mask / batch_index: the LATENT's optional entries;
    shift_mu: the ModelSamplingFlux shift (see `resolution_mu`); callback(step, total) after each step.
    Returns the sampled latent [B, 16, H/8, W/8] in VAE space, float32.
    """
    job = {"samples": latent, "noise_mask": noise_mask, "batch_index": batch_index}
    request = SamplingRequest(seed, steps, denoise, sigmas, shift_mu)
    plan = plan_sampling(job, positive, request, variant)
    return run_euler(model_fn, plan, callback, model_dtype)


def diffusers_model_fn(model: torch.nn.Module) -> ModelFn:
    """Adapt a diffusers FluxTransformer2DModel (or anything with its forward) to the `model_fn` contract."""

    @torch.no_grad()
    def model_fn(
        hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids, guidance
    ):
        return model(
            hidden_states=hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            pooled_projections=pooled_projections,
            timestep=timestep,
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=guidance,
            return_dict=False,
        )[0]

    return model_fn
