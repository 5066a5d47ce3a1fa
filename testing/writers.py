"""Checkpoint and LoRA writers the tests and benchmarks share (plain checkpoints: checkpoint.save_checkpoint).

* `save_mixed_checkpoint`: the layout of Comfy-Org's `flux2_dev_fp8mixed.safetensors` (fp8 block linears
  with a per-tensor `weight_scale`, declared in either form ComfyUI reads), for any family's model;
* `quantize_fp8`: ComfyUI's per-tensor fp8 quantization;
* `write_random_lora`: a random LoRA, LoHa, LoKr, DoRA or full-difference file in the BFL, kohya, PEFT
  or LyCORIS key format.

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


# LoRA key layouts `write_random_lora` writes; names ComfyUI's `model_lora_keys_unet` maps for FLUX
# (comfy/lora.py): BFL module names under `diffusion_model.`, the same with "." -> "_" under `lora_unet_`
# (kohya / sd-scripts), diffusers module names under `transformer.` (diffusers / PEFT) and with "." -> "_"
# under `lycoris_` (SimpleTuner's LyCORIS); "bare": the BFL module names alone (Qwen-Image's own / DiffSynth
# format, e.g. Qwen-Image-Lightning), which ComfyUI maps for QwenImage only.
LORA_FORMATS = ("bfl", "kohya", "peft", "lycoris", "bare")
# Adapter kinds (ComfyUI's comfy/weight_adapter/): "lokr" stores w1 whole and w2 as two factors (LyCORIS'
# usual layout; alpha / rank of w2), "lokr_full" both whole (ComfyUI then ignores alpha), "lokr_both"
# both as two factors; "diff" a full weight difference.
LORA_KINDS = ("lora", "loha", "lokr", "lokr_full", "lokr_both", "diff")
DORA_AXES = ("output", "input")  # dora_scale [out, 1] or [1, in]


def lora_targets(config: dict[str, Any], family: str = "flux1") -> list[str]:
    """Every BFL module of this model that a LoRA can patch: the linears (norm scales are vectors)."""
    shapes = get_family(family).bfl_shapes(config)
    return sorted(k.removesuffix(".weight") for k, s in shapes.items() if len(s) == 2)


def _small_factor(n: int) -> int:
    """The largest divisor of n not above its square root (LyCORIS splits a LoKr dimension like this)."""
    return max(d for d in range(1, int(n**0.5) + 1) if n % d == 0)


def _draw(kind: str, shape: tuple[int, int], rank: int, scale: float, spread: float, g: Any) -> dict:
    """Random tensors of one adapter (LyCORIS' suffixes without the module key; LoRA's as 'up'/'down')
    whose delta entries have standard deviation about `spread` once ComfyUI's scale is applied."""
    out, in_features = shape
    a, b = _small_factor(out), _small_factor(in_features)
    c, d = out // a, in_features // b

    def randn(*size: int, std: float) -> torch.Tensor:
        return torch.randn(*size, generator=g) * std

    if kind == "lora":  # entries of up @ down: std rank**0.5 * s**2
        s = (spread / (scale * rank**0.5)) ** 0.5
        return {"up": randn(out, rank, std=s), "down": randn(rank, in_features, std=s)}
    if kind == "loha":  # (w1a @ w1b) * (w2a @ w2b): std rank * s**4
        s = (spread / (scale * rank)) ** 0.25
        return {
            ".hada_w1_a": randn(out, rank, std=s), ".hada_w1_b": randn(rank, in_features, std=s),
            ".hada_w2_a": randn(out, rank, std=s), ".hada_w2_b": randn(rank, in_features, std=s),
        }  # fmt: skip
    if kind == "lokr":  # kron(w1, w2_a @ w2_b): std rank**0.5 * s**3
        s = (spread / (scale * rank**0.5)) ** (1 / 3)
        return {
            ".lokr_w1": randn(a, b, std=s),
            ".lokr_w2_a": randn(c, rank, std=s),
            ".lokr_w2_b": randn(rank, d, std=s),
        }
    if kind == "lokr_full":  # kron(w1, w2), scale 1 whatever alpha says
        s = spread**0.5
        return {".lokr_w1": randn(a, b, std=s), ".lokr_w2": randn(c, d, std=s)}
    if kind == "lokr_both":  # kron(w1_a @ w1_b, w2_a @ w2_b): std rank * s**4
        s = (spread / (scale * rank)) ** 0.25
        return {
            ".lokr_w1_a": randn(a, rank, std=s), ".lokr_w1_b": randn(rank, b, std=s),
            ".lokr_w2_a": randn(c, rank, std=s), ".lokr_w2_b": randn(rank, d, std=s),
        }  # fmt: skip
    if kind == "diff":
        return {".diff": randn(out, in_features, std=spread)}
    raise ValueError(f"kind='{kind}' is not one of {LORA_KINDS}")


