"""The public Python API: a parallel diffusion model that stays resident between jobs. The nodes use it too.

>>> from rocm_parallel.backend.api import ParallelModel
>>> with ParallelModel(["cuda:0", "cuda:1"]) as model:
...     model.load("models/diffusion_models/flux1-dev.safetensors", layout="tp")
...     out = model.sample(positive, {"samples": latent}, seed=0, steps=20)

Everything a user can get wrong is checked here, in the caller's process, before any worker starts or
any step runs: devices, checkpoint, layout, latent, conditioning, schedule (checks.py, call.py). A step is
one `forward`: one request to every rank (forward_client.py, then serve.py on the workers); `sample` is the
Euler loop (sampling.py) over `forward`, run here. `ParallelFlux` is the name this class had while FLUX
was the only family; scripts that use it keep working.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..checkpoint import CheckpointInfo, inspect_checkpoint, planned_file_weights, planned_weight_dtype
from ..checkpoint.gguf import check_block_splits
from ..config import ParallelLayout
from ..platforms import host_sizes
from ..resident.group import default_devices
from ..runtime.client import ProgressCallback
from .admission import activation_estimate, admit
from .auto import make_layout
from .call import bind, check_call, reference_tokens, text_tokens
from .checks import check_sample
from .group import Checkpoint, DiffusionGroup, LoadOptions
from .messages import LoadRequest
from .sampling import Inputs, SamplingPlan, SamplingRequest

__all__ = [
    "LoadOptions",
    "ParallelFlux",
    "ParallelModel",
    "SamplingRequest",
    "default_devices",
    "make_layout",
]


class ParallelModel(DiffusionGroup):
    """Diffusion transformers spread over several devices, resident in a worker group between jobs
    (`DiffusionGroup`: load, 'auto'; `ResidentGroup`: start, unload, status; one model per slot), and the jobs that run on
    them: `forward`, one model call as ComfyUI's samplers make it, and `sample`, ComfyUI's default sampling
    of the model's family over `forward`.

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
        latent: Mapping[str, Any],
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
        return check_sample(info, positive, latent, SamplingRequest(seed, steps, denoise, sigmas, shift_mu))

    def sample(
        self,
        positive: Any,
        latent: Mapping[str, Any],
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
        slot: str | None = None,
    ) -> dict[str, Any]:
        """ComfyUI's default sampling of the resident model's family, a LATENT dict in and out: FLUX.1's
        `KSampler(euler, simple, cfg 1.0)`, FLUX.2's template (Flux2Scheduler, euler; `shift_mu` does not
        apply), Qwen-Image's (ModelSamplingAuraFlow 3.1). The Euler loop runs here; each step is one
        `forward` on the ranks. `slot`: which resident model (the default one when None).

        `layout` re-shards the resident checkpoint when it differs. `progress(step, total)` runs after
        every step; raising from it stops the loop there (no rank is left mid-step), and so does any
        exception while waiting (Ctrl+C). `timeout` (seconds) bounds the whole job.
        """
        request = SamplingRequest(seed, steps, denoise, sigmas, shift_mu)
        with self._lock:
            resident = self._slot_request(slot)
            info = resident.info
            family = info.model_family
            samples = latent.get("samples") if isinstance(latent, Mapping) else None
            latent_dims = (4, 2 + family.latent.dimensions)  # [B, C, H, W] or [B, C, T, H, W]
            shape = tuple(samples.shape) if torch.is_tensor(samples) and samples.ndim in latent_dims else None
            if shape is None:  # not a latent: check_sample says what is wrong with it
                check_sample(info, positive, latent, request)
            if layout == "auto" and shape is not None:
                frames, height, width = family.planned_size(shape)
                planned = planned_weight_dtype(resident.weight_dtype, info)
                layout = self.auto_layout(
                    info.dims, width, height, shape[0], resident.dtype, weight_dtype=planned, family=info.family,
                    frames=frames, file_weights=planned_file_weights(resident.weight_dtype, info),
                ).layout  # fmt: skip
            if layout is not None:
                wanted = make_layout(layout, len(self.devices), ring, ulysses)
                if wanted != resident.layout:
                    wanted.validate(info.dims, devices=len(self.devices))
                    wanted.check_hosts(host_sizes(self.devices))
                    check_block_splits(info, wanted.tp, devices=len(self.devices))
                    resident = dataclasses.replace(resident, layout=wanted)
            if shape is not None:  # before any allocation for the job (check_sample draws the noise)
                self._admit(resident, shape, _text_tokens(positive, info))
            plan = check_sample(info, positive, latent, request)
            if plan.steps == 0:
                return {**latent, "samples": plan.original}
            group = self._resident_group(resident)

            def checked(x: torch.Tensor, sigma: torch.Tensor, inputs: Inputs) -> Inputs:
                return check_call(info, resident.layout, x, sigma, dict(inputs))  # as `forward` checks

            forwards = self._forwards[resident.slot]
            samples = forwards.sample(group, plan, checked, progress, timeout, self.compute_dtype_of(slot))
            return {**latent, "samples": samples}

    # ------------------------------------------------------------------ the forward service

    @property
    def conditioning_bytes_sent(self) -> int:
        """Conditioning bytes `forward` sent to the ranks since the default slot's model was loaded (each
        prompt once)."""
        forwards = self._forwards.get(self._slot_request(None).slot)
        return forwards.sender.sent_bytes if forwards is not None else 0

    @property
    def compiles(self) -> list[str]:
        """One line per `forward` since the load that compiled the blocks (load(compile=...)): the first call
        and each new input size, with the sizes and the call's time (rank 0's words)."""
        return [line for f in self._forwards.values() for line in f.compiles]

    @property
    def last_forward_seconds(self) -> float:
        """The ranks' own time for the latest `forward` of the default slot: the slowest rank's."""
        forwards = self._forwards.get(self._slot_request(None).slot)
        return forwards.last_seconds if forwards is not None else 0.0

    def forward(
        self,
        x: torch.Tensor,
        timestep: torch.Tensor,
        *args: Any,
        timeout: float | None = None,
        slot: str | None = None,
        **inputs: Any,
    ) -> torch.Tensor:
        """One model call on a resident model, as ComfyUI's sampler makes it on its own diffusion model:
        `diffusion_model(x, timestep, **inputs)`, x of any size in sampler space (the family's latent
        channels, plus any a ComfyUI node concatenates, e.g. FLUX.1 Fill's masked image and mask), timestep
        [B] (sigma), and the family's inputs by ComfyUI's names (its `CallSpec`; positional ones in
        ComfyUI's order for the family):

        - FLUX.1: `context` [B, T, 4096] (T5-XXL), `y` [B, 768] (CLIP-L pooled), `guidance` [B] (None for
          schnell), `ref_latents` (Kontext's, after process_in: [B, 16, h, w] each, any size) placed by
          `ref_latents_method` ('offset', the default, 'index' or 'uxo'; `ref_method` is taken too).
        - FLUX.2: the same without a pooled vector (`y` is ignored), x [B, 128, H, W] at 1/16 of the pixels.
        - Qwen-Image: x [B, 16, 1, H, W] (or [B, 16, H, W]), `context` [B, T, 3584] (Qwen2.5-VL),
          `attention_mask` [B, T] (1 = a real token, 0 = padding; None: none is padding), `ref_latents`
          [B, 16, 1, h, w] (Qwen-Image-Edit) placed by 'index' unless the checkpoint or the call says
          otherwise.

        Returns the output (x's shape, the family's output channels) on the CPU in the workers' compute
        dtype. `slot`: which resident model (the default one when None). Every rank runs it in the slot's
        layout; the prompt's inputs are sent once and kept on the ranks (found again by content), so a
        sampler's step moves only x. After a failure closed the group, the next call starts it again and
        re-loads the resident model first.
        """
        with self._lock:
            resident = self._slot_request(slot)
            info = resident.info
            given = bind(info.model_family.call_spec, args, inputs, info.model_name)
            checked = check_call(info, resident.layout, x, timestep, given)
            refs = reference_tokens(info, checked)
            self._admit(resident, tuple(x.shape), text_tokens(info, checked), refs, what="x")
            group = self._resident_group(resident)
            return self._forwards[resident.slot].call(group, x, timestep, checked, timeout=timeout)

    def _admit(
        self,
        resident: LoadRequest,
        shape: tuple[int, ...],
        text_tokens: int,
        refs: int = 0,
        what: str = "latent",
    ) -> None:
        """Refuse a call whose activations cannot fit the devices (admission.py), before any rank runs; a
        text encoder waiting beside the model is parked in host memory first if that makes it fit
        (parking.py)."""
        dtype = str(self.compute_dtype_of(resident.slot)).removeprefix("torch.")
        need = activation_estimate(
            resident.info, resident.layout, shape, dtype=dtype, text_tokens=text_tokens, reference_tokens=refs
        )
        self.make_headroom(need, exclude=resident.slot)
        admit(
            resident.info, resident.layout, self.devices, self._last_status, shape,
            dtype=dtype, text_tokens=text_tokens, reference_tokens=refs, what=what, estimate=need,
        )  # fmt: skip


# The name of this class while FLUX.1 and FLUX.2 were its only families: users' scripts keep working.
ParallelFlux = ParallelModel


def _text_tokens(positive: Any, info: CheckpointInfo) -> int:
    """The prompt's tokens as the job will send them (the family's padded length when unreadable here:
    check_sample then says what is wrong with the conditioning)."""
    try:
        return max(int(positive[0][0].shape[1]), 1)
    except (TypeError, IndexError, KeyError, AttributeError):
        return info.model_family.text.tokens
