"""LoRA key names -> what they patch in one checkpoint: the key formats ComfyUI maps for FLUX.

comfy/lora.py `model_lora_keys_unet` (0.3.75 and 0.33), for FLUX.1 and FLUX.2 (`model_base.Flux2` is a
`Flux`):
* BFL / ComfyUI: `diffusion_model.<BFL module>` (the whole BFL tensor, e.g. a fused `qkv`), plus
  `diffusion_model.single_blocks.N.linear1_qkv` (ComfyUI narrows `linear1` to its first 3 x hidden rows);
* kohya / sd-scripts: `lora_unet_<BFL module with . as _>`;
* diffusers: `transformer.<diffusers module>`, `lora_transformer_` (OneTrainer) and `lycoris_`
  (SimpleTuner) with _ for . (comfy/utils.py `flux_to_diffusers`): ComfyUI narrows the fused BFL tensor
  to the diffusers module's rows (`to_q` of `qkv`), or, for `norm_out.linear`, patches the whole BFL
  tensor with the delta's halves swapped (its `swap_scale_shift`).
A module key is followed by an adapter's suffix (kinds.py). Text-encoder keys are skipped, as ComfyUI's
model-only loader does.

Biases (`.diff_b`): ComfyUI patches `<its target key minus .weight>.bias`. Where its target is a narrowed
or reordered tensor (`linear1_qkv`, a diffusers part of a fused tensor, `norm_out.linear`) that name is not
a string and the bias patch is dropped (logged "NOT LOADED"): `Slot.bias` is None there, and parse.py
refuses the key instead of dropping it silently.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from ..info import CheckpointInfo
from ..load import full_shape
from .kinds import CONV_ONLY, KINDS, REFUSED, SHARED_ROLES
from .records import LoraTarget, Segments

TEXT_ENCODER_PREFIXES = ("lora_te", "text_encoder", "lora_clip", "clip_l.", "t5xxl.")
LOOKED_FOR = (
    "'diffusion_model.*', 'lora_unet_*', 'transformer.*', 'lycoris_*' with LoRA, LoHa, LoKr or .diff tensors"
)

Rows = tuple[tuple[int, int], ...] | None


@dataclass(frozen=True)
class Slot:
    """What one module key patches in this checkpoint: ComfyUI's tensor (its `shape`), where its rows land
    (`targets`), where the file's delta rows go (`delta_rows`), and the bias targets (`.diff_b`): () when the
    model has no bias there, None when ComfyUI maps no bias for this key."""

    format: str  # "bfl", "kohya" or "diffusers"
    shape: tuple[int, int]
    targets: tuple[LoraTarget, ...]
    delta_rows: Segments
    bias: tuple[LoraTarget, ...] | None


def _identity(rows: int) -> Segments:
    return ((0, 0, rows),)


def _targets(parts: list[tuple[str, Rows]], lo: int, hi: int, shapes: Mapping[str, tuple[int, ...]]) -> tuple:
    """The parameters among `parts` (each: the BFL rows it is made of) that rows [lo, hi) of the BFL tensor
    reach, with their segments (param row, weight row counted from lo, rows)."""
    out = []
    for param, rows in parts:
        offset, segments = 0, []
        for a, b in rows or ((0, shapes[param][0]),):
            start, stop = max(a, lo), min(b, hi)
            if start < stop:
                segments.append((offset + start - a, start - lo, stop - start))
            offset += b - a
        if segments:
            out.append(LoraTarget(param, tuple(segments)))
    return tuple(out)


def _bfl_rows(parts: list[tuple[str, Rows]], shapes: Mapping[str, tuple[int, ...]]) -> int:
    return sum(b - a for param, rows in parts for a, b in (rows or ((0, shapes[param][0]),)))


def slot_table(info: CheckpointInfo) -> dict[str, Slot]:
    """Module key -> Slot, for every key format ComfyUI maps for this checkpoint's model."""
    shapes = {name: full_shape(stored, rows) for name, (stored, rows) in info.sources.items()}
    sources = info.model_family.sources(info.config)
    weights: dict[str, list[tuple[str, Rows]]] = {}  # BFL module -> its diffusers weights (and rows)
    biases: dict[str, list[tuple[str, Rows]]] = {}
    for param, source in sources.items():
        if param.endswith(".weight") and len(shapes[param]) == 2:
            weights.setdefault(source.key.removesuffix(".weight"), []).append((param, source.rows))
        elif param.endswith(".bias"):
            biases.setdefault(source.key.removesuffix(".bias"), []).append((param, source.rows))
    table: dict[str, Slot] = {}
    for module, parts in weights.items():
        out, in_features = _bfl_rows(parts, shapes), shapes[parts[0][0]][1]
        bias = _targets(biases.get(module, []), 0, out, shapes)
        slot = Slot("bfl", (out, in_features), _targets(parts, 0, out, shapes), _identity(out), bias)
        table[f"diffusion_model.{module}"] = slot
        table["lora_unet_" + module.replace(".", "_")] = replace(slot, format="kohya")
        for prefix in info.model_family.lora_prefixes:  # e.g. Qwen-Image's bare module names
            table.setdefault(prefix + module, slot)
        if module.endswith(".linear1"):  # ComfyUI's partial key: the q|k|v rows of linear1
            qkv = 3 * info.dims.hidden
            targets = _targets(parts, 0, qkv, shapes)
            table[f"diffusion_model.{module}_qkv"] = Slot(
                "bfl", (qkv, in_features), targets, _identity(qkv), None
            )
    for param, source in sources.items():
        if not (param.endswith(".weight") and len(shapes[param]) == 2):
            continue
        module, (out, in_features) = param.removesuffix(".weight"), shapes[param]
        parts = weights[source.key.removesuffix(".weight")]
        if source.rows is None:  # the BFL tensor itself
            bias_name = f"{module}.bias"
            bias = (LoraTarget(bias_name, _identity(out)),) if bias_name in shapes else ()
            slot = Slot(
                "diffusers", (out, in_features), (LoraTarget(param, _identity(out)),), _identity(out), bias
            )
        elif sum(b - a for a, b in source.rows) == _bfl_rows(parts, shapes):
            # All of the BFL tensor, reordered: ComfyUI patches the BFL tensor with the delta reordered
            # back (swap_scale_shift): delta row d (this parameter's row) goes to BFL row a + d - o.
            (target,) = _targets([(param, source.rows)], 0, out, shapes)
            delta = tuple((weight, param_row, n) for param_row, weight, n in target.segments)
            slot = Slot("diffusers", (out, in_features), (target,), delta, None)
        else:  # a row range of the BFL tensor: ComfyUI narrows to it, so the module is this parameter
            slot = Slot(
                "diffusers", (out, in_features), (LoraTarget(param, _identity(out)),), _identity(out), None
            )
        for key in (
            f"transformer.{module}",
            "lora_transformer_" + module.replace(".", "_"),
            "lycoris_" + module.replace(".", "_"),
        ):
            table[key] = slot
    return table


def _suffixes() -> list[tuple[str, str, str]]:
    """(suffix, kind, role), longest first: '.diff_b' must win over '.diff', '.lora_B.weight' over '.lora_B'."""
    found = [
        (s, kind, role) for kind, k in KINDS.items() for role, spellings in k.roles.items() for s in spellings
    ]
    found += [(s, "", role) for role, s in SHARED_ROLES.items()]
    found += [(s, "conv", s) for s in CONV_ONLY] + [(s, "refused", s) for s in REFUSED]
    return sorted(found, key=lambda item: -len(item[0]))


SUFFIXES = _suffixes()


def split_key(key: str) -> tuple[str, str, str] | None:
    """(module key, kind, role) of a LoRA tensor key; kind "" for alpha / dora_scale, "conv" or "refused"
    for what the pack does not apply (role: the suffix); None when the key is no adapter tensor."""
    for suffix, kind, role in SUFFIXES:
        if key.endswith(suffix) and len(key) > len(suffix):
            return key[: -len(suffix)], kind, role
    return None


__all__ = ["LOOKED_FOR", "SUFFIXES", "TEXT_ENCODER_PREFIXES", "Slot", "slot_table", "split_key"]
