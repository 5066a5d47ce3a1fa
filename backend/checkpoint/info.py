"""What a checkpoint holds, from its headers alone: `inspect_checkpoint` -> `CheckpointInfo`.

Formats: a BFL / ComfyUI single safetensors file (`flux1-dev.safetensors`, fine-tunes, ComfyUI's ModelSave
output) in every key spelling ComfyUI's UNETLoader loads (the prefixes it strips, the norms' `.scale` and
`.weight` names: resolved once here, keys.py), a diffusers-keyed single file, and
diffusers folders (`config.json` + `diffusion_pytorch_model*.safetensors`, or a pipeline folder with
`transformer/`), and GGUF files (ComfyUI-GGUF's, gguf.py), of every registered model family
(backend/family.py: the header says which). Stored dtypes: dtypes.LOADABLE_DTYPES, ComfyUI's "scaled fp8"
and quantized "mixed" files included (quant.py), GGUF's block types (`quantization == "gguf"`).

The caller's process runs this to reject a bad path before any worker starts; the info then travels with
the load request. The dtype rules every load follows are here too: the compute dtype (`resolve_dtype`)
and how linear weights are held (`check_weight_dtype`, and `planned_weight_dtype` for the planner).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config import ModelDims, weight_dtype_name
from ..dtypes import COMPUTE_DTYPES, LOADABLE_DTYPES, WEIGHT_DTYPES, compute_dtype_named, stored_dtype
from ..family import ModelFamily, detect_bfl, detect_diffusers, families, family_for_class, get_family
from ..parallel.ggml import is_quantized
from ..runtime.redact import quoted
from .files import (
    CHECKPOINT_FIX,
    CheckpointError,
    StoredTensor,
    listing,
    missing_checkpoint,
    numel,
    refuse_special,
)
from .foreign import refuse_foreign_quantization
from .gguf import tensor_bytes, torch_name
from .headers import read_header
from .keys import transformer_prefix
from .quant import split_scales

DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"
DIFFUSERS_INDEX = "diffusion_pytorch_model.safetensors.index.json"
# diffusers' config.json entries that are bookkeeping, not arguments of the model class.
_CONFIG_META = ("_class_name", "_diffusers_version", "_name_or_path", "_use_default_values")


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint holds, from its headers alone."""

    path: str  # what the user gave
    format: str  # "bfl" (BFL / ComfyUI keys) or "diffusers" (the family's diffusers class's keys)
    files: tuple[str, ...]  # the safetensors files holding the transformer
    prefix: str  # the transformer's key prefix in the files, as ComfyUI strips it ("", "model.diffusion_model.", ...)
    stored_dtypes: tuple[str, ...]  # torch names, e.g. ("bfloat16",) or ("float8_e4m3fn", "bfloat16")
    config: dict[str, Any]  # diffusers config of the family's class (FluxTransformer2DModel for FLUX.1)
    variant: str  # "dev" (guidance embedding) or "schnell" (none): the family's `variant(config)`
    parameters: int
    stored_bytes: int
    # diffusers parameter name -> where its values are stored (rows of a fused BFL tensor when set)
    sources: dict[str, tuple[StoredTensor, tuple[tuple[int, int], ...] | None]] = field(repr=False)
    family: str = ""  # the registered model family (backend/family.py) the header matched
    # ComfyUI scaled fp8 / quantized mixed: stored weight key -> its scalar scale (weight = fp8 x scale)
    scales: dict[str, StoredTensor] = field(default_factory=dict, repr=False)
    # how the scales were declared: "" (none), "scaled_fp8", "comfy_quant", "quantization_metadata"
    quantization: str = ""

    @property
    def dims(self) -> ModelDims:
        return self.model_family.dims(self.config)

    @property
    def scaled_fp8(self) -> bool:
        """Some weights are fp8 with a scale each (ComfyUI scaled fp8 or quantized mixed files)."""
        return bool(self.scales)

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
# Recognizing what a set of keys is


def describe_keys(keys: Iterable[str]) -> str:
    """What a non-FLUX checkpoint is, from its key prefixes, as a message's clause: 'it looks like a VAE',
    or the first keys when it is nothing this knows."""
    keys = list(keys)
    prefix = transformer_prefix(keys)
    stripped = [k.removeprefix(prefix) for k in keys]

    def has(*fragments: str) -> bool:
        return any(any(k.startswith(f) or f".{f}" in k for f in fragments) for k in stripped)

    kinds = (
        (has("lora_unet_", "lora_te") or any(".lora_" in k or ".lora." in k for k in keys),
         "a LoRA (apply it in ComfyUI on top of a base FLUX model)"),
        (has("input_blocks.", "middle_block."),
         "an SDXL UNet" if has("label_emb.") else "an SD1.x/SD2.x UNet"),
        (has("joint_blocks."), "an SD3 / SD3.5 MMDiT"),
        (has("distilled_guidance_layer."), "a Chroma model (FLUX-derived, different modulation)"),
        (has("encoder.block.", "shared.weight"), "a T5 text encoder"),
        (has("text_model.encoder."), "a CLIP text encoder"),
        (has("decoder.conv_in.", "encoder.conv_in.", "first_stage_model."), "a VAE"),
    )  # fmt: skip
    kind = next((what for found, what in kinds if found), None)
    if kind is not None:
        return f"it looks like {kind}"
    sample = ", ".join(sorted(keys)[:4])
    return f"none of its keys is a {_known_families()} transformer's (first keys: {sample})"


