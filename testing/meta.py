"""The one meta-device tracer: one rank of a layout, built and parallelised by the engine, one forward
measured (weights, collectives, peak activations). `bench planner`, `bench tp`, `bench cp` and the planner
tests all use it.

Lives outside the shipped package (the wheel has no `testing/`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..backend.config import ParallelLayout
from ..backend.family import get_family
from ..backend.parallel.comm import CountCollectives
from ..backend.parallel.context import cp_group
from ..backend.parallel.mesh import BatchSplit, groups_of, parallel_groups
from .fake import fake_process_group
from .models import ModelInputs, random_inputs
from .parallel import parallelize


def local_parameter_bytes(model: nn.Module) -> int:
    """Bytes of parameters this rank holds: DTensor shards count their local part, meta tensors their size."""
    from torch.distributed.tensor import DTensor

    return sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in model.parameters()
    )


@contextmanager
def flash_attention_on_meta() -> Iterator[None]:
    """Route diffusers' native SDPA call to the flash kernel (meta has kernels for it, no score matrix)."""
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention

    def flash(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
              is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:  # fmt: skip
        if attn_mask is not None or enable_gqa:
            return original(
                query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
            )
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        return op(query, key, value, dropout_p, is_causal, scale=scale)[0]

    functional.scaled_dot_product_attention = flash
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = original


def _parallelize_like_the_engine(layout: ParallelLayout) -> Callable[[nn.Module], nn.Module]:
    """The layout's mesh and `parallelize`, as a worker's load does (TP on the tp group, CP on the
    ring x ulysses sub-mesh)."""

    def apply(model: nn.Module) -> nn.Module:
        return parallelize(model, parallel_groups(layout, torch.device("meta")))

    return apply


# The forward's inputs that carry the batch (ids only when batched: FLUX.2's [B, S, 4]; FLUX.1's 2-D ids
# are shared by the batch).
_BATCHED = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "guidance")


def _split_forward(model: nn.Module, inputs: ModelInputs) -> torch.Tensor:
    """One forward of `model` on this rank's share of the batch (mesh.BatchSplit, as the worker's forward
    service splits a call), the output gathered over the batch dimension."""
    kwargs = inputs.as_kwargs()
    x = inputs.hidden_states
    split = BatchSplit(groups_of(model), x.shape[0])
    local = {
        k: split.take(v) if v is not None and (k in _BATCHED or (k.endswith("_ids") and v.ndim == 3)) else v
        for k, v in kwargs.items()
    }
    out = model(**local, return_dict=False)[0] if split.runs else None
    entry = (x.shape[1], model.config.out_channels or model.config.in_channels)
    return split.gather(out, entry, x.dtype, x.device)


def measure_on_meta(
    config: dict[str, Any],
    layout: ParallelLayout,
    width: int,
    height: int,
    batch: int = 1,
    text_tokens: int = 512,
    dtype: torch.dtype = torch.bfloat16,
    rank: int = 0,
    *,
    parallelize: Callable[[nn.Module], nn.Module] | None = None,
    memory: bool = True,
    family: str = "flux1",
) -> dict[str, Any]:
    """One rank of `layout` on the meta device, under the `fake` process group: one forward, traced.

    `family` ("flux1", "flux2": backend/family.py) picks the transformer `config` describes; both have one
    image token per 16 x 16 pixels of width x height.

    The model is parallelised by the engine itself (the layout's mesh: `mesh.parallelize`; the forward's
    batch split over the batch dimension as the forward service does), or by `parallelize` (e.g.
    diffusers' own TP plan). Odd token counts work: the context-parallel kernel keeps every key on meta.
    Returns the parameter bytes the rank holds
    (`weights`; and its elements in 2-D parameters, the linear weights an fp8 model keeps at one byte,
    and in the others: `linear_elements`, `other_elements`), the collectives issued (`counts`, `payload` by
    kind, `by_dimension` {(mesh dimension, kind): (count, payload)}, and the whole `log`), the image
    tokens, and with `memory` the peak of live activations from torch's MemTracker (weights excluded;
    attention runs the CPU flash kernel on meta, standing in for the GPUs' flash kernels: without it SDPA
    on meta falls back to the math path and materialises the score matrix, which no GPU path does).
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.set_flush_denormal(True)  # the fake group's all-gathers return uninitialised memory
    fam = get_family(family)
    dims = fam.dims(config)
    with fake_process_group(layout.world_size, rank=rank):
        model = fam.build(config, device="meta", dtype=dtype)
        if layout.world_size > 1:
            (parallelize or _parallelize_like_the_engine(layout))(model)
        groups = groups_of(model)
        names = groups.dimension_names(cp_group(model)) if groups is not None else {}
        weights = local_parameter_bytes(model)
        linear, other = _elements(model)
        inputs = random_inputs(dims, batch, height, width, text_tokens, device="meta", family=fam)
        inputs = inputs.to("meta", dtype)
        if memory:
            for p in model.parameters():
                p.requires_grad_(True)  # MemTracker hooks every parameter's gradient; TP shards have none
            tracker = MemTracker()
            tracker.track_external(model)
            with flash_attention_on_meta(), tracker, CountCollectives(names) as counter, torch.no_grad():
                _split_forward(model, inputs)
            peak = tracker.get_tracker_snapshot("peak")[torch.device("meta")]
            activations = sum(v for k, v in peak.items() if "ACT" in str(k) or "TEMP" in str(k))
        else:
            with CountCollectives(names) as counter, torch.no_grad():
                _split_forward(model, inputs)
            activations = None
    log = counter.log
    return {
        "weights": weights,
        "linear_elements": linear,
        "other_elements": other,
        "activations": activations,
        "counts": dict(log.counts),
        "payload": dict(log.payload_bytes),
        "by_dimension": {key: (n, log.dimension_payload[key]) for key, n in log.dimension_counts.items()},
        "log": log,
        "image_tokens": inputs.hidden_states.shape[1],
    }


def _elements(model: nn.Module) -> tuple[int, int]:
    """(elements of 2-D parameters, elements of the others) this rank holds (DTensor: the local part)."""
    from torch.distributed.tensor import DTensor

    linear = other = 0
    for p in model.parameters():
        n = (p.to_local() if isinstance(p, DTensor) else p).numel()
        if p.dim() == 2:
            linear += n
        else:
            other += n
    return linear, other


__all__ = ["flash_attention_on_meta", "local_parameter_bytes", "measure_on_meta"]