def _cycle(value: Any, i: int) -> Any:
    return value[i % len(value)] if isinstance(value, list | tuple) else value


def write_random_lora(
    path: str | Path,
    config: dict[str, Any],
    fmt: str,
    *,
    kind: str | list[str] | tuple[str, ...] = "lora",
    dora: str | list[str | None] | tuple[str | None, ...] | None = None,
    bias: bool = False,
    rank: int = 4,
    seed: int = 0,
    alpha: float | None = 2.0,
    targets: list[str] | tuple[str, ...] | None = None,
    relative: float = 0.1,
    family: str = "flux1",
) -> str:
    """A random LoRA for the `family` model of `config` saved as safetensors in format `fmt`; returns the path.

    `targets`: BFL module names such as 'double_blocks.0.img_attn.qkv' (default every linear). Module keys:
    * "bfl":     `diffusion_model.<module>`, one adapter per BFL module;
    * "kohya":   `lora_unet_<module with . as _>`, one adapter per BFL module;
    * "bare":    `<module>`, one adapter per BFL module (Qwen-Image's format);
    * "peft":    `transformer.<diffusers module>` (lora_A / lora_B for LoRA);
    * "lycoris": `lycoris_<diffusers module with . as _>`;
    the diffusers formats hold one adapter per diffusers module of the targets (a fused qkv is three), drawn
    per diffusers module, except plain LoRA in "peft" (below).
    `kind` (one of LORA_KINDS, or a list cycled over the modules in sorted order) and `dora` (None, one of
    DORA_AXES, or a list cycled likewise; a "diff" module gets none) choose each module's adapter; `alpha` is written for every factored
    kind (alpha=None: none, scale 1); `bias` adds a `.diff_b` where the model has a bias and ComfyUI maps
    one (every BFL module; unfused diffusers modules only).

    Plain LoRA ("lora", no DoRA, no bias) in "bfl", "kohya" and "peft" is drawn once per BFL module: "peft"
    splits `up` per diffusers module (qkv -> to_q/to_k/to_v, linear1 -> to_q/to_k/to_v/
    proj_mlp, the final AdaLN's (shift, scale) rows swapped into diffusers' (scale, shift)) and "peft"
    writes no alpha (ComfyUI then scales by 1, so alpha / rank is folded into lora_B): one seed gives the
    same effective delta in every format (bit for bit when alpha / rank is a power of two, as the default
    2 / 4 is). `relative` sizes the delta's spread against the random builders' weights (std 0.05): 0.1
    changes outputs visibly without swamping them; DoRA's magnitudes are the builders' row or column norms
    times 1 + `relative` x N(0, 1).
    """
    from safetensors.torch import save_file

    if fmt not in LORA_FORMATS:
        raise ValueError(f"fmt='{fmt}' is not one of {LORA_FORMATS}")
    fam = get_family(family)
    names = sorted(targets) if targets is not None else lora_targets(config, family)
    plain = kind == "lora" and dora is None and not bias
    if fmt in ("bfl", "kohya", "bare") or (fmt == "peft" and plain):
        return _write_bfl_drawn(path, config, fmt, fam, names, rank, seed, alpha, relative, kind, dora, bias)
    sources = fam.sources(config)
    modules = sorted(
        p.removesuffix(".weight")
        for p, s in sources.items()
        if p.endswith(".weight") and s.key.removesuffix(".weight") in names
        and len(fam.parameter_shapes(config)[p]) == 2
    )  # fmt: skip
    shapes = fam.parameter_shapes(config)
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for i, module in enumerate(modules):
        key = f"transformer.{module}" if fmt == "peft" else "lycoris_" + module.replace(".", "_")
        unfused = sources[f"{module}.weight"].rows is None
        has_bias = unfused and f"{module}.bias" in shapes
        tensors.update(
            _adapter(key, fmt, tuple(shapes[f"{module}.weight"]), _cycle(kind, i), _cycle(dora, i),
                     bias and has_bias, rank, alpha, relative, g)
        )  # fmt: skip
    save_file(tensors, str(path))
    return str(path)