# --------------------------------------------------------------------------------------------------
# inspect_checkpoint


def _check_shapes(
    path: str, found: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]], title: str
) -> None:
    """Every tensor of the `title` family's layout present, nothing else, each of its shape.

    An empty tensor the layout expects is a marker, not a weight (ComfyUI's `__index_timestep_zero__` of
    Qwen-Image-Edit-2511): the family's config already says what it marks, and a diffusers folder of the
    same model has none, so it may be missing.
    """
    expected = {k: v for k, v in expected.items() if numel(v) or k in found}
    missing = sorted(set(expected) - set(found))
    if missing:
        raise CheckpointError(
            f"{quoted(path)} lacks {len(missing)} {title} tensors (e.g. '{missing[0]}'); the file is incomplete "
            "or a different model. Download the full checkpoint again"
        )
    unknown = sorted(set(found) - set(expected))
    if unknown:
        raise CheckpointError(
            f"{quoted(path)} has {len(unknown)} tensors {title} does not (e.g. '{unknown[0]}'); "
            f"it is a {title} variant this loader does not know"
        )
    for key, shape in expected.items():
        if found[key] != shape:
            raise CheckpointError(
                f"{quoted(path)}: tensor '{key}' has shape {list(found[key])} but this {title} layout needs "
                f"{list(shape)}; the checkpoint is not a {title} transformer"
            )


def _dtype_names(tensors: Iterable[StoredTensor], path: str) -> tuple[str, ...]:
    names = {}
    for t in tensors:
        if t.offset is not None:  # GGUF: read_gguf_header refused the types it cannot read
            names[torch_name(t.dtype)] = None
            continue
        stored = stored_dtype(t.dtype)
        if stored is None or not stored.loadable:
            raise CheckpointError(
                f"{quoted(path)}: tensor '{t.key}' is stored as {t.dtype}; supported stored dtypes are "
                f"{', '.join(d.safetensors for d in LOADABLE_DTYPES)}. Use a bf16, fp16, fp32 or fp8 "
                "safetensors checkpoint"
            )
        names[stored.name] = None
    return tuple(sorted(names))


def _bfl_info(
    path: Path,
    header: dict[str, StoredTensor],
    prefix: str,
    family: ModelFamily,
    scales: dict[str, StoredTensor],
    quantization: str,
    metadata: Mapping[str, str],
) -> CheckpointInfo:
    """`header`: the file's transformer tensors under keys without `prefix`, in any spelling ComfyUI loads;
    resolved here, once, to the family's BFL names (the StoredTensors keep the file's keys, so the readers
    never see a spelling). `metadata`: the header's strings, where a family's files may declare config."""
    tensors = family.keys.bfl_names(header, quoted(path))
    shapes = {k: t.shape for k, t in tensors.items()}
    try:
        config = family.config_from_bfl(shapes)
        if family.config_with_metadata is not None:
            config = family.config_with_metadata(config, metadata)
    except CheckpointError as err:  # the shape readers know no path
        raise CheckpointError(f"{quoted(path)}: {err}") from None
    if config["attention_head_dim"] % 8:
        raise CheckpointError(
            f"{quoted(path)}: head width {config['attention_head_dim']} is not a multiple of 8; "
            f"not a {family.title} transformer"
        )
    _check_shapes(str(path), shapes, family.bfl_shapes(config), family.title)
    sources = {name: (tensors[s.key], s.rows) for name, s in family.sources(config).items()}
    return _info(
        path, "bfl", (str(path),), prefix, config, sources, tensors.values(), family, scales, quantization
    )


def _diffusers_info(
    path: Path,
    files: tuple[str, ...],
    tensors: dict[str, StoredTensor],
    config: dict[str, Any] | None,
    family: ModelFamily,
    scales: dict[str, StoredTensor] | None = None,
    quantization: str = "",
) -> CheckpointInfo:
    shapes = {k: t.shape for k, t in tensors.items()}
    if config is None:  # a diffusers-keyed single file: the family derives the config from its shapes
        try:
            config = family.config_from_diffusers(shapes)
        except ValueError as err:
            raise CheckpointError(
                f"{quoted(path)} has diffusers keys but is not a {family.title} transformer: {err}"
            ) from None
    _check_shapes(str(path), shapes, family.parameter_shapes(config), family.title)
    sources = {k: (t, None) for k, t in tensors.items()}
    return _info(
        path, "diffusers", files, "", config, sources, tensors.values(), family, scales or {}, quantization
    )


