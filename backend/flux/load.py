"""Load a FLUX checkpoint from ComfyUI's model folders, each rank reading only the bytes it keeps.

Formats: a BFL / ComfyUI single safetensors file (`flux1-dev.safetensors`, fine-tunes; with or without
the `model.diffusion_model.` prefix of ComfyUI's full checkpoints), a diffusers-keyed single file, and
diffusers folders (`config.json` + `diffusion_pytorch_model*.safetensors`, or a pipeline folder with
`transformer/`). Stored dtypes bf16, fp16, fp32, fp8 e4m3fn / e5m2, upcast slice by slice.

How: the model is built on the meta device (no weights), sharded there with the tensor-parallel plan,
and every parameter is then filled from the file with safetensors' lazy slicing, reading the rows and
columns this rank keeps out of the (possibly fused) stored tensor. Four ranks sharing a 24 GB file
therefore hold 1/4 of it each instead of 24 GB each.

`inspect_checkpoint` reads headers only: the client calls it to reject a bad path before any worker
starts. `load_flux` is what a worker calls.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from torch import nn

from ..config import COMPUTE_DTYPE_BYTES, DTYPE_ALIASES, FluxDims
from ..family import (
    FAMILY_ATTRIBUTE,
    ModelFamily,
    detect_bfl,
    detect_diffusers,
    families,
    family_for_class,
    get_family,
)
from ..parallel.tensor import Pieces, parameter_pieces, resolve_plan
from .convert import COMFY_PREFIX, CheckpointError

# safetensors dtype names this loader reads -> torch dtype (fp8 is upcast to the compute dtype).
STORED_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
COMPUTE_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, DTYPE_ALIASES.get(name, name)) for name in [*COMPUTE_DTYPE_BYTES, *DTYPE_ALIASES]
}
DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"
DIFFUSERS_INDEX = "diffusion_pytorch_model.safetensors.index.json"
# diffusers' config.json entries that are bookkeeping, not FluxTransformer2DModel arguments.
_CONFIG_META = ("_class_name", "_diffusers_version", "_name_or_path", "_use_default_values")


@dataclass(frozen=True)
class StoredTensor:
    """One tensor in a safetensors file."""

    file: str
    key: str
    shape: tuple[int, ...]
    dtype: str  # safetensors' name, e.g. "BF16", "F8_E4M3"


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint holds, from its headers alone."""

    path: str  # what the user gave
    format: str  # "bfl" (BFL / ComfyUI keys) or "diffusers" (FluxTransformer2DModel keys)
    files: tuple[str, ...]  # the safetensors files holding the transformer
    prefix: str  # key prefix of the transformer inside the files ("" or "model.diffusion_model.")
    stored_dtypes: tuple[str, ...]  # torch names, e.g. ("bfloat16",) or ("float8_e4m3fn", "bfloat16")
    config: dict[str, Any]  # diffusers config of the family's class (FluxTransformer2DModel for FLUX.1)
    variant: str  # "dev" (guidance embedding) or "schnell" (none): the family's `variant(config)`
    parameters: int
    stored_bytes: int
    # diffusers parameter name -> where its values are stored (rows of a fused BFL tensor when set)
    sources: dict[str, tuple[StoredTensor, tuple[tuple[int, int], ...] | None]] = field(repr=False)
    family: str = "flux1"  # the registered model family (backend/family.py) the header matched

    @property
    def dims(self) -> FluxDims:
        return FluxDims.from_diffusers_config(self.config)

    @property
    def model_family(self) -> ModelFamily:
        return get_family(self.family)

    @property
    def model_name(self) -> str:
        """What the header says the model is, e.g. 'FLUX.1-dev' or 'FLUX.1 Fill'."""
        return self.model_family.describe(self.config)

    @property
    def input_channels(self) -> int:
        """Channels of `x` in a model call: the latent's, plus the extras ComfyUI concatenates (Fill)."""
        return self.model_family.input_channels(self.config)


# --------------------------------------------------------------------------------------------------
# Finding the files


