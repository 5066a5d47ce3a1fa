"""Load a checkpoint's model onto a device, each rank reading only the bytes it keeps: `load_model`.

How: the model is built on the meta device (no weights), sharded there with the family's tensor-parallel
plan, and every parameter is then filled from the file with safetensors' lazy slicing, reading the rows and
columns this rank keeps out of the (possibly fused) stored tensor. Four ranks sharing a 24 GB file
therefore hold 1/4 of it each instead of 24 GB each.

Weight dtype vs compute dtype (`load_model(weight_dtype=...)`, names in dtypes.WEIGHT_DTYPES): the linear
weights either stay fp8 on the device and are upcast per layer at compute time (parallel/weights.py), or
are upcast slice by slice while reading. Everything else is held in the compute dtype. ComfyUI's scaled
fp8 and quantized "mixed" files become the same thing: one scale per weight, applied per layer (fp8
resident) or while reading (upcast).

`read_parameter` is also what the LoRA code (lora.py) re-reads weights with, so "no LoRA" is bit-identical
to a fresh load.

Every tensor read is checked for NaN and inf where it lands (`check_values`): a damaged file is refused
at load, naming the tensor, instead of sampling black images. The check is one min/max pass over memory
the read has just written (on a GPU, device memory): `bench failures` measures it against the read itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from ..diffusion.finite import all_finite, non_finite_kind
from ..dtypes import WEIGHT_DTYPES, stored_dtype
from ..parallel.ggml import byte_shape, is_quantized
from ..parallel.tensor import Pieces, apply_tensor_parallel, parameter_pieces
from ..parallel.weights import hold_quantized, is_fp8, keep_fp8_resident
from ..runtime.redact import quoted
from .files import CheckpointError, StoredTensor, full_shape
from .gguf import check_block_splits, checked_values, read_gguf
from .info import CheckpointInfo, check_weight_dtype, inspect_checkpoint, resolve_dtype

# Attribute of a loaded model: its canonical weight dtype name (LoRA re-reads use the same rule).
WEIGHT_DTYPE_ATTR = "_rp_weight_dtype"
CHECK_VALUES = True  # every tensor read is checked for NaN/inf (switched off only to measure its cost)


def resident_dtype(
    stored: StoredTensor, linear_weight: bool, weight_dtype: str, compute: torch.dtype, fp32: bool = False
) -> torch.dtype:
    """The dtype a parameter is held in: float32 for a parameter of a module the model class keeps in
    float32 (`fp32`: diffusers' `_keep_in_fp32_modules`, e.g. Wan's time embedder and modulation tables;
    never fp8 either: diffusers casts such a module's input to its first parameter's dtype), fp8 for linear
    weights when `weight_dtype` says so (or, for 'default', when the file stores them in fp8), the compute
    dtype for everything else."""
    if fp32 and compute.is_floating_point:
        return torch.float32 if torch.finfo(compute).bits < 32 else compute
    if not linear_weight or weight_dtype == "compute":
        return compute
    if stored.offset is not None:  # GGUF: quantized blocks stay as they are (bytes), the rest computes
        return torch.uint8 if weight_dtype == "default" and is_quantized(stored.dtype) else compute
    if weight_dtype == "default":
        kept = stored_dtype(stored.dtype).torch
        return kept if is_fp8(kept) else compute
    return WEIGHT_DTYPES[weight_dtype].torch


def kept_in_fp32(model: nn.Module, name: str) -> bool:
    """Whether parameter `name` belongs to a module the model's class keeps in float32 whatever the dtype it
    is loaded in (diffusers' `_keep_in_fp32_modules`, matched on whole path components as diffusers'
    loader matches them): the loader honours it as `from_pretrained(torch_dtype=...)` does."""
    keep = getattr(type(model), "_keep_in_fp32_modules", None) or ()
    parts = name.split(".")
    return any(m in parts for m in keep)


def parameter_dtype(model: nn.Module, stored: StoredTensor, name: str, compute: torch.dtype) -> torch.dtype:
    """`resident_dtype` of parameter `name` of a model `load_model` built (its weight dtype is recorded)."""
    module_name, _, param = name.rpartition(".")
    linear = isinstance(model.get_submodule(module_name), nn.Linear) and param == "weight"
    weight = getattr(model, WEIGHT_DTYPE_ATTR, "compute")
    return resident_dtype(stored, linear, weight, compute, kept_in_fp32(model, name))


# --------------------------------------------------------------------------------------------------
# Reading a rank's slices


def compose(rows: tuple[tuple[int, int], ...], wanted: tuple[tuple[int, int], ...]) -> list[tuple[int, int]]:
    """File row ranges of the `wanted` rows of a tensor stored as the concatenation of file `rows`."""
    out = []
    for start, stop in wanted:
        offset = 0
        for a, b in rows:
            lo, hi = max(start, offset), min(stop, offset + b - a)
            if lo < hi:
                out.append((a + lo - offset, a + hi - offset))
            offset += b - a
    return out


def _read(
    stored: StoredTensor,
    rows: tuple[tuple[int, int], ...] | None,
    pieces: Pieces | None,
    dtype: torch.dtype,
    device: torch.device,
    scale: StoredTensor | None = None,
) -> torch.Tensor:
    """Read the `pieces` of the diffusers tensor held in `rows` of `stored` into a new tensor on `device`.

    `scale` (a scaled fp8 weight's scalar): the result is `weight.to(dtype) * scale.to(dtype)`, the
    arithmetic of the per-layer upcast, so upcast-at-load and fp8-resident models compute alike. Converting
    into an fp8 dtype checks the range: values beyond it would saturate or become inf silently.

    safetensors' slices are views of the file's memory map (no copy): each is copied, and upcast, into
    its place in one preallocated tensor, so nothing but the result is ever allocated and the result
    owns its memory. The file is opened per tensor so that the map, whose touched pages count as
    resident memory, never spans more than one tensor's pages.
    """
    file_rows = rows if rows is not None else ((0, stored.shape[0]),)
    cols: tuple[tuple[int, int], ...] | None = None
    if pieces is not None and pieces.dim == 0:
        file_rows = tuple(compose(file_rows, pieces.ranges))
    elif pieces is not None:
        cols = pieces.ranges
    if stored.offset is not None:  # GGUF (gguf.py): no scales; raw blocks checked as their values
        out = read_gguf(stored, file_rows, cols, dtype, device)
        if CHECK_VALUES:
            check_values(stored, checked_values(stored, out))
        return out
    shape = (sum(b - a for a, b in file_rows), *stored.shape[1:])
    if cols is not None:
        shape = (shape[0], sum(d - c for c, d in cols), *shape[2:])
    out = torch.empty(shape, dtype=dtype, device=device)
    check = is_fp8(dtype) and stored_dtype(stored.dtype).torch != dtype

    def put(target: torch.Tensor, piece: torch.Tensor) -> None:
        if check:
            _check_fp8_range(stored, piece, dtype)
        target.copy_(piece)

    with safe_open(stored.file, "pt") as f:
        sl = f.get_slice(stored.key)
        row = 0
        for a, b in file_rows:
            if cols is None:
                put(out[row : row + b - a], sl[a:b])
            else:
                col = 0
                for c, d in cols:
                    put(out[row : row + b - a, col : col + d - c], sl[a:b, c:d])
                    col += d - c
            row += b - a
    if CHECK_VALUES:
        check_values(stored, out)
    if scale is not None:
        out.mul_(read_scale(scale).to(dtype))
    return out


def read_tensor(
    stored: StoredTensor, pieces: Pieces | None, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """This rank's `pieces` of a stored tensor (the whole tensor when None) as `dtype` on `device`, read and
    checked as every parameter of a model is (the text encoders' loader reads files through it)."""
    return _read(stored, None, pieces, dtype, device)


def check_values(stored: StoredTensor, tensor: torch.Tensor) -> None:
    """Refuse a tensor holding NaN or inf, naming it (finite.py: one min/max pass, no mask)."""
    if not all_finite(tensor):
        raise CheckpointError(
            f"{quoted(stored.file)}: tensor '{stored.key}' holds {non_finite_kind(tensor)} values; the file is damaged "
            "(an interrupted download or copy, a failing disk) or was saved from a broken model: download "
            "or copy it again"
        )


def _check_fp8_range(stored: StoredTensor, piece: torch.Tensor, dtype: torch.dtype) -> None:
    if CHECK_VALUES:
        check_values(stored, piece)  # NaN is no value "beyond the range": say what it is
    limit = torch.finfo(dtype).max
    peak = float(piece.float().abs().amax()) if piece.numel() else 0.0
    if not peak <= limit:
        name = str(dtype).removeprefix("torch.").replace("float8", "fp8")
        raise CheckpointError(
            f"{quoted(stored.file)}: tensor '{stored.key}' holds values up to {peak:g}, beyond {name}'s range "
            f"(+-{limit:g}); converting would clip them. Use weight_dtype='fp8_e5m2', 'default' or 'compute'"
        )


def read_scale(scale: StoredTensor) -> torch.Tensor:
    """The float32 scalar of a scaled fp8 weight."""
    with safe_open(scale.file, "pt") as f:
        value = f.get_tensor(scale.key).reshape(()).to(torch.float32)
    if CHECK_VALUES:
        check_values(scale, value)
    return value


def read_parameter(
    info: CheckpointInfo, name: str, pieces: Pieces | None, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """This rank's `pieces` of diffusers parameter `name` as `dtype`: scaled fp8 weights are multiplied
    by their scale unless `dtype` is fp8 (then the raw fp8 values come back; the layer applies the scale)."""
    stored, rows = info.sources[name]
    scale = info.scales.get(stored.key)
    return _read(stored, rows, pieces, dtype, device, None if is_fp8(dtype) else scale)


def load_model(
    path: str | os.PathLike[str] | CheckpointInfo,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    weight_dtype: str | None = None,
    group: Any = None,
    tp: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> nn.Module:
    """Build the checkpoint's model (its family's diffusers class) holding only this rank's weights on `device`.

    `dtype` is the compute dtype; `weight_dtype` how linear weights are held: 'default' (None: the
    file's fp8 weights stay fp8), 'fp8_e4m3fn', 'fp8_e5m2' (converted while reading) or 'compute'
    (upcast at load). fp8 weights are upcast layer by layer (parallel/weights.py), which gives the same
    outputs as upcasting at load bit for bit, at half the resident bytes of bf16.

    tp=1: the whole model (single device, or one full copy per rank for context parallelism).
    tp>1: this rank's tensor-parallel shard over `group` (default: the world, whose size must be tp),
    equal to `apply_tensor_parallel(full model, group)` on this rank.
    `progress(done, total)` runs after each parameter is read (workers report it and stop on cancel).
    """
    info = path if isinstance(path, CheckpointInfo) else inspect_checkpoint(path)
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    weight = check_weight_dtype(weight_dtype, info)
    family = info.model_family
    model = family.build(info.config, device="meta", dtype=dtype)
    resolved = family.tp.resolve(model)
    rank, degree = 0, 1
    if tp > 1:
        if not dist.is_initialized() or dist.get_world_size(group) != tp:
            size = dist.get_world_size(group) if dist.is_initialized() else "no process group"
            raise CheckpointError(f"load_model(tp={tp}) needs a process group of {tp} ranks, got {size}")
        check_block_splits(info, tp, resolved)
        apply_tensor_parallel(model, group, family.tp, family.dims(info.config))
        rank, degree = dist.get_rank(group), tp
    dims = info.dims
    parameters = list(model.named_parameters())
    with torch.no_grad():
        for done, (name, meta) in enumerate(parameters, 1):
            stored, rows = info.sources[name]
            pieces = parameter_pieces(resolved, name, full_shape(stored, rows), rank, degree, dims)
            module_name, _, param = name.rpartition(".")
            module = model.get_submodule(module_name)
            linear = isinstance(module, nn.Linear) and param == "weight"
            target = resident_dtype(stored, linear, weight, dtype, kept_in_fp32(model, name))
            tensor = read_parameter(info, name, pieces, target, device)
            quantized = stored.dtype if target == torch.uint8 else None
            expected = byte_shape(tuple(meta.shape), quantized) if quantized else tuple(meta.shape)
            if tuple(tensor.shape) != expected:  # the plan and the meta model disagree: a bug, not bad input
                raise RuntimeError(f"{name}: read {tuple(tensor.shape)} but the model expects {expected}")
            setattr(module, param, nn.Parameter(tensor, requires_grad=False))
            if quantized:
                hold_quantized(module, quantized, tuple(meta.shape))
            if is_fp8(target) and stored.key in info.scales:
                module.register_buffer("scale_weight", read_scale(info.scales[stored.key]).to(device), False)
            if progress is not None:
                progress(done, len(parameters))
    keep_fp8_resident(model, dtype)
    setattr(model, WEIGHT_DTYPE_ATTR, weight)
    return model.eval()


__all__ = [
    "WEIGHT_DTYPE_ATTR",
    "check_values",
    "compose",
    "full_shape",
    "kept_in_fp32",
    "load_model",
    "parameter_dtype",
    "read_parameter",
    "read_scale",
    "read_tensor",
    "resident_dtype",
]