def _info(
    path: Path,
    fmt: str,
    files: tuple[str, ...],
    prefix: str,
    config: dict[str, Any],
    sources: dict[str, tuple[StoredTensor, tuple[tuple[int, int], ...] | None]],
    stored: Iterable[StoredTensor],
    family: ModelFamily,
    scales: dict[str, StoredTensor],
    quantization: str = "",
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
        parameters=sum(numel(t.shape) for t in tensors),
        stored_bytes=sum(_bytes(t) for t in tensors),
        sources=sources,
        family=family.name,
        scales=scales,
        quantization=quantization,
    )


def _bytes(t: StoredTensor) -> int:
    return tensor_bytes(t) if t.offset is not None else numel(t.shape) * stored_dtype(t.dtype).bytes


def _by_name() -> list[ModelFamily]:
    """The registered families in name order: families() lists them in registration order, which
    depends on which family module a process imported first, and messages must not."""
    return sorted(families(), key=lambda f: f.name)


def _known_families() -> str:
    """'FLUX.1 or FLUX.2': the titles of the registered families, for messages."""
    return _one_of(f.title for f in _by_name())


def _example_files() -> str:
    """'flux1-dev.safetensors, flux2-dev.safetensors, ...': each family's first preset as a file name."""
    return ", ".join(f"{next(iter(f.presets))}.safetensors" for f in _by_name() if f.presets)


def _one_of(names: Iterable[str]) -> str:
    """'A, B or C' (messages name every registered family)."""
    names = list(names)
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else "".join(names)


def _inspect_file(path: Path) -> CheckpointInfo:
    raw, metadata = read_header(path)
    # The keys ComfyUI's UNETLoader looks at: under the prefix it strips (full checkpoints, ModelSave's
    # `model.diffusion_model.`, `model.model.`, `net.`, `model.`), the rest dropped (keys.transformer_prefix).
    prefix = transformer_prefix(raw)
    stripped = {k[len(prefix) :]: t for k, t in raw.items() if k.startswith(prefix)}
    refuse_foreign_quantization(path, stripped)
    header, scales, quantization = split_scales(str(path), stripped, metadata, prefix)
    if any(is_quantized(t.dtype) for t in header.values() if t.offset is not None):
        quantization = "gguf"
    family = detect_bfl(set(header))
    if family is not None:
        return _bfl_info(path, header, prefix, family, scales, quantization, metadata)
    family = detect_diffusers(set(header))
    if family is not None:
        return _diffusers_info(path, (str(path),), header, None, family, scales, quantization)
    raise CheckpointError(
        f"{quoted(path)} is not a {_known_families()} checkpoint: {describe_keys(raw)}. "
        f"Pick a {_known_families()} transformer file (e.g. {_example_files()}) from models/diffusion_models"
    )


def _inspect_folder(path: Path) -> CheckpointInfo:
    folder = path / "transformer" if (path / "transformer").is_dir() else path
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise CheckpointError(
            f"{quoted(folder)} is a folder without config.json, so not a diffusers model; it has: "
            f"{listing(folder)}. Pass a .safetensors file, or a diffusers FLUX folder (or its transformer/ "
            "folder)"
        )
    raw = json.loads(config_file.read_text())
    cls = raw.get("_class_name")
    family = family_for_class(cls)
    if family is None:
        known = _one_of(f.diffusers_class for f in _by_name())
        raise CheckpointError(
            f"{quoted(config_file)} describes a {cls}, not a {known}; pass a FLUX pipeline folder "
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
            f"{quoted(folder)} has neither {DIFFUSERS_WEIGHTS} nor {DIFFUSERS_INDEX}; it has: {listing(folder)}. "
            "Only safetensors weights are read; re-save the model with "
            "save_pretrained(safe_serialization=True)"
        )
    tensors: dict[str, StoredTensor] = {}
    for shard in shards:
        if not (folder / shard).is_file():
            raise CheckpointError(
                f"{quoted(folder / DIFFUSERS_INDEX)} names the shard '{shard}', which is missing; "
                f"{quoted(folder)} has: {listing(folder)}. Download the missing shard"
            )
        tensors.update(read_header(folder / shard)[0])
    return _diffusers_info(folder, tuple(str(folder / s) for s in shards), tensors, config, family)


