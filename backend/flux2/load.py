"""Load FLUX.2 from the files ComfyUI users have, each rank reading only the bytes it keeps.

Same method as FLUX.1's loader (backend/flux/load.py, whose header reading and slice reading this
reuses): build Flux2Transformer2DModel on the meta device, shard it there with FLUX2_TP_PLAN, then fill
every parameter with the rows/columns this rank keeps, straight out of the (possibly fused) stored
tensor: a rank of TP=4 reads its quarter of `single_blocks.N.linear1` = [q | k | v | gate | up] as five
row ranges. ComfyUI's fp8 "mixed" files are read slice by slice too: fp8 values upcast to the compute
dtype, then multiplied by the tensor's `weight_scale` (one float per tensor, so a slice needs no more).

Formats: BFL / ComfyUI single files (`flux2-dev.safetensors`, `flux2_dev_fp8mixed.safetensors`, with or
without `model.diffusion_model.`), and diffusers folders (`transformer/config.json` with
`_class_name: Flux2Transformer2DModel` and `diffusion_pytorch_model*.safetensors`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from ..config import FluxDims
from ..flux.convert import COMFY_PREFIX, CheckpointError
from ..flux.load import (
    DIFFUSERS_INDEX,
    DIFFUSERS_WEIGHTS,
    STORED_DTYPES,
    StoredTensor,
    _dtype_names,
    _full_shape,
    _listing,
    _missing,
    _numel,
    _read,
    _read_header,
    resolve_dtype,
)
from ..parallel.tensor import FLUX2_TP_PLAN, apply_tensor_parallel, parameter_pieces, resolve_plan
from .convert import QUANT_SUFFIXES, flux2_config_from_bfl, flux2_diffusers_to_bfl, flux2_sources, looks_flux2
from .model import build_flux2

Rows = tuple[tuple[int, int], ...] | None


@dataclass(frozen=True)
class Flux2Checkpoint:
    """What a FLUX.2 checkpoint holds, from its headers alone."""

    path: str
    format: str  # "bfl" or "diffusers"
    config: dict[str, Any]  # diffusers Flux2Transformer2DModel config
    stored_dtypes: tuple[str, ...]
    parameters: int
    stored_bytes: int
    # diffusers parameter -> (stored tensor, rows of it or None, its ComfyUI weight_scale or None)
    sources: dict[str, tuple[StoredTensor, Rows, StoredTensor | None]] = field(repr=False)

    @property
    def dims(self) -> FluxDims:
        return FluxDims.from_diffusers_config(self.config)


def _expected_bfl_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in flux2_diffusers_to_bfl(build_flux2(config, device="meta")).items()}


def _check(path: str, found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> None:
    missing = sorted(set(expected) - set(found))
    if missing:
        raise CheckpointError(
            f"'{path}' lacks {len(missing)} FLUX.2 tensors (e.g. '{missing[0]}'); the file is incomplete. "
            "Download the full checkpoint again"
        )
    unknown = sorted(set(found) - set(expected))
    if unknown:
        raise CheckpointError(
            f"'{path}' has {len(unknown)} tensors FLUX.2 does not (e.g. '{unknown[0]}'); it is a variant "
            "this loader does not know"
        )
    for key, shape in expected.items():
        if found[key] != shape:
            raise CheckpointError(
                f"'{path}': tensor '{key}' has shape {list(found[key])} but this FLUX.2 layout needs "
                f"{list(shape)}"
            )


def _info(
    path: Path, fmt: str, config: dict[str, Any], sources: dict, stored: list[StoredTensor]
) -> Flux2Checkpoint:
    return Flux2Checkpoint(
        path=str(path),
        format=fmt,
        config=config,
        stored_dtypes=_dtype_names([t for t in stored if t.dtype != "U8"], str(path)),
        parameters=sum(_numel(t.shape) for t in stored if t.key.endswith((".weight", ".scale"))),
        stored_bytes=sum(
            _numel(t.shape) * STORED_DTYPES[t.dtype].itemsize for t in stored if t.dtype != "U8"
        ),
        sources=sources,
    )


def _inspect_file(path: Path) -> Flux2Checkpoint:
    header = _read_header(path)
    prefix = COMFY_PREFIX if any(k.startswith(COMFY_PREFIX) for k in header) else ""
    tensors = {k[len(prefix) :]: t for k, t in header.items() if k.startswith(prefix)}
    if not looks_flux2(tensors):
        raise CheckpointError(
            f"'{path}' is not a FLUX.2 checkpoint: it has no '{prefix}single_stream_modulation.lin.weight'. "
            "Pick a FLUX.2 transformer file (flux2-dev.safetensors, flux2_dev_fp8mixed.safetensors, "
            "a [klein] file) from models/diffusion_models"
        )
    weights = {k: t.shape for k, t in tensors.items() if not k.endswith(QUANT_SUFFIXES)}
    config = flux2_config_from_bfl(weights)
    _check(str(path), weights, _expected_bfl_shapes(config))
    sources = {}
    for name, s in flux2_sources(FluxDims.from_diffusers_config(config)).items():
        scale = (
            tensors.get(s.key.removesuffix(".weight") + ".weight_scale")
            if s.key.endswith(".weight")
            else None
        )
        if scale is not None and _numel(scale.shape) != 1:
            raise CheckpointError(
                f"'{path}': '{scale.key}' has shape {list(scale.shape)}; only one scale per tensor "
                "(ComfyUI's fp8 'mixed' files) is supported"
            )
        sources[name] = (tensors[s.key], s.rows, scale)
    return _info(path, "bfl", config, sources, list(tensors.values()))


def _inspect_folder(path: Path) -> Flux2Checkpoint:
    folder = path / "transformer" if (path / "transformer").is_dir() else path
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise CheckpointError(
            f"'{folder}' is a folder without config.json, so not a diffusers model; it has: {_listing(folder)}. "
            "Pass a FLUX.2 .safetensors file, or a diffusers FLUX.2 folder (or its transformer/ folder)"
        )
    raw = json.loads(config_file.read_text())
    if raw.get("_class_name") != "Flux2Transformer2DModel":
        raise CheckpointError(
            f"'{config_file}' describes a {raw.get('_class_name')}, not a Flux2Transformer2DModel; pass a "
            "FLUX.2 pipeline folder or its transformer/ folder"
        )
    config = {k: v for k, v in raw.items() if not k.startswith("_")}
    config["axes_dims_rope"] = tuple(config.get("axes_dims_rope", (32, 32, 32, 32)))
    if (folder / DIFFUSERS_INDEX).is_file():
        shards = sorted(set(json.loads((folder / DIFFUSERS_INDEX).read_text())["weight_map"].values()))
    elif (folder / DIFFUSERS_WEIGHTS).is_file():
        shards = [DIFFUSERS_WEIGHTS]
    else:
        raise CheckpointError(
            f"'{folder}' has neither {DIFFUSERS_WEIGHTS} nor {DIFFUSERS_INDEX}; it has: {_listing(folder)}"
        )
    tensors: dict[str, StoredTensor] = {}
    for shard in shards:
        if not (folder / shard).is_file():
            raise CheckpointError(f"'{folder}' lacks the shard '{shard}' its index names; download it")
        tensors.update(_read_header(folder / shard))
    expected = {k: tuple(v.shape) for k, v in build_flux2(config, device="meta").state_dict().items()}
    _check(str(folder), {k: t.shape for k, t in tensors.items()}, expected)
    return _info(
        folder, "diffusers", config, {k: (t, None, None) for k, t in tensors.items()}, list(tensors.values())
    )


def inspect_flux2_checkpoint(path: str | os.PathLike[str]) -> Flux2Checkpoint:
    """Format, config and stored dtypes of a FLUX.2 checkpoint from headers only (CheckpointError otherwise)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise _missing(path)
    return _inspect_folder(path) if path.is_dir() else _inspect_file(path)


