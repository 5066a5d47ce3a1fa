"""ComfyUI-exact FLUX sampling: latent format, sigma schedules, noise, conditioning, and the Euler loop.

The target is bit-for-bit agreement with ComfyUI's own `KSampler(euler, simple, cfg 1.0)` (and
`SamplerCustom` with a SIGMAS input), so every formula below repeats ComfyUI's arithmetic in the same
order and dtype (comfy/model_sampling.py, comfy/samplers.py, comfy/sample.py, comfy/k_diffusion/sampling.py
at ComfyUI 0.3.64). It is written by hand because ComfyUI is not a dependency of the backend, and
diffusers' FlowMatchEulerDiscreteScheduler uses a different table and noise.

The loop is a pure function of a model call and plain tensors: `make_plan` validates the input and
decides everything (noise, sigmas, conditioning) once; `euler` only calls the model. `ParallelFlux.sample`
runs it in the caller with `ParallelFlux.forward` as the model call (one request to every rank per step);
`sample_flux` / `run_euler` run it in one process around a diffusers model. FLUX.2 (flux2/sampling.py)
uses the same plan and loop with its own schedule, conditioning and latent format.

"Sampling plan" (`SamplingPlan`) is one job's decided inputs; it is unrelated to the TP plan
(`parallel.tensor.FLUX_TP_PLAN`) and to the planner (`backend/plan/`, layout costs and `auto`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ..config import ConfigError
from ..family import LatentFormat, get_family
from ..finite import all_finite, non_finite_kind
from .forward import ModelFn, flux_call

if TYPE_CHECKING:
    from ..checkpoint import CheckpointInfo

# comfy/latent_formats.py `Flux`.
LATENT_CHANNELS = 16
SHIFT_FACTOR = 0.1159
SCALE_FACTOR = 0.3611

# comfy/model_sampling.py `ModelSamplingFlux` default shift (mu) for FLUX.1-dev.
DEV_MU = 1.15
VARIANTS = ("dev", "schnell")
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


def simple_schedule(table: torch.Tensor, steps: int) -> torch.Tensor:
    """comfy/samplers.py `simple_scheduler`: every len/steps-th sigma from the top, then 0."""
    ss = len(table) / steps
    sigs = [float(table[-(1 + int(x * ss))]) for x in range(steps)]
    return torch.tensor([*sigs, 0.0], dtype=torch.float32)


def with_denoise(schedule: Callable[[int], torch.Tensor], steps: int, denoise: float) -> torch.Tensor:
    """comfy/samplers.py `KSampler.set_steps` for any scheduler (`schedule(n)`: its n-step sigmas): with
    denoise < 1, schedule steps/denoise steps and keep the tail."""
    if denoise > 0.9999:
        return schedule(steps)
    if denoise <= 0.0:
        return torch.zeros(0)
    return schedule(int(steps / denoise))[-(steps + 1) :]


def denoise_schedule(table: torch.Tensor, steps: int, denoise: float) -> torch.Tensor:
    """The `simple` schedule of `table` with KSampler's denoise rule."""
    return with_denoise(lambda n: simple_schedule(table, n), steps, denoise)


# --- noise, mask, conditioning ---------------------------------------------------------------------


def prepare_noise(shape: Sequence[int], seed: int, batch_index: Sequence[int] | None = None) -> torch.Tensor:
    """comfy/sample.py `prepare_noise`: CPU float32 noise from `seed`, drawn per batch index when given.

    With batch_index, one [1, C, H, W] draw per index 0..max(index) in order, so a latent that is
    item k of a larger batch gets the noise item k got there.
    """
    g = torch.Generator().manual_seed(seed)
    if batch_index is None:
        return torch.randn(tuple(shape), dtype=torch.float32, generator=g)
    wanted = set(batch_index)
    draws = {}
    for i in range(max(wanted) + 1):
        noise = torch.randn((1, *shape[1:]), dtype=torch.float32, generator=g)
        if i in wanted:
            draws[i] = noise
    return torch.cat([draws[i] for i in batch_index], dim=0)


def repeat_to_batch_size(tensor: torch.Tensor, batch_size: int, dim: int = 0) -> torch.Tensor:
    """comfy/utils.py `repeat_to_batch_size`: truncate, or tile and truncate, along `dim`."""
    n = tensor.shape[dim]
    if n > batch_size:
        return tensor.narrow(dim, 0, batch_size)
    if n < batch_size:
        reps = [1] * tensor.ndim
        reps[dim] = math.ceil(batch_size / n)
        return tensor.repeat(reps).narrow(dim, 0, batch_size)
    return tensor


