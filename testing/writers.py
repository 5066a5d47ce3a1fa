"""Checkpoint and LoRA writers the tests and benchmarks share (plain checkpoints: checkpoint.save_checkpoint).

* `save_mixed_checkpoint`: the layout of Comfy-Org's `flux2_dev_fp8mixed.safetensors` (fp8 block linears
  with a per-tensor `weight_scale`, declared in either form ComfyUI reads), for any family's model;
* `quantize_fp8`: ComfyUI's per-tensor fp8 quantization;
* `write_random_lora`: a random LoRA in the BFL, kohya or PEFT key format.

Lives outside the shipped package (the wheel has no `testing/`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..backend.checkpoint import COMFY_PREFIX, diffusers_to_bfl, save_checkpoint
from ..backend.checkpoint.quant import COMFY_QUANT, INPUT_SCALE, QUANT_METADATA, WEIGHT_SCALE
from ..backend.family import family_of, get_family

# How save_mixed_checkpoint declares its quantized layers: per-layer `comfy_quant` tensors (newer ComfyUI)
# or the header's `_quantization_metadata` (ComfyUI 0.3.75).
MIXED_FORMS = ("comfy_quant", "metadata")

# fp8 e4m3fn's largest finite value: ComfyUI's per-tensor scale maps max |W| onto it.
FP8_MAX = 448.0


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 e4m3fn values, float32 scalar scale) with weight ~= values x scale."""
    scale = (weight.abs().max().float() / FP8_MAX).clamp(min=1e-12)
    return (weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale.reshape(())


def save_mixed_checkpoint(
    model: torch.nn.Module,
    path: str | Path,
    *,
    fp8_mixed: str | bool | None = None,
    comfy_prefix: bool = False,
) -> str:
    """Write a model as its family's BFL / ComfyUI single file, optionally fp8 "mixed"; returns the path.

    fp8_mixed: the layout of Comfy-Org's `flux2_dev_fp8mixed.safetensors`: every linear weight inside the
    numbered blocks is float8_e4m3fn + a float32 `weight_scale`; embedders, shared modulation, final layer
    and norms stay bf16. The quantized layers are declared as ComfyUI reads them (MIXED_FORMS):
    "comfy_quant" (or True), a `<layer>.comfy_quant` JSON tensor each (newer ComfyUI), or "metadata", the
    header's `_quantization_metadata` with an `input_scale` per layer as well (ComfyUI 0.3.75, which names
    the layers without `model.diffusion_model.`). None writes the plain file (`save_checkpoint`).
    comfy_prefix: keys under `model.diffusion_model.` (full checkpoints).
    """
    from safetensors.torch import save_file

    if fp8_mixed is True:  # the writer's first form, kept for its callers
        fp8_mixed = "comfy_quant"
    if fp8_mixed not in (None, False, *MIXED_FORMS):
        raise ValueError(f"fp8_mixed={fp8_mixed!r}; use None or one of {MIXED_FORMS}")
    if not fp8_mixed:
        return save_checkpoint(model, path, prefix=comfy_prefix)
    family = family_of(model)
    blocks = tuple(b.bfl for b in family.keys.blocks)
    bfl = diffusers_to_bfl(model.state_dict(), family)
    out: dict[str, torch.Tensor] = {}
    fmt = {"format": "float8_e4m3fn"}
    layers: dict[str, dict[str, str]] = {}
    for key, tensor in bfl.items():
        in_block = key.startswith(blocks) and key.endswith(".weight")
        if in_block:
            layer = key.removesuffix(".weight")
            out[key], out[layer + WEIGHT_SCALE] = quantize_fp8(tensor)
            layers[layer] = fmt
            if fp8_mixed == "comfy_quant":
                out[layer + COMFY_QUANT] = torch.tensor(list(json.dumps(fmt).encode()), dtype=torch.uint8)
            else:
                out[layer + INPUT_SCALE] = torch.ones((), dtype=torch.float32)
        else:
            out[key] = tensor.to(torch.bfloat16)
    if comfy_prefix:
        out = {COMFY_PREFIX + k: v for k, v in out.items()}
    metadata = None
    if fp8_mixed == "metadata":
        metadata = {QUANT_METADATA: json.dumps({"format_version": "1.0", "layers": layers})}
    save_file(out, str(path), metadata=metadata)
    return str(path)


# LoRA key layouts `write_random_lora` writes; the names ComfyUI 0.3.64's `model_lora_keys_unet` maps for
# FLUX (comfy/lora.py): BFL module names under `diffusion_model.`, the same with "." -> "_" under
# `lora_unet_` (kohya / sd-scripts), and diffusers module names under `transformer.` (diffusers / PEFT);
# "bare": the module names alone (Qwen-Image's own / DiffSynth format, e.g. Qwen-Image-Lightning), which
# ComfyUI maps for QwenImage only.
LORA_FORMATS = ("bfl", "kohya", "peft", "bare")


def lora_targets(config: dict[str, Any], family: str = "flux1") -> list[str]:
    """Every BFL module of this model that a LoRA can patch: the linears (norm scales are vectors)."""
    shapes = get_family(family).bfl_shapes(config)
    return sorted(k.removesuffix(".weight") for k, s in shapes.items() if len(s) == 2)


def write_random_lora(
    path: str | Path,
    config: dict[str, Any],
    fmt: str,
    *,
    rank: int = 4,
    seed: int = 0,
    alpha: float | None = 2.0,
    targets: list[str] | tuple[str, ...] | None = None,
    relative: float = 0.1,
    family: str = "flux1",
) -> str:
    """A random LoRA for the `family` model of `config` saved as safetensors in format `fmt`; returns the path.

    The factors are drawn once per BFL module in BFL layout (`targets`: BFL module names such as
    'double_blocks.0.img_attn.qkv'; default every linear) from `seed`, then written as
    * "bfl":   `diffusion_model.<module>.lora_down.weight` / `.lora_up.weight` / `.alpha`
    * "kohya": `lora_unet_<module with . as _>.lora_down.weight` / `.lora_up.weight` / `.alpha`
    * "bare":  `<module>.lora_down.weight` / `.lora_up.weight` / `.alpha` (Qwen-Image's format)
    * "peft":  `transformer.<diffusers module>.lora_A.weight` / `.lora_B.weight`, split per diffusers
      module (qkv -> to_q/to_k/to_v, linear1 -> to_q/to_k/to_v/proj_mlp, the final AdaLN's (shift, scale)
      rows swapped into diffusers' (scale, shift)), with no alpha: ComfyUI then scales by 1, so
      alpha / rank is folded into lora_B.
    so one seed gives the same effective delta `alpha / rank * up @ down` in every format (bit for bit
    when alpha / rank is a power of two, as the default 2 / 4 is). alpha=None writes no alpha (scale 1).
    `relative` sizes the delta's spread against the random builders' weights (std 0.05): 0.1 changes outputs
    visibly without swamping them.
    """
    from safetensors.torch import save_file

    if fmt not in LORA_FORMATS:
        raise ValueError(f"fmt='{fmt}' is not one of {LORA_FORMATS}")
    fam = get_family(family)
    shapes = fam.bfl_shapes(config)
    names = sorted(targets) if targets is not None else lora_targets(config, family)
    scale = 1.0 if alpha is None else alpha / rank
    # each factor entry ~ N(0, sigma^2): delta entries have std scale * sqrt(rank) * sigma^2
    sigma = (relative * 0.05 / (scale * rank**0.5)) ** 0.5
    g = torch.Generator().manual_seed(seed)
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name in names:
        out_features, in_features = shapes[f"{name}.weight"]
        up = torch.randn(out_features, rank, generator=g) * sigma
        down = torch.randn(rank, in_features, generator=g) * sigma
        factors[name] = (up, down)
    tensors: dict[str, torch.Tensor] = {}
    if fmt in ("bfl", "kohya", "bare"):
        prefixes = {"bfl": "diffusion_model.", "kohya": "lora_unet_", "bare": ""}
        for name, (up, down) in factors.items():
            key = prefixes[fmt] + (name.replace(".", "_") if fmt == "kohya" else name)
            tensors[f"{key}.lora_up.weight"] = up
            tensors[f"{key}.lora_down.weight"] = down
            if alpha is not None:
                tensors[f"{key}.alpha"] = torch.tensor(float(alpha))
    else:
        for param, source in fam.sources(config).items():
            module = source.key.removesuffix(".weight")
            if not param.endswith(".weight") or module not in factors:
                continue
            up, down = factors[module]
            rows = source.rows or ((0, up.shape[0]),)
            b = torch.cat([up[r0:r1] for r0, r1 in rows]) * scale
            key = "transformer." + param.removesuffix(".weight")
            tensors[f"{key}.lora_B.weight"] = b.contiguous()
            tensors[f"{key}.lora_A.weight"] = down.clone()
    save_file(tensors, str(path))
    return str(path)


__all__ = [
    "FP8_MAX",
    "LORA_FORMATS",
    "MIXED_FORMS",
    "lora_targets",
    "quantize_fp8",
    "save_mixed_checkpoint",
    "write_random_lora",
]