def load_flux2(
    path: str | os.PathLike[str] | Flux2Checkpoint,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    group: Any = None,
    tp: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> nn.Module:
    """Flux2Transformer2DModel holding only this rank's weights (tp > 1: its TP shard over `group`)."""
    info = path if isinstance(path, Flux2Checkpoint) else inspect_flux2_checkpoint(path)
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    model = build_flux2(info.config, device="meta", dtype=dtype)
    resolved = resolve_plan(model, FLUX2_TP_PLAN)
    rank, degree = 0, 1
    if tp > 1:
        if not dist.is_initialized() or dist.get_world_size(group) != tp:
            size = dist.get_world_size(group) if dist.is_initialized() else "no process group"
            raise CheckpointError(f"load_flux2(tp={tp}) needs a process group of {tp} ranks, got {size}")
        apply_tensor_parallel(model, group)
        rank, degree = dist.get_rank(group), tp
    dims = info.dims
    parameters = list(model.named_parameters())
    with torch.no_grad():
        for done, (name, meta) in enumerate(parameters, 1):
            stored, rows, scale = info.sources[name]
            pieces = parameter_pieces(resolved, name, _full_shape(stored, rows), rank, degree, dims)
            tensor = _read(stored, rows, pieces, dtype, device)
            if scale is not None:
                with safe_open(scale.file, "pt") as f:
                    tensor.mul_(f.get_tensor(scale.key).to(device=device, dtype=dtype))
            if tensor.shape != meta.shape:
                raise RuntimeError(
                    f"{name}: read {tuple(tensor.shape)} but the model expects {tuple(meta.shape)}"
                )
            module_name, _, param = name.rpartition(".")
            setattr(model.get_submodule(module_name), param, nn.Parameter(tensor, requires_grad=False))
            if progress is not None:
                progress(done, len(parameters))
    return model.eval()


__all__ = ["Flux2Checkpoint", "inspect_flux2_checkpoint", "load_flux2"]