def _listing(folder: Path, limit: int = 12) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    if not names:
        return "nothing (it is empty)"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _missing(path: Path) -> CheckpointError:
    parent = path.parent
    if parent.is_dir():
        return CheckpointError(
            f"checkpoint '{path}' does not exist; '{parent}' has: {_listing(parent)}. "
            "Pick one of those, or put the FLUX file into that folder"
        )
    return CheckpointError(
        f"checkpoint '{path}' does not exist, nor does its folder '{parent}'; check the path"
    )


def _starts_like_safetensors(head: bytes, size: int) -> bool:
    """8-byte little-endian header length that fits the file, then the header's JSON '{'.

    The length's first byte can be anything (0x80 for a 8320-byte header), so a pickle's 0x80 magic
    alone proves nothing: only a file that is not shaped like safetensors is judged by its magic.
    """
    return len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") <= size - 8


def _check_file_kind(path: Path) -> None:
    """Recognize the formats people mistake for safetensors by their first bytes."""
    with open(path, "rb") as f:
        head = f.read(9)
    if _starts_like_safetensors(head, path.stat().st_size):
        return
    if head[:4] == b"GGUF" or path.suffix.lower() == ".gguf":
        raise CheckpointError(
            f"'{path}' is a GGUF file; this loader reads safetensors. Use a .safetensors FLUX checkpoint "
            "(bf16, fp16 or fp8), or load GGUF in ComfyUI with ComfyUI-GGUF's 'Unet Loader (GGUF)'"
        )
    if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":
        raise CheckpointError(
            f"'{path}' is a PyTorch pickle (torch.save / .ckpt / .bin), not safetensors; convert it with "
            "safetensors.torch.save_file(torch.load(path, weights_only=True), 'model.safetensors')"
        )


