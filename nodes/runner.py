"""The plain-Python side of the parallel MODEL (nodes/comfy_model.py wraps it for ComfyUI): which
checkpoint in which layout, made resident before ComfyUI's sampling starts, then one
`ParallelModel.forward` per model call. No ComfyUI here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ..backend.config import ParallelLayout
from ..backend.diffusion.call import LATENT_TOKENS, tensors_of
from ..backend.runtime.watch import interrupt_check
from .inputs import LayoutRequest, ParallelHandle
from .loading import auto_layout, ensure_loaded, read_checkpoint
from .registry import Registry

if TYPE_CHECKING:
    from ..backend.checkpoint import CheckpointInfo
    from ..backend.diffusion.api import ParallelModel


class ModelRunner:
    """The plain-Python side of the parallel MODEL: which checkpoint (and LoRAs) in which layout, made
    resident before ComfyUI's sampling starts, then one `ParallelModel.forward` per model call.

    `comfy_model` wraps it into ComfyUI's MODEL; nothing here imports ComfyUI. `info` is the checkpoint's
    header as the node's run read it (read here when not given), carried to every load. `interrupted()`
    raises on a pending Cancel (checked during loads, before each model call and while the workers compute
    one); `make_room()` frees ComfyUI's own models from the GPUs.
    """

    def __init__(
        self,
        registry: Registry,
        handle: ParallelHandle,
        request: LayoutRequest,
        info: CheckpointInfo | None = None,
        *,
        interrupted: Callable[[], None] | None = None,
        make_room: Callable[[], None] | None = None,
    ) -> None:
        self.registry, self.handle, self.request = registry, handle, request
        self.info = info if info is not None else read_checkpoint(handle)
        self.interrupted, self.make_room = interrupted, make_room
        self.layout: ParallelLayout | None = request.layout
        self._resident: Any = None  # what `prepare` made resident (the backend's record, by identity)
        self.calls = 0

    def comfy_model(self) -> Any:
        """The ComfyUI model config (`backend.family.ComfyModel`) ComfyUI's own loader would pick for the
        checkpoint: the family decides it from the header (e.g. FluxInpaint for FLUX.1 Fill)."""
        return self.info.model_family.comfy_model(self.info.config)

    def compute_dtype(self) -> Any:
        """The workers' compute dtype (ComfyUI casts the model inputs to it, as for its own model)."""
        from ..backend.checkpoint import resolve_dtype

        return resolve_dtype(self.handle.dtype, self.handle.devices[0])

    def prepare(
        self, shape: Sequence[int], references: Sequence[Sequence[int]] = (), call_batch: int | None = None
    ) -> ParallelModel:
        """Make the model resident for a latent of `shape` ([B, C, H, W] or [B, C, T, H, W]; auto layouts are
        planned for it, with the tokens of the reference latents of shapes `references`).
        `call_batch`: the batch of each model call (B, or 2B when ComfyUI sends cond and uncond together;
        `call_batch_of`): what a batch degree splits. A layout whose batch degree exceeds it is run as
        asked, and the panel says that groups idle."""
        if self.make_room is not None:
            self.make_room()
        model = self.registry.group_for(self.handle.devices)
        calls = call_batch if call_batch is not None else shape[0]
        if self.request.layout is None:
            family = self.info.model_family
            frames, height, width = family.planned_size(shape)  # [B, C, H, W] or [B, C, T, H, W]
            extra = sum(family.tokens(ref) for ref in references)
            self.layout = auto_layout(
                self.registry, model, self.handle, self.info, width, height, calls,
                context_only=self.request.context_only, reference_tokens=extra, fixed=self.request.fixed(),
                frames=frames,
            )  # fmt: skip
        else:
            self.registry.update(auto=None)
        self.registry.update(note=idle_note(self.layout, calls))
        ensure_loaded(self.registry, model, self.handle, self.info, self.layout, self.interrupted)
        self._resident = model.residents.get(self.handle.slot)
        return model

    @contextmanager
    def sampling(
        self,
        shape: Sequence[int],
        total: int,
        references: Sequence[Sequence[int]] = (),
        call_batch: int | None = None,
    ) -> Iterator[None]:
        """Around one ComfyUI sampling run: load first, then show 'sampling' (and how it ended)."""
        self.prepare(shape, references, call_batch)
        with self.registry.phase("sampling", step=0, total=total):
            yield

    def forward(
        self, x: Any, timestep: Any, inputs: Mapping[str, Any], step: tuple[int, int] | None = None
    ) -> Any:
        """One transformer forward on every rank: ComfyUI's `diffusion_model(x, timestep, **inputs)` with
        the family's inputs by name; `step` (done, total) is shown on the panel."""
        model = self.registry.group_for(self.handle.devices)
        if self._resident is None or model.residents.get(self.handle.slot) is not self._resident:
            # Called outside ComfyUI's sampling, or another node loaded something else meanwhile.
            refs = [r.shape for item in self.info.model_family.call_spec.inputs if item.tokens == LATENT_TOKENS
                    for r in tensors_of(inputs.get(item.name))]  # fmt: skip
            self.prepare(x.shape, refs)
        if step is not None:
            self.registry.update(step=step[0], total=step[1])
        self.calls += 1
        if self.interrupted is not None:
            self.interrupted()  # a Cancel pressed since the last call: stop before this one
        # ... and one pressed during it: the ranks stop a few blocks in (backend/runtime/cancel_points.py)
        with interrupt_check(self.interrupted):
            return model.forward(x, timestep, slot=self.handle.slot, **inputs)


def idle_note(layout: ParallelLayout | None, call_batch: int) -> str | None:
    """The panel's line when a batch degree exceeds the calls' batch (None otherwise): those groups idle."""
    if layout is None or layout.batch <= call_batch:
        return None
    idle = layout.batch - call_batch
    return (
        f"note: {layout} with {call_batch} entr{'y' if call_batch == 1 else 'ies'} per model call leaves "
        f"{idle} of {layout.batch} batch groups idle (batch_size, or cfg > 1 with a negative prompt, fills them)"
    )


def call_batch_of(
    latent_batch: int, cfg: float, text_lengths: Mapping[str, int | None], padded_to: int = 0
) -> int:
    """The batch of each model call ComfyUI makes for a run: `latent_batch` at cfg 1 (the negative is
    skipped), otherwise latent_batch x the number of conds that go into one call. ComfyUI concatenates
    conds only when their text contexts have the same shape (FLUX wraps them in CONDRegular; the parallel
    MODEL removes the memory limit, nodes/comfy_model.py), after the model pads them to `padded_to`
    tokens (FLUX.2's extra_conds pads to 512). `text_lengths`: cond kind ('positive', 'negative') -> the
    text tokens of its context (None: no entries)."""
    lengths = [max(n, padded_to) for n in text_lengths.values() if n is not None]
    if cfg == 1.0 or len(lengths) < 2:
        return latent_batch
    together = max(lengths.count(n) for n in lengths)
    return latent_batch * together


def step_of(transformer_options: dict[str, Any]) -> tuple[int, int] | None:
    """(step, total) of the current model call from ComfyUI's transformer_options (sigmas of this call
    and of the whole run), for the panel; None when ComfyUI did not say."""
    run, now = transformer_options.get("sample_sigmas"), transformer_options.get("sigmas")
    if run is None or now is None or len(run) < 2 or len(now) < 1:
        return None
    total = len(run) - 1
    sigma = float(now[0])
    for i in range(total):
        if float(run[i]) >= sigma > float(run[i + 1]) or float(run[i]) == sigma:
            return (i + 1, total)
    return (total, total)
