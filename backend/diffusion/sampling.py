"""ComfyUI-exact sampling shared by every family: noise, masks, schedules' common rules, and the Euler loop.

The target is bit-for-bit agreement with ComfyUI's own `KSampler(euler, ..., cfg 1.0)` (and `SamplerCustom`
with a SIGMAS input), so every formula below repeats ComfyUI's arithmetic in the same order and dtype
(comfy/samplers.py, comfy/sample.py, comfy/utils.py, comfy/k_diffusion/sampling.py). It is written by hand
because ComfyUI is not a dependency of the backend, and diffusers' schedulers use other tables and noise.

A family brings what differs (its folder's sampling.py): the sigma table or scheduler, how a CONDITIONING
becomes its model call's inputs, and its latent format. `make_plan` validates a job and decides everything
(noise, sigmas, the call's inputs) once; `euler` only calls the model. `ParallelModel.sample` runs it in the
caller with `ParallelModel.forward` as the model call (one request to every rank per step); a family's
one-process helpers run it around a diffusers model.

"Sampling plan" (`SamplingPlan`) is one job's decided inputs; it is unrelated to the TP plan (a family's
tp.py) and to the planner (`backend/plan/`, layout costs and `auto`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ..config import ConfigError
from .finite import all_finite, non_finite_kind

if TYPE_CHECKING:
    from ..family import LatentFormat

# ComfyUI KSampler's steps widget: 1 .. 10000 (a schedule of 1e9 steps filled the caller's memory).
MAX_STEPS = 10000
SEED_LIMIT = 2**64  # ComfyUI's seed widgets: 0 .. 0xffffffffffffffff


@dataclass(frozen=True)
class SamplingRequest:
    """What a sampling job asks for besides the model, the prompt and the latent: one record for the API,
    the checks, the nodes and every family's schedule. `sigmas` (a SIGMAS input, as SamplerCustom takes
    it) overrides `steps` / `denoise`; `shift_mu` replaces the family's default shift (ModelSamplingFlux's
    mu for FLUX.1, ModelSamplingAuraFlow's shift for Qwen-Image; a family without one refuses it)."""

    seed: int
    steps: int
    denoise: float = 1.0
    sigmas: Sequence[float] | torch.Tensor | None = None
    shift_mu: float | None = None


# --- checks every input goes through ------------------------------------------------------------------


def check_finite(name: str, tensor: torch.Tensor, fix: str) -> None:
    """NaN or inf in an input makes every step NaN: refuse it, naming the input."""
    if not all_finite(tensor):
        raise ConfigError(f"{name} contains {non_finite_kind(tensor)} values; {fix}")


def check_real(name: str, tensor: torch.Tensor) -> None:
    if tensor.is_meta or tensor.device.type not in ("cpu", "cuda"):
        raise ConfigError(
            f"{name} is on the '{tensor.device}' device and holds no values; give a CPU or GPU tensor"
        )


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


# --- schedules' common rules ------------------------------------------------------------------------


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


# --- noise, mask, conditioning ----------------------------------------------------------------------