def _truncation_detail(path: Path) -> str:
    """How many bytes the header promises against what is on disk, when the header itself is readable."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                return f"its header length field says {n} bytes but the file has only {size}"
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        return f"its header promises {8 + n + end} bytes but the file has {size}"
    except (ValueError, KeyError, TypeError, struct.error):
        return f"its {size} bytes do not start with a safetensors header"


def _read_header(path: Path) -> dict[str, StoredTensor]:
    _check_file_kind(path)
    try:
        with safe_open(str(path), "pt") as f:
            out = {}
            for key in f.keys():
                s = f.get_slice(key)
                out[key] = StoredTensor(str(path), key, tuple(s.get_shape()), s.get_dtype())
            return out
    except SafetensorError as err:
        raise CheckpointError(
            f"'{path}' is truncated or corrupt: {_truncation_detail(path)}. Download or copy it again"
        ) from err


# --------------------------------------------------------------------------------------------------
# Recognizing what a set of keys is


def describe_keys(keys: Iterable[str]) -> str:
    """A short guess at what a non-FLUX checkpoint is, from its key prefixes."""
    keys = list(keys)
    stripped = [k.removeprefix(COMFY_PREFIX) for k in keys]

    def has(*fragments: str) -> bool:
        return any(any(k.startswith(f) or f".{f}" in k for f in fragments) for k in stripped)

    if has("lora_unet_", "lora_te") or any(".lora_" in k or ".lora." in k for k in keys):
        return "a LoRA (apply it in ComfyUI on top of a base FLUX model)"
    if has("input_blocks.", "middle_block."):
        kind = "an SDXL UNet" if has("label_emb.") else "an SD1.x/SD2.x UNet"
        return kind
    if has("joint_blocks."):
        return "an SD3 / SD3.5 MMDiT"
    if has("distilled_guidance_layer."):
        return "a Chroma model (FLUX-derived, different modulation)"
    if has("encoder.block.", "shared.weight"):
        return "a T5 text encoder"
    if has("text_model.encoder."):
        return "a CLIP text encoder"
    if has("decoder.conv_in.", "encoder.conv_in.", "first_stage_model."):
        return "a VAE"
    sample = ", ".join(sorted(keys)[:4])
    return f"not a FLUX.1 transformer (first keys: {sample})"


def _check_not_scaled_fp8(path: str, keys: Iterable[str]) -> None:
    scaled = [k for k in keys if k.endswith(".scale_weight") or k == "scaled_fp8"]
    if scaled:
        raise CheckpointError(
            f"'{path}' is a ComfyUI 'scaled fp8' checkpoint ({len(scaled)} scale tensors such as "
            f"'{scaled[0]}'); those are not supported yet. Use a plain fp8_e4m3fn, fp16 or bf16 FLUX file"
        )


# --------------------------------------------------------------------------------------------------
# inspect_checkpoint


def _check_shapes(
    path: str, found: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]]
) -> None:
    missing = sorted(set(expected) - set(found))
    if missing:
        raise CheckpointError(
            f"'{path}' lacks {len(missing)} FLUX tensors (e.g. '{missing[0]}'); the file is incomplete "
            "or a different model. Download the full checkpoint again"
        )
    unknown = sorted(set(found) - set(expected))
    if unknown:
        raise CheckpointError(
            f"'{path}' has {len(unknown)} tensors FLUX.1 does not (e.g. '{unknown[0]}'); "
            "it is a FLUX variant this loader does not know"
        )
    for key, shape in expected.items():
        if found[key] != shape:
            raise CheckpointError(
                f"'{path}': tensor '{key}' has shape {list(found[key])} but this FLUX layout needs "
                f"{list(shape)}; the checkpoint is not a FLUX.1 transformer"
            )


def _dtype_names(tensors: Iterable[StoredTensor], path: str) -> tuple[str, ...]:
    names = {}
    for t in tensors:
        if t.dtype not in STORED_DTYPES:
            raise CheckpointError(
                f"'{path}': tensor '{t.key}' is stored as {t.dtype}; supported stored dtypes are "
                f"{', '.join(STORED_DTYPES)}. Use a bf16, fp16, fp32 or fp8 safetensors checkpoint"
            )
        names[str(STORED_DTYPES[t.dtype]).removeprefix("torch.")] = None
    return tuple(sorted(names))


def _bfl_info(path: Path, header: dict[str, StoredTensor], family: ModelFamily) -> CheckpointInfo:
    prefix = COMFY_PREFIX if any(k.startswith(COMFY_PREFIX) for k in header) else ""
    tensors = {k[len(prefix) :]: t for k, t in header.items() if k.startswith(prefix)}
    shapes = {k: t.shape for k, t in tensors.items()}
    config = family.config_from_bfl(shapes)
    if config["attention_head_dim"] % 8:
        raise CheckpointError(
            f"'{path}': head width {config['attention_head_dim']} is not a multiple of 8; "
            "not a FLUX.1 transformer"
        )
    _check_shapes(str(path), shapes, family.bfl_shapes(config))
    sources = {name: (tensors[s.key], s.rows) for name, s in family.bfl_sources(config).items()}
    return _info(path, "bfl", (str(path),), prefix, config, sources, tensors.values(), family)


def _diffusers_shapes(family: ModelFamily, config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    model = family.build(dict(config), device="meta")
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _diffusers_info(
    path: Path,
    files: tuple[str, ...],
    tensors: dict[str, StoredTensor],
    config: dict[str, Any] | None,
    family: ModelFamily,
) -> CheckpointInfo:
    shapes = {k: t.shape for k, t in tensors.items()}
    if config is None:  # a diffusers-keyed single file: the family derives the config from its shapes
        try:
            config = family.config_from_diffusers(shapes)
        except ValueError as err:
            raise CheckpointError(
                f"'{path}' has diffusers keys but is not a FLUX transformer: {err}"
            ) from None
    _check_shapes(str(path), shapes, _diffusers_shapes(family, config))
    sources = {k: (t, None) for k, t in tensors.items()}
    return _info(path, "diffusers", files, "", config, sources, tensors.values(), family)


def _info(
    path: Path,
    fmt: str,
    files: tuple[str, ...],
    prefix: str,
    config: dict[str, Any],
    sources: dict[str, tuple[StoredTensor, tuple[tuple[int, int], ...] | None]],
    stored: Iterable[StoredTensor],
    family: ModelFamily,
) -> CheckpointInfo:
    tensors = list(stored)
    return CheckpointInfo(
        path=str(path),
        format=fmt,
        files=files,
        prefix=prefix,
        stored_dtypes=_dtype_names(tensors, str(path)),
        config=config,
        variant=family.variant(config),
        parameters=sum(_numel(t.shape) for t in tensors),
        stored_bytes=sum(_numel(t.shape) * STORED_DTYPES[t.dtype].itemsize for t in tensors),
        sources=sources,
        family=family.name,
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _inspect_file(path: Path) -> CheckpointInfo:
    header = _read_header(path)
    keys = list(header)
    _check_not_scaled_fp8(str(path), keys)
    prefix = COMFY_PREFIX if any(k.startswith(COMFY_PREFIX) for k in keys) else ""
    stripped = {k.removeprefix(prefix) for k in keys if k.startswith(prefix)}
    family = detect_bfl(stripped)
    if family is not None:
        return _bfl_info(path, header, family)
    family = detect_diffusers(set(keys))
    if family is not None:
        return _diffusers_info(path, (str(path),), header, None, family)
    raise CheckpointError(
        f"'{path}' is not a FLUX.1 checkpoint: it looks like {describe_keys(keys)}. "
        "Pick a FLUX.1 transformer file (e.g. flux1-dev.safetensors) from models/diffusion_models"
    )


def _inspect_folder(path: Path) -> CheckpointInfo:
    folder = path / "transformer" if (path / "transformer").is_dir() else path
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise CheckpointError(
            f"'{folder}' is a folder without config.json, so not a diffusers model; it has: "
            f"{_listing(folder)}. Pass a .safetensors file, or a diffusers FLUX folder (or its transformer/ "
            "folder)"
        )
    raw = json.loads(config_file.read_text())
    cls = raw.get("_class_name")
    family = family_for_class(cls)
    if family is None:
        known = " or ".join(f.diffusers_class for f in families())
        raise CheckpointError(
            f"'{config_file}' describes a {cls}, not a {known}; pass a FLUX pipeline folder "
            "or its transformer/ folder"
        )
    config = {k: v for k, v in raw.items() if k not in _CONFIG_META}
    if "axes_dims_rope" in config:
        config["axes_dims_rope"] = tuple(config["axes_dims_rope"])
    if (folder / DIFFUSERS_INDEX).is_file():
        weight_map: dict[str, str] = json.loads((folder / DIFFUSERS_INDEX).read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    elif (folder / DIFFUSERS_WEIGHTS).is_file():
        shards = [DIFFUSERS_WEIGHTS]
    else:
        raise CheckpointError(
            f"'{folder}' has neither {DIFFUSERS_WEIGHTS} nor {DIFFUSERS_INDEX}; it has: {_listing(folder)}. "
            "Only safetensors weights are read; re-save the model with "
            "save_pretrained(safe_serialization=True)"
        )
    tensors: dict[str, StoredTensor] = {}
    for shard in shards:
        if not (folder / shard).is_file():
            raise CheckpointError(
                f"'{folder / DIFFUSERS_INDEX}' names the shard '{shard}', which is missing; "
                f"'{folder}' has: {_listing(folder)}. Download the missing shard"
            )
        tensors.update(_read_header(folder / shard))
    return _diffusers_info(folder, tuple(str(folder / s) for s in shards), tensors, config, family)


def inspect_checkpoint(path: str | os.PathLike[str]) -> CheckpointInfo:
    """Format, stored dtypes, diffusers config and variant of a FLUX checkpoint, from its headers only.

    Raises CheckpointError (a ConfigError) with the path, what was found and the fix.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise _missing(path)
    return _inspect_folder(path) if path.is_dir() else _inspect_file(path)