def _adapter(
    key: str,
    fmt: str,
    shape: tuple[int, ...],
    kind: str,
    dora: str | None,
    bias: bool,
    rank: int,
    alpha: float | None,
    relative: float,
    g: Any,
) -> dict[str, torch.Tensor]:
    """One module's tensors under `key` in format `fmt`."""
    out, in_features = shape
    factored = kind in ("lora", "loha", "lokr", "lokr_both")
    scale = alpha / rank if alpha is not None and factored else 1.0
    drawn = _draw(kind, (out, in_features), rank, scale, relative * 0.05, g)
    up, down = (
        (".lora_B.weight", ".lora_A.weight") if fmt == "peft" else (".lora_up.weight", ".lora_down.weight")
    )
    names = {"up": up, "down": down}
    tensors = {key + names.get(role, role): t.contiguous() for role, t in drawn.items()}
    if alpha is not None and kind != "diff":
        tensors[f"{key}.alpha"] = torch.tensor(float(alpha))
    if dora is not None and kind != "diff":  # ComfyUI applies no DoRA to a difference
        if dora not in DORA_AXES:
            raise ValueError(f"dora='{dora}' is not one of {DORA_AXES} or None")
        norm = 0.05 * (in_features if dora == "output" else out) ** 0.5
        size = (out, 1) if dora == "output" else (1, in_features)
        tensors[f"{key}.dora_scale"] = norm * (1 + relative * torch.randn(*size, generator=g))
    if bias:
        tensors[f"{key}.diff_b"] = torch.randn(out, generator=g) * relative * 0.05
    return tensors


def _write_bfl_drawn(
    path: str | Path,
    config: dict[str, Any],
    fmt: str,
    fam: Any,
    names: list[str],
    rank: int,
    seed: int,
    alpha: float | None,
    relative: float,
    kind: Any,
    dora: Any,
    bias: bool,
) -> str:
    """Adapters drawn once per BFL module, written under BFL, kohya or bare keys (or, plain LoRA, split per
    diffusers module under `transformer.`)."""
    from safetensors.torch import save_file

    shapes = fam.bfl_shapes(config)
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    if fmt in ("bfl", "kohya", "bare"):
        for i, name in enumerate(names):
            prefix = {"bfl": "diffusion_model.", "kohya": "lora_unet_", "bare": ""}[fmt]
            key = prefix + (name.replace(".", "_") if fmt == "kohya" else name)
            has_bias = f"{name}.bias" in shapes
            tensors.update(
                _adapter(key, fmt, tuple(shapes[f"{name}.weight"]), _cycle(kind, i), _cycle(dora, i),
                         bias and has_bias, rank, alpha, relative, g)
            )  # fmt: skip
        save_file(tensors, str(path))
        return str(path)
    scale = 1.0 if alpha is None else alpha / rank
    # each factor entry ~ N(0, sigma^2): delta entries have std scale * sqrt(rank) * sigma^2
    sigma = (relative * 0.05 / (scale * rank**0.5)) ** 0.5
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name in names:
        out_features, in_features = shapes[f"{name}.weight"]
        up = torch.randn(out_features, rank, generator=g) * sigma
        down = torch.randn(rank, in_features, generator=g) * sigma
        factors[name] = (up, down)
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
    "DORA_AXES",
    "FP8_MAX",
    "LORA_FORMATS",
    "LORA_KINDS",
    "MIXED_FORMS",
    "lora_targets",
    "quantize_fp8",
    "save_mixed_checkpoint",
    "write_random_lora",
]