def latent_mask(noise_mask: torch.Tensor, latent_shape: Sequence[int]) -> torch.Tensor:
    """comfy/utils.py `reshape_mask`: any [.., h, w] mask -> bilinear to the latent, every channel, batch."""
    mask = noise_mask.reshape((-1, 1, noise_mask.shape[-2], noise_mask.shape[-1])).to(torch.float32)
    mask = F.interpolate(mask, size=tuple(latent_shape[2:]), mode="bilinear")
    if mask.shape[1] < latent_shape[1]:
        mask = mask.repeat((1, latent_shape[1], 1, 1))[:, : latent_shape[1]]
    return repeat_to_batch_size(mask, latent_shape[0])


@dataclass(frozen=True)
class FluxConditioning:
    """One ComfyUI CONDITIONING entry as the transformer's inputs, repeated to the latent batch."""

    encoder_hidden_states: torch.Tensor  # [B, T, text_dim]
    pooled_projections: torch.Tensor  # [B, pooled_dim] (FLUX.2, which takes none: [B, 0])
    guidance: torch.Tensor | None  # [B], None without a guidance embedder (schnell, FLUX.2 [klein])


def check_finite(name: str, tensor: torch.Tensor, fix: str) -> None:
    """NaN or inf in an input makes every step NaN: refuse it, naming the input."""
    if not all_finite(tensor):
        raise ConfigError(f"{name} contains {non_finite_kind(tensor)} values; {fix}")


def check_real(name: str, tensor: torch.Tensor) -> None:
    if tensor.is_meta or tensor.device.type not in ("cpu", "cuda"):
        raise ConfigError(
            f"{name} is on the '{tensor.device}' device and holds no values; give a CPU or GPU tensor"
        )


def single_entry(
    positive: Any, supported: Sequence[str] = SUPPORTED_COND_KEYS
) -> tuple[Any, Mapping[str, Any]]:
    """The one `[cond, extras]` entry of a CONDITIONING; extras outside `supported` are refused (areas,
    masks, strengths, hooks, ControlNets, reference latents change ComfyUI's result)."""
    if not isinstance(positive, (list, tuple)) or len(positive) != 1:
        n = len(positive) if isinstance(positive, (list, tuple)) else type(positive).__name__
        raise ConfigError(
            f"positive conditioning has {n} entries; this sampler supports exactly 1 "
            "(no Conditioning Combine / Set Area / Concat yet): encode one prompt with CLIPTextEncode"
        )
    entry = positive[0]
    if not isinstance(entry, (list, tuple)) or len(entry) != 2 or not isinstance(entry[1], Mapping):
        raise ConfigError("positive conditioning entry must be [cond tensor, {'pooled_output': ...}]")
    cond, extras = entry
    unsupported = sorted(k for k in extras if k not in supported)
    if unsupported:
        raise ConfigError(
            f"positive conditioning sets {', '.join(unsupported)}, which this sampler does not support yet "
            f"(supported: {', '.join(supported)}); remove the node that adds them"
        )
    return cond, extras


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
) -> FluxConditioning:
    """ComfyUI CONDITIONING `[[cond, {"pooled_output": ..., "guidance": ...}]]` -> transformer inputs.

    `text_dim` / `pooled_dim` are the checkpoint's (FluxDims.text_dim / pooled_dim): the widths the
    text encoders must have produced (T5-XXL 4096, CLIP-L 768 for FLUX.1); None accepts any width."""
    cond, extras = single_entry(positive)
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
    return FluxConditioning(
        encoder_hidden_states=repeat_to_batch_size(cond.to(torch.float32), batch),
        pooled_projections=repeat_to_batch_size(pooled.to(torch.float32), batch),
        guidance=guidance_tensor(extras, batch) if variant == "dev" else None,
    )


# --- the plan and the loop -------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingPlan:
    """Everything the Euler loop needs, decided once, in the caller, from the user's input."""

    noise: torch.Tensor  # [B, C, H, W]
    latent_image: torch.Tensor  # process_in(latent), or the zero latent as is
    sigmas: torch.Tensor  # float32 [steps + 1]
    cond: FluxConditioning
    mask: torch.Tensor | None  # [B, C, H, W] in [0, 1]: 1 = regenerate, 0 = keep latent_image
    original: (
        torch.Tensor
    )  # the caller's latent in the format's dimensions, returned as is when there is nothing to do
    latent: LatentFormat  # the family's: process_out turns the result back into a VAE latent

    @property
    def steps(self) -> int:
        return max(len(self.sigmas) - 1, 0)