# --------------------------------------------------------------------------------------------------
# Compute dtype


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPUs (fp16 where the GPU has no bf16), fp32 on CPU, where bf16 matmuls are slow."""
    if device.type == "cpu":
        return torch.float32
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    """The compute dtype for `device`: `dtype` by name or torch dtype, or the device's default."""
    device = torch.device(device)
    if dtype is None:
        return default_dtype(device)
    if isinstance(dtype, str):
        if dtype not in COMPUTE_DTYPES:
            raise CheckpointError(
                f"dtype='{dtype}' is not a compute dtype; use bfloat16, float16 or float32 "
                "(fp8 checkpoints are upcast to one of those)"
            )
        dtype = COMPUTE_DTYPES[dtype]
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise CheckpointError(
            f"dtype={dtype} is not a compute dtype; use bfloat16, float16 or float32 "
            "(fp8 checkpoints are upcast to one of those)"
        )
    if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise CheckpointError(f"device {device} does not support bfloat16; use dtype='float16' or 'float32'")
    return dtype


# --------------------------------------------------------------------------------------------------
# Reading a rank's slices


def _compose(rows: tuple[tuple[int, int], ...], wanted: tuple[tuple[int, int], ...]) -> list[tuple[int, int]]:
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
) -> torch.Tensor:
    """Read the `pieces` of the diffusers tensor held in `rows` of `stored` into a new tensor on `device`.

    safetensors' slices are views of the file's memory map (no copy): each is copied, and upcast, into
    its place in one preallocated tensor, so nothing but the result is ever allocated and the result
    owns its memory. The file is opened per tensor so that the map, whose touched pages count as
    resident memory, never spans more than one tensor's pages.
    """
    file_rows = rows if rows is not None else ((0, stored.shape[0]),)
    cols: tuple[tuple[int, int], ...] | None = None
    if pieces is not None and pieces.dim == 0:
        file_rows = tuple(_compose(file_rows, pieces.ranges))
    elif pieces is not None:
        cols = pieces.ranges
    shape = (sum(b - a for a, b in file_rows), *stored.shape[1:])
    if cols is not None:
        shape = (shape[0], sum(d - c for c, d in cols), *shape[2:])
    out = torch.empty(shape, dtype=dtype, device=device)
    with safe_open(stored.file, "pt") as f:
        sl = f.get_slice(stored.key)
        row = 0
        for a, b in file_rows:
            if cols is None:
                out[row : row + b - a].copy_(sl[a:b])
            else:
                col = 0
                for c, d in cols:
                    out[row : row + b - a, col : col + d - c].copy_(sl[a:b, c:d])
                    col += d - c
            row += b - a
    return out


