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
from ..backend.parallel.context import apply_context_parallel
from ..backend.parallel.tensor import apply_tensor_parallel
from .fake import fake_process_group
from .models import random_inputs


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
    def apply(model: nn.Module) -> nn.Module:
        if layout.tp > 1:
            apply_tensor_parallel(model)
        if layout.ring * layout.ulysses > 1:
            apply_context_parallel(model, layout.ring, layout.ulysses)
        return model

    return apply


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

    The model is parallelised by the engine itself (`apply_tensor_parallel` / `apply_context_parallel`),
    or by `parallelize` (e.g. diffusers' own TP plan). Returns the parameter bytes the rank holds
    (`weights`; and its elements in 2-D parameters, the linear weights an fp8 model keeps at one byte,
    and in the others: `linear_elements`, `other_elements`), the collectives issued (`counts`, `payload` by kind, and the whole `log`), the image
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
        weights = local_parameter_bytes(model)
        linear, other = _elements(model)
        inputs = random_inputs(dims, batch, height, width, text_tokens, device="meta", family=fam)
        inputs = inputs.to("meta", dtype)
        if memory:
            for p in model.parameters():
                p.requires_grad_(True)  # MemTracker hooks every parameter's gradient; TP shards have none
            tracker = MemTracker()
            tracker.track_external(model)
            with flash_attention_on_meta(), tracker, CountCollectives() as counter, torch.no_grad():
                model(**inputs.as_kwargs(), return_dict=False)
            peak = tracker.get_tracker_snapshot("peak")[torch.device("meta")]
            activations = sum(v for k, v in peak.items() if "ACT" in str(k) or "TEMP" in str(k))
        else:
            with CountCollectives() as counter, torch.no_grad():
                model(**inputs.as_kwargs(), return_dict=False)
            activations = None
    return {
        "weights": weights,
        "linear_elements": linear,
        "other_elements": other,
        "activations": activations,
        "counts": dict(counter.log.counts),
        "payload": dict(counter.log.payload_bytes),
        "log": counter.log,
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