def checked_latent(
    latent: torch.Tensor, fmt: LatentFormat, model: str = "FLUX", channels: int | None = None
) -> torch.Tensor:
    """A LATENT's samples in `model`'s latent format (`channels`: the model's own, when they differ from
    the format's, as in a small test model), or ConfigError naming the shape and the fix."""
    c, scale = channels or fmt.channels, fmt.downscale
    # a format of 3 latent dimensions (Wan 2.1's: [B, C, T, H, W]) takes images as T = 1, and 4-D latents
    # as ComfyUI's fix_empty_latent_channels does: unsqueezed
    ndims = (4,) if fmt.dimensions == 2 else (4, 2 + fmt.dimensions)
    frames = latent.ndim == 5 and latent.shape[2] != 1 if torch.is_tensor(latent) else False
    if not torch.is_tensor(latent) or latent.ndim not in ndims or 0 in latent.shape or frames:
        shape = tuple(latent.shape) if torch.is_tensor(latent) else type(latent).__name__
        frame = ", 1" if fmt.dimensions == 3 else ""
        raise ConfigError(
            f"latent samples have shape {shape}; expected [batch, {c}{frame}, height/{scale}, width/{scale}] with "
            "at least one image (batch >= 1)"
        )
    if latent.ndim == 4 and fmt.dimensions == 3:
        latent = latent.unsqueeze(2)
    check_real("latent samples", latent)
    check_finite("latent samples", latent, f"encode the image again or start from {fmt.empty_node}")
    if latent.shape[1] != c:
        if torch.count_nonzero(latent) > 0:
            raise ConfigError(
                f"latent has {latent.shape[1]} channels; {model} latents have {c}: encode the image with "
                f"{fmt.vae} or start from {fmt.empty_node}"
            )
        # comfy/sample.py fix_empty_latent_channels: an empty latent of another width becomes this one's.
        latent = repeat_to_batch_size(latent, c, dim=1)
    return latent


def make_plan(
    latent: torch.Tensor,
    seed: int,
    steps: int,
    denoise: float,
    sigmas: Sequence[float] | torch.Tensor | None,
    noise_mask: torch.Tensor | None,
    batch_index: Sequence[int] | None,
    *,
    fmt: LatentFormat,
    schedule: Callable[[int, Sequence[int]], torch.Tensor],
    conditioning: Callable[[int], FluxConditioning],
    model: str = "FLUX",
    channels: int | None = None,
) -> SamplingPlan:
    """Validate a job and decide noise, schedule and conditioning exactly as ComfyUI would, for any family:
    `schedule(n, latent_shape)` gives its n-step sigmas, `conditioning(batch)` its model inputs, `fmt` its
    latent format (`channels`: the model's latent channels when not the format's), `model` its name. `sigmas` (a SIGMAS input, as SamplerCustom takes it)
    overrides steps/denoise."""
    check_seed(seed)
    original = checked_latent(latent, fmt, model, channels).to(torch.float32)
    # the loop runs on [B, C, H, W]: a 5-D latent has T = 1, and its noise (drawn over the same elements in
    # the same order) is ComfyUI's for the 5-D shape
    latent = original[:, :, 0] if original.ndim == 5 else original
    batch = latent.shape[0]
    if sigmas is not None:
        sigmas = checked_sigmas(sigmas)
    else:
        if not 1 <= int(steps) <= MAX_STEPS:
            raise ConfigError(
                f"steps={steps} must be from 1 to {MAX_STEPS}, as ComfyUI's KSampler allows (FLUX: 20-50 for "
                "dev, 4 for schnell)"
            )
        if not 0.0 <= denoise <= 1.0:
            raise ConfigError(f"denoise={denoise} must be between 0 and 1")
        sigmas = with_denoise(lambda n: schedule(n, latent.shape), int(steps), float(denoise))
    if batch_index is not None:
        batch_index = [int(i) for i in batch_index]
        if len(batch_index) != batch or min(batch_index) < 0:
            raise ConfigError(
                f"batch_index {batch_index} must list one index >= 0 for each of the {batch} latents"
            )
    cond = conditioning(batch)
    mask = None
    if noise_mask is not None:
        if not torch.is_tensor(noise_mask) or noise_mask.ndim < 2:
            raise ConfigError("noise_mask must be a tensor [..., height, width] (SetLatentNoiseMask output)")
        check_finite(
            "noise_mask", noise_mask, "check the node that made the mask (SetLatentNoiseMask, a mask editor)"
        )
        mask = latent_mask(noise_mask, latent.shape)
    # CFGGuider.inner_sample: an all-zero latent (EmptyLatentImage) is deliberately NOT shifted.
    image = fmt.process_in(latent) if torch.count_nonzero(latent) > 0 else latent
    return SamplingPlan(
        noise=prepare_noise(latent.shape, int(seed), batch_index),
        latent_image=image,
        sigmas=sigmas,
        cond=cond,
        mask=mask,
        original=original,
        latent=fmt,
    )


