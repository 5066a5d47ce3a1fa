"""The model engine's resident model and its load: `EngineModel`, `load_engine_model`.

A load (worker side, one per rank, every rank alike):

1. import the ComfyUI the request names (comfyui.py), build ComfyUI's own diffusion model for the file on the
   meta device (build.py: ComfyUI's detection, model_config, ops);
2. pick the model's plan (plans/: by ComfyUI's class and detected config) and apply its tensor parallelism
   on the meta model (apply.py, over the layout's tp group);
3. fill each parameter with this rank's slice of the file (load.py), then apply LoRAs with ComfyUI's own
   code on the slices (lora.py);
4. install context parallelism for ring / Ulysses (attention.py, over the layout's ring x ulysses mesh).

A call is ComfyUI's own `diffusion_model.forward(x, timestep, **inputs, transformer_options=...)`, with the
inputs ComfyUI's model wrapper (comfy.model_base) gives it in ComfyUI's process: `EngineModel.forward`.
The rest of the worker treats an EngineModel as any resident model: the forward service splits its batch
(parallel/mesh.py BatchSplit), arms cancel points on its `_repeated_blocks` (the plan's `blocks`), compile
marks the same blocks, status counts its parameters.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ..checkpoint.files import CheckpointError
from ..checkpoint.info import CheckpointInfo
from ..parallel.mesh import GROUPS_ATTR, ParallelGroups
from ..parallel.weights import COMPUTE_DTYPE_ATTR
from ..runtime.redact import quoted
from .apply import apply_tensor_parallel
from .attention import OVERRIDE_KEY, SequenceState, apply_context_parallel, attention_override
from .build import MetaModel, build_meta
from .comfyui import comfy_version, import_comfy
from .load import fill_weights
from .lora import apply_loras
from .plan import ModelPlan
from .plans import plan_for


class EngineModel(nn.Module):
    """ComfyUI's diffusion model for a file, this rank's shard of it, and how a call reaches it.

    `config` is the checkpoint's family config as the caller read it (the forward service reads the output
    channels through the family); `meta` what the build found (ComfyUI's model config, where each parameter
    is stored); `pieces` this rank's slice of each split parameter; `sequence` the context-parallel state."""

    def __init__(
        self,
        meta: MetaModel,
        plan: ModelPlan,
        pieces: Mapping[str, Any],
        config: Mapping[str, Any],
        compute: torch.dtype,
        storage: torch.dtype,
        sequence: SequenceState | None,
    ) -> None:
        super().__init__()
        self.diffusion_model = meta.model
        self.meta, self.plan, self.pieces, self.sequence = meta, plan, dict(pieces), sequence
        self.config = dict(config)
        self.storage = storage
        self._repeated_blocks = tuple(plan.blocks)  # cancel points and compile find the blocks by class name
        self.lora_patched: frozenset[str] = frozenset()
        setattr(self, COMPUTE_DTYPE_ATTR, compute)

    def forward(self, x: torch.Tensor, timestep: torch.Tensor, **inputs: Any) -> torch.Tensor:
        """One model call as ComfyUI's model wrapper makes it: `diffusion_model(x, timestep, **inputs)`;
        an empty sequence (no reference latents) is passed as ComfyUI passes it, None, and a boolean key mask
        (the caller's checks hold a text mask so: diffusion/checks.py `text_key_mask`) as ComfyUI's text
        encoder gives it, 1 per real token and 0 per padding."""
        options: dict[str, Any] = {}
        if self.sequence is not None:
            options[OVERRIDE_KEY] = attention_override(self.sequence)
        given = {k: _as_comfy(v) for k, v in inputs.items()}
        return self.diffusion_model(x, timestep, transformer_options=options, **given)

    def set_loras(
        self, loras: tuple[tuple[str, float], ...], progress: Callable[[int, int], None] | None = None
    ) -> int:
        """The file's weights plus `loras` (ComfyUI's LoRA code on this rank's slices, lora.py); only what the
        previous set or this one patches is touched. Returns the tensors rewritten."""
        previous = self.lora_patched
        self.lora_patched = frozenset()  # until every tensor is set, no set describes the weights
        patched = apply_loras(
            self.diffusion_model,
            self.meta.lora_keys,
            self.meta.sources,
            self.pieces,
            loras,
            previous,
            progress,
        )
        self.lora_patched = patched
        return len(patched | previous)


def _as_comfy(value: Any) -> Any:
    if isinstance(value, tuple | list) and not value:
        return None
    if torch.is_tensor(value) and value.dtype == torch.bool:
        return value.long()
    return value


def storage_dtype(info: CheckpointInfo, weight_dtype: str, compute: torch.dtype) -> torch.dtype:
    """The dtype ComfyUI's model config is built with for its linear weights (its `unet_dtype`): an fp8 dtype
    when any linear weight will be held fp8 (the pack's rule, load.py `held_dtype`: a 'default' file's fp8
    weights, every one for 'fp8_*'), so ComfyUI picks the ops that upcast per layer; else the compute dtype."""
    from ..dtypes import WEIGHT_DTYPES, dtype_named

    if weight_dtype == "compute":
        return compute
    if weight_dtype == "default":
        fp8 = [d for d in (dtype_named(n) for n in info.stored_dtypes) if d is not None and d.fp8]
        return fp8[0].torch if fp8 else compute
    return WEIGHT_DTYPES[weight_dtype].torch


def load_engine_model(
    info: CheckpointInfo,
    *,
    comfyui: str,
    detection: Mapping[str, Any],
    groups: ParallelGroups,
    device: torch.device,
    compute: torch.dtype,
    weight_dtype: str,
    attention: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> EngineModel:
    """This rank's shard of ComfyUI's model for `info`'s file in the layout `groups` realises (see the module
    docstring)."""
    import_comfy(comfyui, device)
    storage = storage_dtype(info, weight_dtype, compute)
    meta = build_meta(info.files[0], storage, compute, detection)
    plan = plan_for(meta.class_name, meta.unet_config)
    if plan is None:
        raise CheckpointError(
            f"{quoted(info.path)}: ComfyUI {comfy_version(comfyui)} builds {meta.class_name} for it, which the "
            "model engine has no plan for; load it with engine='diffusers'"
        )
    pieces = apply_tensor_parallel(meta.model, plan, groups.tp_group)
    fill_weights(meta.model, meta.sources, pieces, weight_dtype, compute, device, progress)
    sequence = apply_context_parallel(
        meta.model, plan, groups.layout, groups.cp_mesh, device, compute, attention
    )
    model = EngineModel(meta, plan, pieces, info.config, compute, storage, sequence)
    setattr(model, GROUPS_ATTR, groups)
    return model.eval()


def detection_of(text: str) -> dict[str, Any]:
    """A load's detection overrides from their JSON text ('' is none)."""
    return dict(json.loads(text)) if text else {}


__all__ = ["EngineModel", "detection_of", "load_engine_model", "storage_dtype"]
