"""The public Python API: a parallel FLUX that stays resident between jobs. The nodes use it too.

>>> from rocm_parallel.backend.api import ParallelFlux
>>> with ParallelFlux(["cuda:0", "cuda:1"]) as flux:
...     flux.load("models/diffusion_models/flux1-dev.safetensors", layout="tp")
...     out = flux.sample(positive, {"samples": latent}, seed=0, steps=20)

Everything a user can get wrong is checked here, in the caller's process, before any worker starts or
any step runs: devices, checkpoint, layout, latent, conditioning, schedule (checks.py). A step is one
`forward`: one request to every rank (forward_client.py, then serve.py on the workers); `sample` is the
Euler loop (flux/sampling.py) over `forward`, run here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from .admission import admit
from .auto import make_layout
from .checkpoint import CheckpointInfo, inspect_checkpoint, planned_weight_dtype
from .checkpoint.gguf import check_block_splits
from .checks import check_forward, check_sample
from .client import ProgressCallback
from .config import ConfigError, ParallelLayout
from .flux.sampling import SamplingPlan
from .messages import LoadRequest
from .resident import Checkpoint, ResidentGroup, default_devices

__all__ = ["ParallelFlux", "default_devices", "make_layout"]


class ParallelFlux(ResidentGroup):
    """A FLUX transformer spread over several devices, resident in a worker group between jobs
    (`ResidentGroup`: start, load, unload, status, 'auto'), and the jobs that run on it: `forward`, one
    model call as ComfyUI's samplers make it, and `sample`, ComfyUI's default sampling over `forward`.

    A failed job (a rank failed while its peers waited for it, a worker died, stopped answering or ran
    past its time limit) closes the group; the next call starts a fresh one and loads the same checkpoint
    again, so a caller never has to clean up. Every job runs under the group's default watchdog
    (`client.DEFAULT_WATCHDOG`), so a hung GPU fails the job without the caller passing `timeout`.

    Thread-safe: calls from several threads run one at a time; `status()` never waits for a running
    job (it answers from the last report, marked busy).
    """

    # ------------------------------------------------------------------ sampling

    @staticmethod
    def check_sample(
        positive: Any,
        latent: dict[str, Any],
        *,
        checkpoint: Checkpoint,
        seed: int,
        steps: int,
        denoise: float = 1.0,
        sigmas: Sequence[float] | torch.Tensor | None = None,
        shift_mu: float | None = None,
    ) -> SamplingPlan:
        """Validate a sampling job against the checkpoint's header alone: no worker starts, nothing loads.

        Raises ConfigError naming the input, the value and the fix; returns the decided plan.
        """
        info = checkpoint if isinstance(checkpoint, CheckpointInfo) else inspect_checkpoint(checkpoint)
        return check_sample(
            info, positive, latent, seed=seed, steps=steps, denoise=denoise, sigmas=sigmas, shift_mu=shift_mu
        )

    def sample(
        self,
        positive: Any,
        latent: dict[str, Any],
        *,
        seed: int,
        steps: int,
        denoise: float = 1.0,
        sigmas: Sequence[float] | torch.Tensor | None = None,
        shift_mu: float | None = None,
        layout: str | ParallelLayout | None = None,
        ring: int | None = None,
        ulysses: int | None = None,
        progress: ProgressCallback | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """ComfyUI's default sampling of the resident model's family, a LATENT dict in and out: FLUX.1's
        `KSampler(euler, simple, cfg 1.0)`, FLUX.2's template (Flux2Scheduler, euler; `shift_mu` does not
        apply). The Euler loop runs here; each step is one `forward` on the ranks.

        `layout` re-shards the resident checkpoint when it differs. `progress(step, total)` runs after
        every step; raising from it stops the loop there (no rank is left mid-step), and so does any
        exception while waiting (Ctrl+C). `timeout` (seconds) bounds the whole job.
        """
        with self._lock:
            resident = self.resident
            if resident is None:
                raise ConfigError("no checkpoint is loaded; call load(checkpoint) first")
            info = resident.info
            samples = latent.get("samples") if isinstance(latent, dict) else None
            latent_dims = (4, 2 + info.model_family.latent.dimensions)  # [B, C, H, W] or [B, C, 1, H, W]
            shape = tuple(samples.shape) if torch.is_tensor(samples) and samples.ndim in latent_dims else None
            if shape is None:  # not a latent: check_sample says what is wrong with it
                check_sample(info, positive, latent, seed=seed, steps=steps, denoise=denoise, sigmas=sigmas)
            if layout == "auto" and shape is not None:
                b, (h, w) = shape[0], shape[-2:]
                width, height = info.model_family.planned_pixels(h, w)
                planned = planned_weight_dtype(resident.weight_dtype, info)
                layout = self.auto_layout(
                    info.dims, width, height, b, resident.dtype, weight_dtype=planned, family=info.family
                ).layout
            if layout is not None:
                wanted = make_layout(layout, len(self.devices), ring, ulysses)
                if wanted != resident.layout:
                    wanted.validate(info.dims, devices=len(self.devices))
                    check_block_splits(info, wanted.tp)
                    resident = dataclasses.replace(resident, layout=wanted)
            if shape is not None:  # before any allocation for the job (check_sample draws the noise)
                self._admit(resident, shape, _text_tokens(positive, info))
            plan = check_sample(
                info,
                positive,
                latent,
                seed=seed,
                steps=steps,
                denoise=denoise,
                sigmas=sigmas,
                shift_mu=shift_mu,
            )
            if plan.steps == 0:
                return {**latent, "samples": plan.original}
            resident.layout.validate_sequence(info.model_family.image_tokens(*plan.noise.shape[-2:]))
            group = self._resident_group(resident)

            def checked(*call: Any) -> tuple[Any, ...]:  # each step's call, checked like `forward`'s
                return _checked_call(resident, *call, None, None)

            samples = self._forwards.sample(group, plan, checked, progress, timeout, self.compute_dtype)
            return {**latent, "samples": samples}

    # ------------------------------------------------------------------ the forward service

    @property
    def conditioning_bytes_sent(self) -> int:
        """Conditioning bytes `forward` sent to the ranks since the model was loaded (each prompt once)."""
        return self._forwards.sender.sent_bytes

    @property
    def compiles(self) -> list[str]:
        """One line per `forward` since the load that compiled the blocks (load(compile=...)): the first call
        and each new input size, with the sizes and the call's time (rank 0's words)."""
        return list(self._forwards.compiles)

    @property
    def last_forward_seconds(self) -> float:
        """The ranks' own time for the latest `forward`: the slowest rank's, which the call waited for."""
        return self._forwards.last_seconds

    def forward(
        self,
        x: torch.Tensor,
        timestep: torch.Tensor,
        context: torch.Tensor,
        y: torch.Tensor | None = None,
        guidance: torch.Tensor | None = None,
        ref_latents: Sequence[torch.Tensor] | None = None,
        ref_method: str | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        timeout: float | None = None,
    ) -> torch.Tensor:
        """One model call on the resident model, as ComfyUI's FLUX `diffusion_model(x, timestep, context,
        y, guidance, ref_latents, ref_latents_method=)` makes it: x [B, C, H, W] of any size in sampler
        space (C = 16, or 96 for FLUX.1 Fill: latent, masked image and mask as ComfyUI's `c_concat`
        appends them), timestep [B] (sigma), context [B, T, text_dim] (T5-XXL), y [B, pooled_dim] (CLIP
        pooled), guidance [B] (None for schnell), ref_latents (Kontext: ReferenceLatent's latents after
        the latent format's process_in, [B, 16, h, w] each, any size) placed by `ref_method` ('offset',
        the default, 'index' or 'uxo'). Returns the output [B, 16, H, W] on the CPU in the workers'
        compute dtype.

        FLUX.2 (ComfyUI's `Flux2` model) is called alike: x [B, 128, H, W] at 1/16 of the pixels (one
        token per latent pixel), context [B, T, text_dim] (ComfyUI pads it to 512 tokens), no pooled
        vector (`y` is ignored), guidance for [dev], reference latents [B, 128, h, w] placed by 'index'
        unless `ref_method` says otherwise.

        Qwen-Image (ComfyUI's `QwenImage`) takes x [B, 16, 1, H, W] (or [B, 16, H, W]) at 1/8 of the pixels,
        context [B, T, 3584] (Qwen2.5-VL), no pooled vector or guidance, `attention_mask` [B, T] as ComfyUI
        0.33 passes it (1 = a real token, 0 = padding; None: none is padding), reference latents
        [B, 16, 1, h, w] (Qwen-Image-Edit) placed by 'index' unless the checkpoint (Edit-2511:
        'index_timestep_zero') or `ref_method` says otherwise. The output has x's shape.

        Every rank runs it in the resident layout; the conditioning (with the reference latents) is sent
        once and kept on the ranks (found again by content), so a sampler's step moves only x. After a
        failure closed the group, the next call starts it again and re-loads the resident model first.
        """
        with self._lock:
            resident = self.resident
            if resident is None:
                raise ConfigError("no checkpoint is loaded; call load(checkpoint) first")
            call = _checked_call(
                resident, x, timestep, context, y, guidance, ref_latents, ref_method, attention_mask
            )
            family = resident.info.model_family
            refs = sum(family.image_tokens(*r.shape[-2:]) for r in ref_latents or ())
            self._admit(resident, tuple(x.shape), context.shape[1], refs, what="x")
            return self._forwards.call(self._resident_group(resident), *call, timeout=timeout)

    def _admit(
        self,
        resident: LoadRequest,
        shape: tuple[int, ...],
        text_tokens: int,
        refs: int = 0,
        what: str = "latent",
    ) -> None:
        """Refuse a call whose activations cannot fit the devices (admission.py), before any rank runs."""
        admit(
            resident.info, resident.layout, self.devices, self._last_status, shape,
            dtype=str(self.compute_dtype).removeprefix("torch."), text_tokens=text_tokens,
            reference_tokens=refs, what=what,
        )  # fmt: skip


def _text_tokens(positive: Any, info: CheckpointInfo) -> int:
    """The prompt's tokens as the job will send them (the family's padded length when unreadable here:
    check_sample then says what is wrong with the conditioning)."""
    try:
        return max(int(positive[0][0].shape[1]), 1)
    except (TypeError, IndexError, KeyError, AttributeError):
        return info.model_family.text.tokens


def _checked_call(
    resident: LoadRequest,
    x: torch.Tensor,
    timestep: torch.Tensor,
    context: torch.Tensor,
    y: torch.Tensor | None,
    guidance: torch.Tensor | None,
    ref_latents: Sequence[torch.Tensor] | None,
    ref_method: str | None,
    attention_mask: torch.Tensor | None = None,
) -> tuple[Any, ...]:
    """A model call's arguments for `ForwardClient.call`, checked against the resident checkpoint first:
    no rank runs a call that cannot work. The text mask comes back as a boolean key mask, or None when no
    token is padding (the call is then the unmasked one, as in ComfyUI)."""
    refs = list(ref_latents or ())
    info = resident.info
    family = info.model_family
    method = ref_method or family.default_ref_method(info.config)
    if not family.text.pooled:
        # FLUX.2 and Qwen-Image have no pooled vector: an empty one keeps one conditioning record for all
        y = torch.zeros(x.shape[0], 0, dtype=context.dtype if torch.is_tensor(context) else None)
    mask = check_forward(x, timestep, context, y, guidance, resident, refs, method, attention_mask)
    if info.variant != "dev":
        guidance = None  # ComfyUI's Flux ignores it without a guidance embedder (schnell)
    return x, timestep, context, y, guidance, refs, method, mask