def prepare_noise(shape: Sequence[int], seed: int, batch_index: Sequence[int] | None = None) -> torch.Tensor:
    """comfy/sample.py `prepare_noise`: CPU float32 noise from `seed`, drawn per batch index when given.

    With batch_index, one [1, ...] draw per index 0..max(index) in order, so a latent that is item k of a
    larger batch gets the noise item k got there.
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
    """comfy/utils.py `reshape_mask`, verbatim: a [.., h, w] mask to the latent's size (bilinear; trilinear for
    a latent of several frames, [B, C, T, H, W]), every channel, every batch entry."""
    dims = len(latent_shape) - 2
    if dims == 3:
        if noise_mask.ndim < 5:
            noise_mask = noise_mask.reshape((1, 1, -1, noise_mask.shape[-2], noise_mask.shape[-1]))
        mode = "trilinear"
    else:
        noise_mask = noise_mask.reshape((-1, 1, noise_mask.shape[-2], noise_mask.shape[-1]))
        mode = "bilinear"
    mask = F.interpolate(noise_mask.to(torch.float32), size=tuple(latent_shape[2:]), mode=mode)
    if mask.shape[1] < latent_shape[1]:
        mask = mask.repeat((1, latent_shape[1]) + (1,) * dims)[:, : latent_shape[1]]
    return repeat_to_batch_size(mask, latent_shape[0])


def single_entry(positive: Any, supported: Sequence[str]) -> tuple[Any, Mapping[str, Any]]:
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
        raise ConfigError(
            "positive conditioning entry must be [cond tensor, {extras...}] as CLIPTextEncode makes it"
        )
    cond, extras = entry
    unsupported = sorted(k for k in extras if k not in supported)
    if unsupported:
        raise ConfigError(
            f"positive conditioning sets {', '.join(unsupported)}, which this sampler does not support yet "
            f"(supported: {', '.join(supported)}); remove the node that adds them"
        )
    return cond, extras


def text_features(cond: Any, width: int, model: str, encoder: str, empty: bool = False) -> torch.Tensor:
    """A CONDITIONING's text features [batch, tokens, width] (tokens >= 1 unless `empty`), real and finite,
    as float32; ConfigError naming the encoder otherwise."""
    least = 0 if empty else 1
    if (
        not torch.is_tensor(cond)
        or cond.ndim != 3
        or cond.shape[-1] != width
        or cond.shape[0] < 1
        or (cond.shape[1] < least)
    ):
        shape = tuple(cond.shape) if torch.is_tensor(cond) else type(cond).__name__
        raise ConfigError(
            f"conditioning tensor has shape {shape}; {model} expects [batch, tokens, {width}]: encode the "
            f"prompt with {encoder}"
        )
    check_real("conditioning tensor", cond)
    check_finite(
        "conditioning tensor", cond, "re-encode the prompt (a broken text encoder or a bad upstream node)"
    )
    return cond.to(torch.float32)


# --- the plan and the loop --------------------------------------------------------------------------

# A model call's inputs besides x and timestep, by the family's names (its `CallSpec`): the text features,
# a pooled vector, guidance, ... — what `ParallelModel.forward` takes as keywords.
Inputs = Mapping[str, Any]


@dataclass(frozen=True)
class SamplingPlan:
    """Everything the Euler loop needs, decided once, in the caller, from the user's input."""

    noise: torch.Tensor  # the latent's shape
    latent_image: torch.Tensor  # process_in(latent), or the zero latent as is
    sigmas: torch.Tensor  # float32 [steps + 1]
    inputs: Inputs  # the model call's inputs for the whole batch (the family's conditioning)
    mask: torch.Tensor | None  # the latent's shape, in [0, 1]: 1 = regenerate, 0 = keep latent_image
    # the caller's latent in the format's dimensions, returned as is when there is nothing to do
    original: torch.Tensor
    latent: LatentFormat  # the family's: process_out turns the result back into a VAE latent
    # the model's timestep per sigma (ComfyUI's `model_sampling.timestep`): 1 for FLUX's and AuraFlow's
    # sampling (the model gets sigma), 1000 for ModelSamplingSD3's (Wan)
    multiplier: float = 1.0

    @property
    def steps(self) -> int:
        return max(len(self.sigmas) - 1, 0)


def checked_latent(
    latent: torch.Tensor, fmt: LatentFormat, model: str, channels: int | None = None, frames: bool = False
) -> torch.Tensor:
    """A LATENT's samples in `model`'s latent format (`channels`: the model's own, when they differ from
    the format's, as in a small test model; `frames`: the model takes several frames), or ConfigError
    naming the shape and the fix."""
    c, scale = channels or fmt.channels, fmt.downscale
    # a format of 3 latent dimensions (Wan 2.1's: [B, C, T, H, W]) takes images as T = 1, and 4-D latents
    # as ComfyUI's fix_empty_latent_channels does: unsqueezed
    ndims = (4,) if fmt.dimensions == 2 else (4, 2 + fmt.dimensions)
    several = latent.ndim == 5 and latent.shape[2] != 1 if torch.is_tensor(latent) else False
    if (
        not torch.is_tensor(latent)
        or latent.ndim not in ndims
        or 0 in latent.shape
        or (several and not frames)
    ):
        shape = tuple(latent.shape) if torch.is_tensor(latent) else type(latent).__name__
        frame = (", frames" if frames else ", 1") if fmt.dimensions == 3 else ""
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
    latent: Mapping[str, Any],
    request: SamplingRequest,
    *,
    fmt: LatentFormat,
    schedule: Callable[[int, Sequence[int]], torch.Tensor],
    conditioning: Callable[[int], Inputs],
    model: str,
    channels: int | None = None,
    frames: bool = False,
    multiplier: float = 1.0,
) -> SamplingPlan:
    """Validate a job and decide noise, schedule and the call's inputs exactly as ComfyUI would, for any
    family: `latent` is ComfyUI's LATENT dict (`samples`, optional `noise_mask` and `batch_index`),
    `schedule(n, latent_shape)` gives the family's n-step sigmas, `conditioning(batch)` its model call's
    inputs, `fmt` its latent format (`channels`: the model's latent channels when not the format's;
    `frames`: it takes several frames), `model` its name, `multiplier` its timestep per sigma. The request's
    `sigmas` override steps/denoise."""
    if not isinstance(latent, Mapping) or "samples" not in latent:
        raise ConfigError(
            f"latent must be a LATENT dict with 'samples' [batch, {channels or fmt.channels}, ...] as "
            f"{fmt.empty_node} or VAE Encode make it"
        )
    check_seed(request.seed)
    original = checked_latent(latent["samples"], fmt, model, channels, frames).to(torch.float32)
    # An image of a 3-D format runs on [B, C, H, W]: T = 1, and its noise (drawn over the same elements in
    # the same order) is ComfyUI's for the 5-D shape. A video keeps its frames.
    work = original[:, :, 0] if original.ndim == 5 and original.shape[2] == 1 else original
    batch = work.shape[0]
    if request.sigmas is not None:
        sigmas = checked_sigmas(request.sigmas)
    else:
        steps, denoise = request.steps, request.denoise
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
            raise ConfigError(f"steps={steps!r} must be from 1 to {MAX_STEPS}, as ComfyUI's KSampler allows")
        if isinstance(denoise, bool) or not isinstance(denoise, int | float) or not 0.0 <= denoise <= 1.0:
            raise ConfigError(f"denoise={denoise!r} must be between 0 and 1")
        sigmas = with_denoise(lambda n: schedule(n, work.shape), steps, float(denoise))
    batch_index = latent.get("batch_index")
    if batch_index is not None:
        batch_index = [int(i) for i in batch_index]
        if len(batch_index) != batch or min(batch_index) < 0:
            raise ConfigError(
                f"batch_index {batch_index} must list one index >= 0 for each of the {batch} latents"
            )
    inputs = conditioning(batch)
    mask = None
    noise_mask = latent.get("noise_mask")
    if noise_mask is not None:
        if not torch.is_tensor(noise_mask) or noise_mask.ndim < 2:
            raise ConfigError("noise_mask must be a tensor [..., height, width] (SetLatentNoiseMask output)")
        check_finite(
            "noise_mask", noise_mask, "check the node that made the mask (SetLatentNoiseMask, a mask editor)"
        )
        check_real("noise_mask", noise_mask)
        check_finite("noise_mask", noise_mask, "make the mask again (SetLatentNoiseMask, or a mask node)")
        mask = latent_mask(noise_mask, work.shape)
    # CFGGuider.inner_sample: an all-zero latent (EmptyLatentImage) is deliberately NOT shifted.
    image = fmt.process_in(work) if torch.count_nonzero(work) > 0 else work
    return SamplingPlan(
        noise=prepare_noise(work.shape, int(request.seed), batch_index),
        latent_image=image,
        sigmas=sigmas,
        inputs=inputs,
        mask=mask,
        original=original,
        latent=fmt,
        multiplier=float(multiplier),
    )