def plan_sampling(
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
    text_dim: int | None = None,
    pooled_dim: int | None = None,
) -> SamplingPlan:
    """FLUX.1's plan: KSampler(euler, simple) on the variant's sigma table (`shift_mu`: ModelSamplingFlux).

    `text_dim` / `pooled_dim`: the checkpoint's conditioning widths (see convert_conditioning).
    """
    if variant not in VARIANTS:
        raise ConfigError(f"variant={variant!r} is not a FLUX.1 variant; use 'dev' or 'schnell'")
    if shift_mu is not None:
        check_shift_mu(shift_mu)
        if sigmas is not None:
            raise ConfigError(
                f"shift_mu={shift_mu!r} has no effect when sigmas are given (they are the whole schedule); "
                "leave shift_mu unset, or drop sigmas to sample from the shifted table"
            )
    table = sigma_table(variant, shift_mu) if sigmas is None else None
    return make_plan(
        latent, seed, steps, denoise, sigmas, noise_mask, batch_index,
        fmt=get_family("flux1").latent,
        schedule=lambda n, shape: simple_schedule(table, n),
        conditioning=lambda batch: convert_conditioning(positive, batch, variant, text_dim, pooled_dim),
    )  # fmt: skip


def plan_for(
    info: CheckpointInfo,
    latent: torch.Tensor,
    positive: Any,
    *,
    seed: int,
    steps: int,
    denoise: float = 1.0,
    sigmas: Sequence[float] | torch.Tensor | None = None,
    noise_mask: torch.Tensor | None = None,
    batch_index: Sequence[int] | None = None,
    shift_mu: float | None = None,
) -> SamplingPlan:
    """FLUX.1's `ModelFamily.sampling`: `plan_sampling` for the checkpoint `info` describes."""
    dims = info.dims
    return plan_sampling(
        latent, positive, seed, steps, denoise, sigmas, noise_mask, batch_index, info.variant, shift_mu,
        dims.text_dim, dims.pooled_dim,
    )  # fmt: skip


MAX_STEPS = (
    10000  # ComfyUI KSampler's steps widget: 1 .. 10000 (a schedule of 1e9 steps filled the caller's memory)
)
SEED_LIMIT = 2**64  # ComfyUI's seed widgets: 0 .. 0xffffffffffffffff


def check_seed(seed: Any) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise ConfigError(
            f"seed={seed!r} must be an integer from 0 to {SEED_LIMIT - 1} (2**64 - 1), as in ComfyUI"
        )


