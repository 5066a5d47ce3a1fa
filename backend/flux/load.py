"""Load a FLUX checkpoint from ComfyUI's model folders, each rank reading only the bytes it keeps.

Formats: a BFL / ComfyUI single safetensors file (`flux1-dev.safetensors`, fine-tunes; with or without
the `model.diffusion_model.` prefix of ComfyUI's full checkpoints), a diffusers-keyed single file, and
diffusers folders (`config.json` + `diffusion_pytorch_model*.safetensors`, or a pipeline folder with
`transformer/`), of every registered model family (FLUX.1, FLUX.2: backend/family.py). Stored dtypes
bf16, fp16, fp32, fp8 e4m3fn / e5m2, ComfyUI's "scaled fp8" files (fp8 weights with a scalar
`scale_weight` each) and ComfyUI's quantized "mixed" files (fp8 layers with a scalar `weight_scale`,
declared by `comfy_quant` tensors or the header's `_quantization_metadata`; e.g.
flux2_dev_fp8mixed.safetensors). Both scaled layouts become the same thing: one scale per weight, applied
per layer (fp8 resident) or while reading (upcast).

Weight dtype vs compute dtype (`load_flux(weight_dtype=...)`, names in config.WEIGHT_DTYPE_BYTES): the
linear weights either stay fp8 on the device and are upcast per layer at compute time
(parallel/weights.py), or are upcast slice by slice while reading. Everything else is held in the
compute dtype.

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

from ..config import COMPUTE_DTYPE_BYTES, DTYPE_ALIASES, FluxDims, weight_dtype_name
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
from ..parallel.weights import is_fp8, keep_fp8_resident
from .convert import (
    COMFY_PREFIX,
    COMFY_QUANT,
    INPUT_SCALE,
    QUANT_FORMATS,
    QUANT_METADATA,
    WEIGHT_SCALE,
    CheckpointError,
)

# safetensors dtype names this loader reads -> torch dtype (fp8 stays fp8 or is upcast: see weight dtype).
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
# weight dtype name -> the fp8 dtype it converts linear weights to ("default" keeps the stored one).
FP8_WEIGHT_DTYPES: dict[str, torch.dtype] = {"fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# ComfyUI's scaled fp8 files (comfy/model_detection.py, comfy/ops.py scaled_fp8_ops): a `scaled_fp8` marker
# tensor, a `scale_weight` next to every fp8 weight, and `scale_input` for fp8 matmuls only.
SCALED_FP8_MARKER = "scaled_fp8"
SCALE_WEIGHT, SCALE_INPUT = ".scale_weight", ".scale_input"
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
    # ComfyUI scaled fp8 / quantized mixed: stored weight key -> its scalar scale (weight = fp8 x scale)
    scales: dict[str, StoredTensor] = field(default_factory=dict, repr=False)
    # how the scales were declared: "" (none), "scaled_fp8", "comfy_quant", "quantization_metadata"
    quantization: str = ""

    @property
    def dims(self) -> FluxDims:
        return FluxDims.from_diffusers_config(self.config)

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


def _read_header(path: Path) -> tuple[dict[str, StoredTensor], dict[str, str]]:
    """(key -> stored tensor, the header's `__metadata__` strings) of a safetensors file."""
    _check_file_kind(path)
    try:
        with safe_open(str(path), "pt") as f:
            out = {}
            for key in f.keys():
                s = f.get_slice(key)
                out[key] = StoredTensor(str(path), key, tuple(s.get_shape()), s.get_dtype())
            return out, dict(f.metadata() or {})
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
    return f"not a {_known_families()} transformer (first keys: {sample})"


# The ways a file declares its scaled weights (CheckpointInfo.quantization), as messages name them.
_DECLARED = {
    "scaled_fp8": "a ComfyUI scaled fp8 'scale_weight'",
    "comfy_quant": "its 'comfy_quant' tensor",
    "quantization_metadata": f"the header's {QUANT_METADATA}",
}
_FIX = "Use a plain fp8, bf16 or fp16 FLUX file"


def _read_marker(stored: StoredTensor) -> Any:
    """The JSON object a `<layer>.comfy_quant` uint8 tensor holds (None when it holds none)."""
    with safe_open(stored.file, "pt") as f:
        raw = bytes(f.get_tensor(stored.key).reshape(-1).tolist()) if stored.dtype == "U8" else b""
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None


def _quantized_layers(
    path: str, header: Mapping[str, StoredTensor], metadata: Mapping[str, str]
) -> dict[str, tuple[Any, str]]:
    """Layer (header key without `.weight`) -> (declared format, how it was declared) of a ComfyUI
    quantized "mixed" file, from `<layer>.comfy_quant` tensors and the header's `_quantization_metadata`
    (the layout: flux/convert.py); {} for any other file."""
    layers: dict[str, tuple[Any, str]] = {}
    for key in (k for k in header if k.endswith(COMFY_QUANT)):
        conf = _read_marker(header[key])
        if not isinstance(conf, dict):
            raise CheckpointError(
                f"'{path}': '{key}' does not hold the UTF-8 JSON object ComfyUI writes there "
                '(e.g. {"format": "float8_e4m3fn"}); the file is damaged. Download it again'
            )
        layers[key.removesuffix(COMFY_QUANT)] = (conf.get("format"), "comfy_quant")
    if QUANT_METADATA not in metadata:
        return layers
    try:
        declared = json.loads(metadata[QUANT_METADATA])
    except ValueError:
        declared = None
    if not isinstance(declared, dict) or not isinstance(declared.get("layers"), dict):
        raise CheckpointError(
            f"'{path}': the header's {QUANT_METADATA} is not ComfyUI's JSON "
            '{"format_version": ..., "layers": {"<layer>": {"format": ...}}}; the file is damaged. '
            "Download it again"
        )
    prefix = COMFY_PREFIX if any(k.startswith(COMFY_PREFIX) for k in header) else ""
    for name, conf in declared["layers"].items():
        # ComfyUI 0.3.75 names the layers inside the diffusion model (no `model.diffusion_model.`); newer
        # ComfyUI's convert_old_quants appends `.comfy_quant` to the names as given: accept either.
        layer = next((c for c in (name, prefix + name) if f"{c}.weight" in header), name)
        # the metadata wins over a comfy_quant tensor, as in convert_old_quants
        layers[layer] = (conf.get("format") if isinstance(conf, dict) else None, "quantization_metadata")
    return layers


def _split_scales(
    path: str, header: dict[str, StoredTensor], metadata: Mapping[str, str]
) -> tuple[dict[str, StoredTensor], dict[str, StoredTensor], str]:
    """(the model's tensors, stored weight key -> its scale, how the scales were declared) of a ComfyUI
    scaled fp8 or quantized "mixed" file; any other file comes back unchanged with no scales.

    Both layouts hold some weights as fp8 with one float scale each (weight = fp8 x scale): scaled fp8's
    `scale_weight` (comfy/ops.py scaled_fp8_ops), mixed files' `weight_scale` (comfy/quant_ops.py
    TensorCoreFP8Layout.dequantize). `scale_input` / `input_scale` tensors are dropped: ComfyUI uses them
    only to quantize activations for fp8 x fp8 matmuls; its upcasting path, which this loader's
    arithmetic follows, ignores them as well. Anything but one scale per fp8 weight (nvfp4, block or
    per-channel scales, an unknown format) is refused here, from the header, before a worker starts.
    """
    layers = _quantized_layers(path, header, metadata)
    for layer, (fmt, how) in sorted(layers.items()):
        if fmt not in QUANT_FORMATS:
            shown = "no format" if fmt is None else repr(fmt)
            raise CheckpointError(
                f"'{path}': layer '{layer}' is quantized as {shown} ({_DECLARED[how]}); this loader reads "
                f"ComfyUI's {' and '.join(QUANT_FORMATS)} layers (one scale per weight) only. Use an fp8 "
                "(e.g. flux2_dev_fp8mixed.safetensors), bf16 or fp16 version of the model, or load this file "
                "with ComfyUI's own Load Diffusion Model"
            )
    marker = [k for k in header if k.removeprefix(COMFY_PREFIX) == SCALED_FP8_MARKER]
    # (scale key, weight key, how it is declared) of every scaled weight
    pairs = [
        (k, k.removesuffix(SCALE_WEIGHT) + ".weight", "scaled_fp8")
        for k in header
        if k.endswith(SCALE_WEIGHT)
    ]
    pairs += [(layer + WEIGHT_SCALE, layer + ".weight", how) for layer, (_, how) in sorted(layers.items())]
    dropped = {*marker, *(k for k in header if k.endswith(SCALE_INPUT))}
    dropped |= {layer + suffix for layer in layers for suffix in (COMFY_QUANT, INPUT_SCALE)}
    stray = sorted(
        k for k in header if k.endswith(WEIGHT_SCALE) and k.removesuffix(WEIGHT_SCALE) not in layers
    )
    if stray:
        raise CheckpointError(
            f"'{path}': '{stray[0]}' is a ComfyUI weight scale, but neither a "
            f"'{stray[0].removesuffix(WEIGHT_SCALE)}{COMFY_QUANT}' tensor nor the header's {QUANT_METADATA} "
            f"declares its layer quantized; the file is damaged or from a tool this loader does not know. {_FIX}"
        )
    if not pairs and not dropped:
        return header, {}, ""
    tensors = {k: t for k, t in header.items() if k not in dropped and k not in {p[0] for p in pairs}}
    scales: dict[str, StoredTensor] = {}
    for key, weight_key, how in pairs:
        scale, weight = header.get(key), tensors.get(weight_key)
        if how == "scaled_fp8" and weight is None:
            raise CheckpointError(
                f"'{path}': scale '{key}' has no weight '{weight_key}' beside it; the scaled fp8 file is "
                f"damaged or from a tool this loader does not know. {_FIX}"
            )
        if weight is None or scale is None:
            layer, fmt = weight_key.removesuffix(".weight"), layers[weight_key.removesuffix(".weight")][0]
            raise CheckpointError(
                f"'{path}': layer '{layer}' is declared {fmt} ({_DECLARED[how]}) but the file has no "
                f"'{key if weight is not None else weight_key}'; ComfyUI's quantized layers need a weight and "
                f"its weight_scale. The file is damaged; download it again. {_FIX}"
            )
        if _numel(scale.shape) != 1 or scale.dtype not in ("F32", "BF16", "F16"):
            stores = "ComfyUI scaled fp8 stores" if how == "scaled_fp8" else "ComfyUI's fp8 layers store"
            raise CheckpointError(
                f"'{path}': '{key}' is a {scale.dtype} tensor of shape {list(scale.shape)}; {stores} one float "
                f"scale per weight (shape []), and per-channel or block scales are not supported. {_FIX}"
            )
        if how == "scaled_fp8" and weight.dtype not in ("F8_E4M3", "F8_E5M2"):
            raise CheckpointError(
                f"'{path}': '{weight_key}' is stored as {weight.dtype} but has a scale '{key}'; only fp8 "
                "weights are scaled. The file is damaged; use a plain fp8, bf16 or fp16 FLUX file"
            )
        fmt = layers.get(weight_key.removesuffix(".weight"), (None, ""))[0]
        if how != "scaled_fp8" and STORED_DTYPES.get(weight.dtype) != QUANT_FORMATS[fmt]:
            raise CheckpointError(
                f"'{path}': '{weight_key}' is stored as {weight.dtype} but its layer is declared {fmt} "
                f"({_DECLARED[how]}); the file is damaged. Download it again, or use a plain fp8, bf16 or fp16 FLUX file"
            )
        scales[weight_key] = scale
    return tensors, scales, "+".join(sorted({how for _, _, how in pairs}))


# --------------------------------------------------------------------------------------------------
# inspect_checkpoint


def _check_shapes(
    path: str, found: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]], title: str
) -> None:
    """Every tensor of the `title` family's layout present, nothing else, each of its shape."""
    missing = sorted(set(expected) - set(found))
    if missing:
        raise CheckpointError(
            f"'{path}' lacks {len(missing)} {title} tensors (e.g. '{missing[0]}'); the file is incomplete "
            "or a different model. Download the full checkpoint again"
        )
    unknown = sorted(set(found) - set(expected))
    if unknown:
        raise CheckpointError(
            f"'{path}' has {len(unknown)} tensors {title} does not (e.g. '{unknown[0]}'); "
            f"it is a {title} variant this loader does not know"
        )
    for key, shape in expected.items():
        if found[key] != shape:
            raise CheckpointError(
                f"'{path}': tensor '{key}' has shape {list(found[key])} but this {title} layout needs "
                f"{list(shape)}; the checkpoint is not a {title} transformer"
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


def _bfl_info(
    path: Path,
    header: dict[str, StoredTensor],
    family: ModelFamily,
    scales: dict[str, StoredTensor],
    quantization: str,
) -> CheckpointInfo:
    prefix = COMFY_PREFIX if any(k.startswith(COMFY_PREFIX) for k in header) else ""
    tensors = {k[len(prefix) :]: t for k, t in header.items() if k.startswith(prefix)}
    shapes = {k: t.shape for k, t in tensors.items()}
    config = family.config_from_bfl(shapes)
    if config["attention_head_dim"] % 8:
        raise CheckpointError(
            f"'{path}': head width {config['attention_head_dim']} is not a multiple of 8; "
            f"not a {family.title} transformer"
        )
    _check_shapes(str(path), shapes, family.bfl_shapes(config), family.title)
    sources = {name: (tensors[s.key], s.rows) for name, s in family.bfl_sources(config).items()}
    return _info(
        path, "bfl", (str(path),), prefix, config, sources, tensors.values(), family, scales, quantization
    )


def _diffusers_shapes(family: ModelFamily, config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    model = family.build(dict(config), device="meta")
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


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
                f"'{path}' has diffusers keys but is not a {family.title} transformer: {err}"
            ) from None
    _check_shapes(str(path), shapes, _diffusers_shapes(family, config), family.title)
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
        parameters=sum(_numel(t.shape) for t in tensors),
        stored_bytes=sum(_numel(t.shape) * STORED_DTYPES[t.dtype].itemsize for t in tensors),
        sources=sources,
        family=family.name,
        scales=scales,
        quantization=quantization,
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _by_name() -> list[ModelFamily]:
    """The registered families in name order: families() lists them in registration order, which
    depends on which family module a process imported first, and messages must not."""
    return sorted(families(), key=lambda f: f.name)


def _known_families() -> str:
    """'FLUX.1 or FLUX.2': the titles of the registered families, for messages."""
    return " or ".join(f.title for f in _by_name())


def _inspect_file(path: Path) -> CheckpointInfo:
    raw, metadata = _read_header(path)
    header, scales, quantization = _split_scales(str(path), raw, metadata)
    keys = list(header)
    prefix = COMFY_PREFIX if any(k.startswith(COMFY_PREFIX) for k in keys) else ""
    stripped = {k.removeprefix(prefix) for k in keys if k.startswith(prefix)}
    family = detect_bfl(stripped)
    if family is not None:
        return _bfl_info(path, header, family, scales, quantization)
    family = detect_diffusers(set(keys))
    if family is not None:
        return _diffusers_info(path, (str(path),), header, None, family, scales, quantization)
    raise CheckpointError(
        f"'{path}' is not a {_known_families()} checkpoint: it looks like {describe_keys(keys)}. "
        f"Pick a {_known_families()} transformer file (e.g. flux1-dev.safetensors, flux2-dev.safetensors) "
        "from models/diffusion_models"
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
        known = " or ".join(f.diffusers_class for f in _by_name())
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
        tensors.update(_read_header(folder / shard)[0])
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


FP8_NOTE = "fp8 is a weight dtype: pass weight_dtype='fp8_e4m3fn' or 'fp8_e5m2' to keep weights in fp8"


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    """The compute dtype for `device`: `dtype` by name or torch dtype, or the device's default."""
    device = torch.device(device)
    if dtype is None:
        return default_dtype(device)
    if isinstance(dtype, str):
        if dtype not in COMPUTE_DTYPES:
            raise CheckpointError(
                f"dtype='{dtype}' is not a compute dtype; use bfloat16, float16 or float32 ({FP8_NOTE})"
            )
        dtype = COMPUTE_DTYPES[dtype]
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise CheckpointError(
            f"dtype={dtype} is not a compute dtype; use bfloat16, float16 or float32 ({FP8_NOTE})"
        )
    if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise CheckpointError(f"device {device} does not support bfloat16; use dtype='float16' or 'float32'")
    return dtype


# --------------------------------------------------------------------------------------------------
# Weight dtype

# Attribute of a loaded model: its canonical weight dtype name (LoRA re-reads use the same rule).
WEIGHT_DTYPE_ATTR = "_rp_weight_dtype"


def check_weight_dtype(weight_dtype: str | None, info: CheckpointInfo) -> str:
    """The canonical weight dtype name for loading `info` ('default' for None); CheckpointError for a name
    that is not one, or a conversion this loader does not do."""
    name = weight_dtype_name(weight_dtype)
    if info.scaled_fp8 and name in FP8_WEIGHT_DTYPES:
        kind = "ComfyUI scaled fp8" if info.quantization == "scaled_fp8" else "ComfyUI quantized (fp8 mixed)"
        stored = sorted({str(STORED_DTYPES[info_t.dtype]).removeprefix("torch.") for info_t in _scaled(info)})
        if [str(FP8_WEIGHT_DTYPES[name]).removeprefix("torch.")] != stored:
            raise CheckpointError(
                f"weight_dtype='{name}' but '{info.path}' is a {kind} checkpoint stored as "
                f"{', '.join(stored)}: its scaled weights are not converted to another fp8 format. Use "
                "weight_dtype='default' (keeps the file's fp8 weights and scales) or 'compute'"
            )
    return name


def planned_weight_dtype(weight_dtype: str | None, info: CheckpointInfo) -> str:
    """The planner's name for how `info`'s linear weights will be held: 'compute' or an fp8 name.

    'default' follows the file: the dtype that stores most of its linear-weight (2-D) elements.
    """
    name = check_weight_dtype(weight_dtype, info)
    if name != "default":
        return name
    counts: dict[str, int] = {}
    for stored, _ in {s.key: (s, None) for s, _ in info.sources.values()}.values():
        if len(stored.shape) == 2:
            counts[stored.dtype] = counts.get(stored.dtype, 0) + _numel(stored.shape)
    most = max(counts, key=counts.__getitem__) if counts else "BF16"
    for fp8_name, fp8 in FP8_WEIGHT_DTYPES.items():
        if STORED_DTYPES[most] == fp8:
            return fp8_name
    return "compute"


def _scaled(info: CheckpointInfo) -> list[StoredTensor]:
    stored = {s.key: s for s, _ in info.sources.values()}
    return [stored[k] for k in info.scales if k in stored]


def resident_dtype(
    stored: StoredTensor, linear_weight: bool, weight_dtype: str, compute: torch.dtype
) -> torch.dtype:
    """The dtype a parameter is held in: fp8 for linear weights when `weight_dtype` says so (or, for
    'default', when the file stores them in fp8), the compute dtype for everything else."""
    if not linear_weight or weight_dtype == "compute":
        return compute
    if weight_dtype == "default":
        kept = STORED_DTYPES[stored.dtype]
        return kept if is_fp8(kept) else compute
    return FP8_WEIGHT_DTYPES[weight_dtype]


def parameter_dtype(model: nn.Module, stored: StoredTensor, name: str, compute: torch.dtype) -> torch.dtype:
    """`resident_dtype` of parameter `name` of a model `load_flux` built (its weight dtype is recorded)."""
    module_name, _, param = name.rpartition(".")
    linear = isinstance(model.get_submodule(module_name), nn.Linear) and param == "weight"
    return resident_dtype(stored, linear, getattr(model, WEIGHT_DTYPE_ATTR, "compute"), compute)


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
        file_rows = tuple(_compose(file_rows, pieces.ranges))
    elif pieces is not None:
        cols = pieces.ranges
    shape = (sum(b - a for a, b in file_rows), *stored.shape[1:])
    if cols is not None:
        shape = (shape[0], sum(d - c for c, d in cols), *shape[2:])
    out = torch.empty(shape, dtype=dtype, device=device)
    check = is_fp8(dtype) and STORED_DTYPES[stored.dtype] != dtype

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
    if scale is not None:
        out.mul_(read_scale(scale).to(dtype))
    return out


def _check_fp8_range(stored: StoredTensor, piece: torch.Tensor, dtype: torch.dtype) -> None:
    limit = torch.finfo(dtype).max
    peak = float(piece.float().abs().amax()) if piece.numel() else 0.0
    if not peak <= limit:
        name = str(dtype).removeprefix("torch.").replace("float8", "fp8")
        raise CheckpointError(
            f"'{stored.file}': tensor '{stored.key}' holds values up to {peak:g}, beyond {name}'s range "
            f"(+-{limit:g}); converting would clip them. Use weight_dtype='fp8_e5m2', 'default' or 'compute'"
        )


def read_scale(scale: StoredTensor) -> torch.Tensor:
    """The float32 scalar of a scaled fp8 weight."""
    with safe_open(scale.file, "pt") as f:
        return f.get_tensor(scale.key).reshape(()).to(torch.float32)


def read_parameter(
    info: CheckpointInfo, name: str, pieces: Pieces | None, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """This rank's `pieces` of diffusers parameter `name` as `dtype`: scaled fp8 weights are multiplied
    by their scale unless `dtype` is fp8 (then the raw fp8 values come back; the layer applies the scale)."""
    stored, rows = info.sources[name]
    scale = info.scales.get(stored.key)
    return _read(stored, rows, pieces, dtype, device, None if is_fp8(dtype) else scale)


def _full_shape(stored: StoredTensor, rows: tuple[tuple[int, int], ...] | None) -> tuple[int, ...]:
    if rows is None:
        return stored.shape
    return (sum(b - a for a, b in rows), *stored.shape[1:])


def load_flux(
    path: str | os.PathLike[str] | CheckpointInfo,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    weight_dtype: str | None = None,
    group: Any = None,
    tp: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> nn.Module:
    """Build FluxTransformer2DModel from a checkpoint holding only this rank's weights on `device`.

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
            module_name, _, param = name.rpartition(".")
            module = model.get_submodule(module_name)
            target = resident_dtype(
                stored, isinstance(module, nn.Linear) and param == "weight", weight, dtype
            )
            tensor = read_parameter(info, name, pieces, target, device)
            if tensor.shape != meta.shape:  # the plan and the meta model disagree: a bug, not bad input
                raise RuntimeError(
                    f"{name}: read {tuple(tensor.shape)} but the model expects {tuple(meta.shape)}"
                )
            setattr(module, param, nn.Parameter(tensor, requires_grad=False))
            if is_fp8(target) and stored.key in info.scales:
                module.register_buffer("scale_weight", read_scale(info.scales[stored.key]).to(device), False)
            if progress is not None:
                progress(done, len(parameters))
    keep_fp8_resident(model, dtype)
    setattr(model, WEIGHT_DTYPE_ATTR, weight)
    setattr(model, FAMILY_ATTRIBUTE, family.name)
    return model.eval()


__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "StoredTensor",
    "check_weight_dtype",
    "default_dtype",
    "describe_keys",
    "inspect_checkpoint",
    "load_flux",
    "planned_weight_dtype",
    "read_parameter",
    "resident_dtype",
    "resolve_dtype",
]