def inspect_checkpoint(path: str | os.PathLike[str]) -> CheckpointInfo:
    """Format, stored dtypes, diffusers config and variant of a FLUX checkpoint, from its headers only.

    Raises CheckpointError (a ConfigError) with the path, what was found and the fix.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise missing_checkpoint(path)
    refuse_special(path, "checkpoint", CHECKPOINT_FIX)
    path = path.absolute()  # the workers run in a folder of their own: a relative path would miss there
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


FP8_NOTE = "fp8 is a weight dtype: pass weight_dtype='fp8_e4m3fn' or 'fp8_e5m2' to keep weights in fp8"


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    """The compute dtype for `device`: `dtype` by name or torch dtype, or the device's default."""
    device = torch.device(device)
    if dtype is None:
        return default_dtype(device)
    if isinstance(dtype, str):
        named = compute_dtype_named(dtype)
        if named is None:
            raise CheckpointError(
                f"dtype='{dtype}' is not a compute dtype; use bfloat16, float16 or float32 ({FP8_NOTE})"
            )
        dtype = named.torch
    if dtype not in (d.torch for d in COMPUTE_DTYPES):
        raise CheckpointError(
            f"dtype={dtype} is not a compute dtype; use bfloat16, float16 or float32 ({FP8_NOTE})"
        )
    if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise CheckpointError(f"device {device} does not support bfloat16; use dtype='float16' or 'float32'")
    return dtype


# --------------------------------------------------------------------------------------------------
# Weight dtype

# --------------------------------------------------------------------------------------------------
# Weight dtype


def check_weight_dtype(weight_dtype: str | None, info: CheckpointInfo) -> str:
    """The canonical weight dtype name for loading `info` ('default' for None); CheckpointError for a name
    that is not one, or a conversion this loader does not do."""
    name = weight_dtype_name(weight_dtype)
    fp8 = WEIGHT_DTYPES[name]
    if info.quantization == "gguf" and fp8 is not None:
        raise CheckpointError(
            f"weight_dtype='{name}' but '{info.path}' is a quantized GGUF file ({', '.join(info.stored_dtypes)}): "
            "its blocks are not converted to fp8. Use weight_dtype='default' (keeps them quantized, "
            "dequantized layer by layer like ComfyUI-GGUF) or 'compute' (dequantized once, at load)"
        )
    if info.scaled_fp8 and fp8 is not None:
        kind = "ComfyUI scaled fp8" if info.quantization == "scaled_fp8" else "ComfyUI quantized (fp8 mixed)"
        stored = sorted({stored_dtype(info_t.dtype).name for info_t in _scaled(info)})
        if [fp8.name] != stored:
            raise CheckpointError(
                f"weight_dtype='{name}' but {quoted(info.path)} is a {kind} checkpoint stored as "
                f"{', '.join(stored)}: its scaled weights are not converted to another fp8 format. Use "
                "weight_dtype='default' (keeps the file's fp8 weights and scales) or 'compute'"
            )
    return name


def planned_weight_dtype(weight_dtype: str | None, info: CheckpointInfo) -> str:
    """The planner's name for how `info`'s linear weights will be held: 'compute', an fp8 name, or a GGUF
    quantization type ('Q4_K').

    'default' follows the file: the dtype that stores most of its linear-weight (2-D) elements.
    """
    name = check_weight_dtype(weight_dtype, info)
    if name != "default":
        return name
    counts: dict[str, int] = {}
    for stored, _ in {s.key: (s, None) for s, _ in info.sources.values()}.values():
        if len(stored.shape) == 2:
            counts[stored.dtype] = counts.get(stored.dtype, 0) + numel(stored.shape)
    top = max(counts, key=counts.__getitem__) if counts else "BF16"
    if info.quantization == "gguf" and is_quantized(top):
        return top
    most = stored_dtype(top)
    return most.short if most is not None and most.fp8 else "compute"


def planned_file_weights(weight_dtype: str | None, info: CheckpointInfo) -> Any:
    """`info`'s linear weights tensor by tensor as the loader holds them with `weight_dtype` (a
    plan.setup.FileWeights): what the planner prices and splits (a GGUF file mixing Q4_K and Q6_K; the
    block of each quantized weight, which a TP degree must not cut)."""
    from ..plan.setup import FileWeights  # the planner's record; imported here: plan/ reads this package

    name = check_weight_dtype(weight_dtype, info)
    stored = {param: s.dtype for param, (s, _) in info.sources.items() if len(s.shape) == 2}
    return FileWeights.from_stored(stored, name)


def _scaled(info: CheckpointInfo) -> list[StoredTensor]:
    stored = {s.key: s for s, _ in info.sources.values()}
    return [stored[k] for k in info.scales if k in stored]


__all__ = [
    "DIFFUSERS_INDEX",
    "DIFFUSERS_WEIGHTS",
    "CheckpointInfo",
    "check_weight_dtype",
    "default_dtype",
    "describe_keys",
    "inspect_checkpoint",
    "planned_file_weights",
    "planned_weight_dtype",
    "resolve_dtype",
]