def checked_sigmas(sigmas: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """A SIGMAS input: finite, never increasing (noise goes down step by step), at least one step, at most
    MAX_STEPS (its length is bounded before it is read: a list of a million passed the steps bound)."""
    count = sigmas.numel() if torch.is_tensor(sigmas) else len(sigmas)
    if count > MAX_STEPS + 1:
        raise ConfigError(
            f"sigmas holds {count} values ({count - 1} steps); at most {MAX_STEPS + 1} ({MAX_STEPS} steps, as "
            "ComfyUI's KSampler allows): use a scheduler's output, e.g. BasicScheduler with fewer steps"
        )
    schedule = torch.as_tensor(sigmas, dtype=torch.float32).flatten().cpu()
    check_finite("sigmas", schedule, "check the scheduler node that made them")
    rising = [i for i in range(len(schedule) - 1) if schedule[i + 1] > schedule[i]]
    if rising:
        i = rising[0]
        raise ConfigError(
            f"sigmas must not increase, but sigma[{i + 1}]={schedule[i + 1].item():g} > "
            f"sigma[{i}]={schedule[i].item():g}; use a scheduler's output (e.g. BasicScheduler) or flip them"
        )
    if len(schedule) and (schedule < 0).any():
        raise ConfigError(f"sigmas must be >= 0; got {schedule.min().item():g}")
    return schedule


def _noise_scaling(sigma: torch.Tensor, noise: torch.Tensor, latent_image: torch.Tensor) -> torch.Tensor:
    """comfy CONST.noise_scaling: the point on the straight path from the image (0) to noise (1)."""
    return sigma * noise + (1.0 - sigma) * latent_image


def _batch_sigma(sigma: torch.Tensor, ndim: int) -> torch.Tensor:
    """comfy reshape_sigma: a scalar for one item, [B, 1, 1, 1] otherwise."""
    if sigma.nelement() == 1:
        return sigma.view(())
    return sigma.view(sigma.shape[:1] + (1,) * (ndim - 1))


# (x, sigma per latent, context, pooled, guidance) -> velocity: ComfyUI's `diffusion_model(x, timestep,
# context, y, guidance)`, e.g. `partial(flux_call, model_fn)` in one process or `ParallelFlux.forward`.
ModelCall = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor
]


@torch.no_grad()
def euler(
    call: ModelCall,
    plan: SamplingPlan,
    callback: Callable[[int, int], None] | None = None,
    model_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """k-diffusion `sample_euler` inside ComfyUI's KSamplerX0Inpaint; returns the VAE-space latent.

    The arithmetic keeps ComfyUI's order (denoised = x - v*sigma; d = (x - denoised)/sigma) rather than
    the shorter x + v*dt, so results agree bit for bit up to the network itself. `model_dtype` casts the
    network inputs as ComfyUI does (x, text, pooled, guidance); the output is used in float32.
    `callback(step, total)` runs after each step; an exception from it ends the loop there.
    """
    sigmas = plan.sigmas
    if len(sigmas) == 0:
        return plan.original  # denoise 0: ComfyUI hands the input back untouched
    noise, image, mask = plan.noise, plan.latent_image, plan.mask
    b = noise.shape[0]
    cast = (lambda t: t.to(model_dtype)) if model_dtype is not None else (lambda t: t)
    cond = plan.cond
    ehs, pooled = cast(cond.encoder_hidden_states), cast(cond.pooled_projections)
    guidance = cast(cond.guidance) if cond.guidance is not None else None
    keep = 1.0 - mask if mask is not None else None

    x = _noise_scaling(sigmas[0], noise, image)
    s_in = x.new_ones([b])
    total = len(sigmas) - 1
    for i in range(total):
        sigma = sigmas[i]
        sigma_b = sigma * s_in
        x_in = x
        if mask is not None:
            x_in = x * mask + _noise_scaling(sigma_b.view(b, 1, 1, 1), noise, image) * keep
        v = call(cast(x_in), sigma_b, ehs, pooled, guidance).float()
        denoised = x_in - v * _batch_sigma(sigma_b, v.ndim)
        if mask is not None:
            denoised = denoised * mask + image * keep
        d = (x - denoised) / sigma
        x = x + d * (sigmas[i + 1] - sigma)
        if not all_finite(x):
            raise FloatingPointError(
                f"step {i + 1} of {total} produced NaN or inf values (sigma {sigma.item():g}); the model's "
                "output overflowed: try dtype='bfloat16' or 'float32' instead of float16, or check the inputs"
            )
        if callback is not None:
            callback(i + 1, total)
    x = x / (1.0 - sigmas[-1])  # CONST.inverse_noise_scaling; a no-op when the schedule ends at 0
    return plan.latent.process_out(x.to(torch.float32)).reshape(plan.original.shape)


def run_euler(
    model_fn: ModelFn,
    plan: SamplingPlan,
    callback: Callable[[int, int], None] | None = None,
    model_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`euler` in this process around a diffusers-style FLUX.1 `model_fn` (ComfyUI's model call around it)."""
    return euler(partial(flux_call, model_fn), plan, callback, model_dtype)


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
    plan = plan_sampling(
        latent, positive, seed, steps, denoise, sigmas, noise_mask, batch_index, variant, shift_mu
    )
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