def _full_shape(stored: StoredTensor, rows: tuple[tuple[int, int], ...] | None) -> tuple[int, ...]:
    if rows is None:
        return stored.shape
    return (sum(b - a for a, b in rows), *stored.shape[1:])


def load_flux(
    path: str | os.PathLike[str] | CheckpointInfo,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    group: Any = None,
    tp: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> nn.Module:
    """Build FluxTransformer2DModel from a checkpoint holding only this rank's weights on `device`.

    tp=1: the whole model (single device, or one full copy per rank for context parallelism).
    tp>1: this rank's tensor-parallel shard over `group` (default: the world, whose size must be tp),
    equal to `apply_tensor_parallel(full model, group)` on this rank.
    `progress(done, total)` runs after each parameter is read (workers report it and stop on cancel).
    """
    info = path if isinstance(path, CheckpointInfo) else inspect_checkpoint(path)
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    family = info.model_family
    model = family.build(info.config, device="meta", dtype=dtype)
    resolved = resolve_plan(model, family.tp_plan)
    rank, degree = 0, 1
    if tp > 1:
        if not dist.is_initialized() or dist.get_world_size(group) != tp:
            size = dist.get_world_size(group) if dist.is_initialized() else "no process group"
            raise CheckpointError(f"load_flux(tp={tp}) needs a process group of {tp} ranks, got {size}")
        family.apply_tp(model, group)
        rank, degree = dist.get_rank(group), tp
    dims = info.dims
    parameters = list(model.named_parameters())
    with torch.no_grad():
        for done, (name, meta) in enumerate(parameters, 1):
            stored, rows = info.sources[name]
            pieces = parameter_pieces(resolved, name, _full_shape(stored, rows), rank, degree, dims)
            tensor = _read(stored, rows, pieces, dtype, device)
            if tensor.shape != meta.shape:  # the plan and the meta model disagree: a bug, not bad input
                raise RuntimeError(
                    f"{name}: read {tuple(tensor.shape)} but the model expects {tuple(meta.shape)}"
                )
            module_name, _, param = name.rpartition(".")
            setattr(model.get_submodule(module_name), param, nn.Parameter(tensor, requires_grad=False))
            if progress is not None:
                progress(done, len(parameters))
    setattr(model, FAMILY_ATTRIBUTE, family.name)
    return model.eval()


__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "StoredTensor",
    "default_dtype",
    "describe_keys",
    "inspect_checkpoint",
    "load_flux",
    "resolve_dtype",
]