def _noise_scaling(sigma: torch.Tensor, noise: torch.Tensor, latent_image: torch.Tensor) -> torch.Tensor:
    """comfy CONST.noise_scaling: the point on the straight path from the image (0) to noise (1)."""
    return sigma * noise + (1.0 - sigma) * latent_image


def _batch_sigma(sigma: torch.Tensor, ndim: int) -> torch.Tensor:
    """comfy reshape_sigma: a scalar for one item, [B, 1, ...] otherwise."""
    if sigma.nelement() == 1:
        return sigma.view(())
    return sigma.view(sigma.shape[:1] + (1,) * (ndim - 1))


# (x, sigma per latent, the call's inputs) -> velocity: ComfyUI's `diffusion_model(x, timestep, **inputs)`,
# e.g. a family's call around a diffusers model in one process, or `ParallelModel.forward`.
ModelCall = Callable[[torch.Tensor, torch.Tensor, Inputs], torch.Tensor]


def cast_inputs(inputs: Inputs, dtype: torch.dtype | None) -> dict[str, Any]:
    """The floating tensors of `inputs` in `dtype`, as ComfyUI casts a model's inputs (a boolean mask and
    strings stay as they are)."""

    def cast(value: Any) -> Any:
        if dtype is not None and torch.is_tensor(value) and value.is_floating_point():
            return value.to(dtype)
        if isinstance(value, tuple | list):
            return type(value)(cast(v) for v in value)
        return value

    return {name: cast(value) for name, value in inputs.items()}


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
    network inputs as ComfyUI does; the output is used in float32. `callback(step, total)` runs after each
    step; an exception from it ends the loop there.
    """
    sigmas = plan.sigmas
    if len(sigmas) == 0:
        return plan.original  # denoise 0: ComfyUI hands the input back untouched
    noise, image, mask = plan.noise, plan.latent_image, plan.mask
    b = noise.shape[0]
    cast = (lambda t: t.to(model_dtype)) if model_dtype is not None else (lambda t: t)
    inputs = cast_inputs(plan.inputs, model_dtype)
    keep = 1.0 - mask if mask is not None else None

    x = _noise_scaling(sigmas[0], noise, image)
    s_in = x.new_ones([b])
    total = len(sigmas) - 1
    for i in range(total):
        sigma = sigmas[i]
        sigma_b = sigma * s_in
        x_in = x
        if mask is not None:
            x_in = x * mask + _noise_scaling(_batch_sigma(sigma_b, x.ndim), noise, image) * keep
        v = call(cast(x_in), sigma_b * plan.multiplier, inputs).float()  # model_sampling.timestep(sigma)
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


__all__ = [
    "MAX_STEPS",
    "SEED_LIMIT",
    "Inputs",
    "ModelCall",
    "SamplingPlan",
    "SamplingRequest",
    "cast_inputs",
    "check_finite",
    "check_real",
    "check_seed",
    "checked_latent",
    "checked_sigmas",
    "denoise_schedule",
    "euler",
    "latent_mask",
    "make_plan",
    "prepare_noise",
    "repeat_to_batch_size",
    "simple_schedule",
    "single_entry",
    "text_features",
    "with_denoise",
]
