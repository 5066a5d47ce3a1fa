"""ComfyUI's scaled fp8 and quantized "mixed" files: which weights are fp8 with a scale, from the header.

Two layouts hold some weights as fp8 with one float scale each (weight = fp8 x scale):

* ComfyUI's "scaled fp8" files (comfy/model_detection.py, comfy/ops.py scaled_fp8_ops): a `scaled_fp8`
  marker tensor, a `scale_weight` next to every fp8 weight, and `scale_input` for fp8 matmuls only;
* ComfyUI's quantized "mixed precision" files (below), e.g. Comfy-Org's flux2_dev_fp8mixed.safetensors.

`split_scales` turns either into the same thing: the model's tensors and, per stored weight, its scale.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..dtypes import FP8_DTYPES, stored_dtype
from ..runtime.redact import quoted
from .files import CheckpointError, StoredTensor, numel

if TYPE_CHECKING:  # torch and safetensors where values are read: `plan` reads the keys without them
    import torch

# ComfyUI's quantized ("mixed precision") layers, e.g. Comfy-Org's flux2_dev_fp8mixed.safetensors: some
# linears are stored quantized, each with companions `<layer>.weight_scale` (the per-tensor scale:
# comfy/quant_ops.py TensorCoreFP8Layout.dequantize is `weight.to(dtype) * scale`) and optionally
# `<layer>.input_scale` (quantizes activations for fp8 matmuls only). Which layers, in which format, is
# declared in either of two forms, both read by the loader (checkpoint/info.py) and written by the test writer
# (testing/writers.py save_fp8_mixed):
# * `<layer>.comfy_quant`: a uint8 tensor holding UTF-8 JSON such as {"format": "float8_e4m3fn"} (newer
#   ComfyUI: comfy/ops.py mixed_precision_ops._load_from_state_dict; comfy/utils.py convert_old_quants);
# * the safetensors header metadata `_quantization_metadata` = JSON {"format_version": "1.0", "layers":
#   {"<layer>": {"format": "float8_e4m3fn"}}} (ComfyUI 0.3.75: comfy/model_detection.py
#   detect_layer_quantization, comfy/ops.py mixed_precision_ops).
COMFY_QUANT, WEIGHT_SCALE, INPUT_SCALE = ".comfy_quant", ".weight_scale", ".input_scale"
QUANT_METADATA = "_quantization_metadata"
# The formats whose weights are one fp8 tensor times one scale (comfy/quant_ops.py QUANT_ALGOS: "parameters"
# weight_scale / input_scale, no group_size): format -> the dtype its weights are stored in. Others (nvfp4's
# block scales and second scale, anything newer) are refused by name.
# The formats whose weights are one fp8 tensor times one scale (comfy/quant_ops.py QUANT_ALGOS: "parameters"
# weight_scale / input_scale, no group_size): torch's names of the fp8 dtypes the weights are stored in.
# Others (nvfp4's block scales and second scale, anything newer) are refused by name.
QUANT_FORMATS: tuple[str, ...] = tuple(d.name for d in FP8_DTYPES)
SCALED_FP8_MARKER = "scaled_fp8"
SCALE_WEIGHT, SCALE_INPUT = ".scale_weight", ".scale_input"
# ComfyUI's quantized-layer companions of `<layer>.weight`: not parameters of the model.
QUANT_SUFFIXES = (WEIGHT_SCALE, INPUT_SCALE, COMFY_QUANT)


# The ways a file declares its scaled weights (CheckpointInfo.quantization), as messages name them.
_DECLARED = {
    "scaled_fp8": "a ComfyUI scaled fp8 'scale_weight'",
    "comfy_quant": "its 'comfy_quant' tensor",
    "quantization_metadata": f"the header's {QUANT_METADATA}",
}
_FIX = "Use a plain fp8, bf16 or fp16 FLUX file"


def read_marker(stored: StoredTensor) -> Any:
    """The JSON object a `<layer>.comfy_quant` uint8 tensor holds (None when it holds none)."""
    from safetensors import safe_open

    with safe_open(stored.file, "pt") as f:
        raw = bytes(f.get_tensor(stored.key).reshape(-1).tolist()) if stored.dtype == "U8" else b""
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None


def quantized_layers(
    path: str, header: Mapping[str, StoredTensor], metadata: Mapping[str, str], prefix: str = ""
) -> dict[str, tuple[Any, str]]:
    """Layer (header key without `.weight`) -> (declared format, how it was declared) of a ComfyUI
    quantized "mixed" file, from `<layer>.comfy_quant` tensors and the header's `_quantization_metadata`
    (the layout: checkpoint/quant.py); {} for any other file. `header`'s keys are the file's without the
    transformer `prefix` the loader stripped (the metadata may name the layers with or without it)."""
    layers: dict[str, tuple[Any, str]] = {}
    for key in (k for k in header if k.endswith(COMFY_QUANT)):
        conf = read_marker(header[key])
        if not isinstance(conf, dict):
            raise CheckpointError(
                f"{quoted(path)}: '{key}' does not hold the UTF-8 JSON object ComfyUI writes there "
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
            f"{quoted(path)}: the header's {QUANT_METADATA} is not ComfyUI's JSON "
            '{"format_version": ..., "layers": {"<layer>": {"format": ...}}}; the file is damaged. '
            "Download it again"
        )
    for name, conf in declared["layers"].items():
        # ComfyUI 0.3.75 names the layers inside the diffusion model (no `model.diffusion_model.`); newer
        # ComfyUI's convert_old_quants appends `.comfy_quant` to the names as given: accept either.
        layer = next((c for c in (name, name.removeprefix(prefix)) if f"{c}.weight" in header), name)
        # the metadata wins over a comfy_quant tensor, as in convert_old_quants
        layers[layer] = (conf.get("format") if isinstance(conf, dict) else None, "quantization_metadata")
    return layers


def split_scales(
    path: str,
    header: dict[str, StoredTensor],
    metadata: Mapping[str, str],
    prefix: str = "",
    fix: str | None = None,
) -> tuple[dict[str, StoredTensor], dict[str, StoredTensor], str]:
    """(the model's tensors, stored weight -> its scale, how the scales were declared) of a ComfyUI scaled
    fp8 or quantized "mixed" file; any other file comes back unchanged with no scales. `header`: the file's
    tensors under keys without the transformer `prefix` the loader stripped; the scales are keyed by the
    weights' keys in the file (`StoredTensor.key`), which is what the readers look them up by.

    ComfyUI 0.33's ModelSave writes both layouts as the mixed one (comfy/utils.py convert_old_quants:
    `weight_scale` + a `comfy_quant` tensor per layer, compute-dtype biases, no marker).

    Both layouts hold some weights as fp8 with one float scale each (weight = fp8 x scale): scaled fp8's
    `scale_weight` (comfy/ops.py scaled_fp8_ops), mixed files' `weight_scale` (comfy/quant_ops.py
    TensorCoreFP8Layout.dequantize). `scale_input` / `input_scale` tensors are dropped: ComfyUI uses them
    only to quantize activations for fp8 x fp8 matmuls; its upcasting path, which this loader's
    arithmetic follows, ignores them as well. Anything but one scale per fp8 weight (nvfp4, block or
    per-channel scales, an unknown format) is refused here, from the header, before a worker starts.
    `fix`: what each refusal tells the user to do instead (default: the diffusion models' advice).
    """
    damaged = f"The file is damaged. {fix}" if fix else None
    fix = fix or _FIX
    layers = quantized_layers(path, header, metadata, prefix)
    for layer, (fmt, how) in sorted(layers.items()):
        if fmt not in QUANT_FORMATS:
            shown = "no format" if fmt is None else repr(fmt)
            raise CheckpointError(
                f"{quoted(path)}: layer '{layer}' is quantized as {shown} ({_DECLARED[how]}); this loader reads "
                f"ComfyUI's {' and '.join(QUANT_FORMATS)} layers (one scale per weight) only. "
                + (
                    fix
                    if damaged
                    else "Use an fp8 (e.g. flux2_dev_fp8mixed.safetensors), bf16 or fp16 version of the model, "
                    "or load this file with ComfyUI's own Load Diffusion Model"
                )
            )
    marker = [k for k in header if k == SCALED_FP8_MARKER]
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
            f"{quoted(path)}: '{stray[0]}' is a ComfyUI weight scale, but neither a "
            f"'{stray[0].removesuffix(WEIGHT_SCALE)}{COMFY_QUANT}' tensor nor the header's {QUANT_METADATA} "
            f"declares its layer quantized; the file is damaged or from a tool this loader does not know. {fix}"
        )
    if not pairs and not dropped:
        return header, {}, ""
    tensors = {k: t for k, t in header.items() if k not in dropped and k not in {p[0] for p in pairs}}
    scales: dict[str, StoredTensor] = {}
    for key, weight_key, how in pairs:
        scale, weight = header.get(key), tensors.get(weight_key)
        if how == "scaled_fp8" and weight is None:
            raise CheckpointError(
                f"{quoted(path)}: scale '{key}' has no weight '{weight_key}' beside it; the scaled fp8 file is "
                f"damaged or from a tool this loader does not know. {fix}"
            )
        if weight is None or scale is None:
            layer, fmt = weight_key.removesuffix(".weight"), layers[weight_key.removesuffix(".weight")][0]
            raise CheckpointError(
                f"{quoted(path)}: layer '{layer}' is declared {fmt} ({_DECLARED[how]}) but the file has no "
                f"'{key if weight is not None else weight_key}'; ComfyUI's quantized layers need a weight and "
                f"its weight_scale. The file is damaged; download it again. {fix}"
            )
        if numel(scale.shape) != 1 or scale.dtype not in ("F32", "BF16", "F16"):
            stores = "ComfyUI scaled fp8 stores" if how == "scaled_fp8" else "ComfyUI's fp8 layers store"
            raise CheckpointError(
                f"{quoted(path)}: '{key}' is a {scale.dtype} tensor of shape {list(scale.shape)}; {stores} one float "
                f"scale per weight (shape []), and per-channel or block scales are not supported. {fix}"
            )
        if how == "scaled_fp8" and weight.dtype not in ("F8_E4M3", "F8_E5M2"):
            raise CheckpointError(
                f"{quoted(path)}: '{weight_key}' is stored as {weight.dtype} but has a scale '{key}'; only fp8 "
                "weights are scaled. "
                + (damaged or "The file is damaged; use a plain fp8, bf16 or fp16 FLUX file")
            )
        fmt = layers.get(weight_key.removesuffix(".weight"), (None, ""))[0]
        stored = stored_dtype(weight.dtype)
        if how != "scaled_fp8" and (stored is None or stored.name != fmt):
            raise CheckpointError(
                f"{quoted(path)}: '{weight_key}' is stored as {weight.dtype} but its layer is declared {fmt} "
                f"({_DECLARED[how]}); "
                + (
                    damaged
                    or "the file is damaged. Download it again, or use a plain fp8, bf16 or fp16 FLUX file"
                )
            )
        scales[weight.key] = scale
    return tensors, scales, "+".join(sorted({how for _, _, how in pairs}))


def dequantize(state: Mapping[str, torch.Tensor], key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`state[key]`, with ComfyUI's per-tensor `weight_scale` applied when the state has one: in `dtype`
    (a scaled weight without one: float32, where the product fp8 x scale is exact)."""
    tensor = state[key]
    scale_key = key.removesuffix(".weight") + WEIGHT_SCALE
    if key.endswith(".weight") and scale_key in state:
        import torch

        dtype = dtype or torch.float32
        return tensor.to(dtype) * state[scale_key].to(dtype)
    return tensor if dtype is None else tensor.to(dtype)


__all__ = [
    "COMFY_QUANT",
    "INPUT_SCALE",
    "QUANT_FORMATS",
    "QUANT_METADATA",
    "QUANT_SUFFIXES",
    "SCALED_FP8_MARKER",
    "SCALE_INPUT",
    "SCALE_WEIGHT",
    "WEIGHT_SCALE",
    "dequantize",
    "quantized_layers",
    "read_marker",
    "split_scales",
]
