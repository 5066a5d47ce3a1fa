"""Load a text encoder onto a worker, each rank reading only the slices it keeps: `load_encoder`.

As the diffusion models' loader (checkpoint/load.py): the kind's model is built on the meta device, sharded
there by its tensor-parallel plan (parallel/tensor.py), and every parameter is then read from the file with
safetensors' lazy slicing, this rank's rows or columns only. What differs is the dtypes, which follow ComfyUI's
text encoders: the linear weights and the token embeddings stay in the dtype ComfyUI holds them in (the
request's `dtypes`: bf16, fp16, fp8) and are upcast per layer to float32, the compute dtype of every ComfyUI
text encoder; norms and biases (a few MB) are held in float32 after rounding through that dtype, which gives
the same numbers as ComfyUI's cast at each use.

ComfyUI's scaled fp8 encoder files (files.py `scales`): each rank holds its slices of the fp8 weight as stored
and the one per-tensor scale, which every slice shares; the layer forms weight x scale in float32 for each
matmul (parallel/weights.py linear_weight), as ComfyUI's text encoders do: 0.3.75's scaled_fp8_ops cast the
fp8 weight to the float32 input's dtype and multiply by the scale; 0.33's quantized layers dequantize
straight to the input's dtype (`QuantizedTensor.to(float32)`, then `fp8.to(float32) * scale`), not to their
bf16 "original" dtype (checked against ComfyUI's own layers in tests/comfy/test_comfy_scaled_encoders.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint.load import read_scale, read_tensor
from ..dtypes import dtype_named, stored_dtype
from ..parallel.tensor import apply_tensor_parallel, parameter_pieces, resolve_plan
from ..parallel.weights import COMPUTE_DTYPE_ATTR
from .messages import EncoderLoadRequest

COMPUTE = torch.float32  # ComfyUI's text encoders compute in float32 whatever their weights' dtype


def held_dtype(request: EncoderLoadRequest, name: str) -> torch.dtype:
    """The dtype ComfyUI holds parameter `name` in (the request's), else the file's own."""
    named = request.dtypes.get(name)
    found = dtype_named(named) if named is not None else stored_dtype(request.info.tensors[name].dtype)
    if found is None or not (found.compute or found.fp8):
        stored = request.info.tensors[name]
        raise TypeError(
            f"'{stored.file}': tensor '{stored.key}' is {named or stored.dtype}, which the pack cannot hold"
        )
    return found.torch


def scaled_dtype(request: EncoderLoadRequest, name: str) -> torch.dtype:
    """The dtype a scaled weight is held in: the file's own fp8, whatever ComfyUI's dtype for its layer."""
    stored = request.info.tensors[name]
    found = stored_dtype(stored.dtype)
    if found is None or not found.fp8:  # checkpoint/quant.py refuses these in the caller's process
        raise TypeError(f"'{stored.file}': scaled tensor '{stored.key}' is {stored.dtype}, not fp8")
    return found.torch


def _kept(module: nn.Module, param: str) -> bool:
    """Whether a parameter stays in its held dtype (linear weights, token embeddings): the rest is float32."""
    return (param == "weight" and isinstance(module, nn.Linear | nn.Embedding)) or hasattr(
        module, "out_dtype"
    )


def load_encoder(
    request: EncoderLoadRequest,
    device: torch.device,
    group: Any = None,
    progress: Callable[[int, int], None] | None = None,
) -> nn.Module:
    """The request's encoder with this rank's shard over `group` (the world when None) on `device`."""
    info = request.info
    kind = info.encoder
    model = kind.build(info.config, device="meta")
    spec = kind.tp(request.embedding)
    degree = request.layout.tp
    rank = 0
    if degree > 1:
        if not dist.is_initialized() or dist.get_world_size(group) != degree:
            raise RuntimeError(f"a text encoder at tp {degree} needs a process group of {degree} ranks")
        kind.validate_tp(degree, info.config)
        apply_tensor_parallel(model, group, spec, kind.dims(info.config))
        rank = dist.get_rank(group)
    resolved = resolve_plan(model, spec.plan)
    dims = kind.dims(info.config)
    parameters = list(model.named_parameters())
    with torch.no_grad():
        for done, (name, meta) in enumerate(parameters, 1):
            stored = info.tensors[name]
            pieces = parameter_pieces(resolved, name, stored.shape, rank, degree, dims)
            module_name, _, param = name.rpartition(".")
            module = model.get_submodule(module_name)
            scale = info.scales.get(name)
            held = scaled_dtype(request, name) if scale is not None else held_dtype(request, name)
            tensor = read_tensor(stored, pieces, held, device)
            if scale is not None:  # one float32 scale for the whole tensor: every rank's slices share it
                module.register_buffer("scale_weight", read_scale(scale).to(device), persistent=False)
            elif not _kept(module, param):
                tensor = tensor.to(COMPUTE)
            if tensor.shape != meta.shape:  # the plan and the meta model disagree: a bug, not bad input
                raise RuntimeError(
                    f"{name}: read {tuple(tensor.shape)} but the encoder expects {tuple(meta.shape)}"
                )
            setattr(module, param, nn.Parameter(tensor, requires_grad=False))
            if progress is not None:
                progress(done, len(parameters))
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.compute_dtype = COMPUTE  # parallel/weights.py: the dtype the layer's weight is cast to
    setattr(model, COMPUTE_DTYPE_ATTR, COMPUTE)
    return model.eval()


__all__ = ["COMPUTE", "held_dtype", "load_encoder", "scaled_dtype"]
