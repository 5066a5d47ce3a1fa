"""FLUX LoRAs on a sharded model: read a LoRA file, and set each rank's weights to checkpoint + deltas.

Key formats: the ones ComfyUI 0.3.64 maps for FLUX (`comfy/lora.py: model_lora_keys_unet`):
* BFL / ComfyUI: `diffusion_model.<BFL module>` (e.g. `diffusion_model.double_blocks.0.img_attn.qkv`),
  plus ComfyUI's `diffusion_model.single_blocks.N.linear1_qkv` (the q|k|v rows of `linear1` only);
* kohya / sd-scripts: `lora_unet_<BFL module with . as _>`;
* diffusers / PEFT: `transformer.<diffusers module>`, and `lora_transformer_` / `lycoris_` with _ for .;
each followed by one of ComfyUI's factor spellings (`.lora_up.weight`/`.lora_down.weight`,
`.lora_B.weight`/`.lora_A.weight`, ...) and an optional `.alpha`. Text-encoder keys (`lora_te*`,
`text_encoder*`) are skipped, as ComfyUI's model-only loader does.

The math is ComfyUI's (`comfy/weight_adapter/lora.py`): delta = strength * alpha / rank * up @ down in
float32 (scale 1 without alpha), added to the float32 weight, cast back to the weight's dtype. One
difference: ComfyUI rounds bf16/fp16 results stochastically, this rounds to nearest.

Why deltas are mapped to diffusers *parameters* with row ranges of `up`: the model is diffusers', and a
fused BFL target (`qkv`, `linear1 = [q|k|v|mlp]`, the final AdaLN's swapped (shift, scale)) feeds several
diffusers parameters, each from some rows of the BFL tensor (the family's `KeyLayout`, the one mapping).
FLUX.2 files are read the same way through FLUX.2's sources and TP plan: ComfyUI maps its LoRA keys as
FLUX.1's (comfy/model_base.py `Flux2` is a `Flux`, so comfy/lora.py's `diffusion_model.*` keys and the
`linear1_qkv` partial key apply), and `linear1` there is [q|k|v|gate|up].
A rank then needs only its shard of each delta: `up[its rows] @ down[:, its columns]`.

Why the weights are re-read from the checkpoint on every change instead of adding or subtracting deltas
on the resident weights: adding then subtracting a delta in bf16 does not give the original back, and
each change would drift further. Re-reading the affected slices (the loader's own `read_parameter`) and
applying the whole new set makes "no LoRA" bit-identical to a fresh load, whatever was applied before.

fp8-resident weights (load_model(weight_dtype=...)): a patched weight is held in the compute dtype, not
cast back to fp8. fp8 keeps 3 (e4m3fn) or 2 (e5m2) mantissa bits, far coarser than a LoRA delta (ComfyUI
keeps fp8 and rounds stochastically, which is right only on average). So a patched tensor equals the
same LoRA on an upcast-at-load model bit for bit, and costs the compute dtype's bytes: a LoRA touching
every linear gives up the fp8 saving for the tensors it touches (the status' parameter_bytes shows it).
Removing the LoRA re-reads those tensors in fp8 again.

`inspect_lora` reads headers (and the scalar alphas) only: the caller runs it before any worker starts.
`apply_loras` is what a worker calls.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from ..config import ConfigError
from ..parallel.tensor import Pieces, parameter_pieces, resolve_plan
from ..parallel.weights import compute_dtype, is_fp8
from .files import listing, starts_like_safetensors, truncation_detail
from .info import CheckpointInfo
from .load import compose, full_shape, parameter_dtype, read_parameter


class LoraError(ConfigError):
    """A LoRA that cannot be applied to this checkpoint; the message names the file, the key and the fix."""


# ComfyUI's spellings of a LoRA's two factors (weight_adapter/lora.py, LoRAAdapter.load): (up, down).
FACTOR_SUFFIXES: tuple[tuple[str, str], ...] = (
    (".lora_up.weight", ".lora_down.weight"),
    (".lora_B.weight", ".lora_A.weight"),
    ("_lora.up.weight", "_lora.down.weight"),
    (".lora.up.weight", ".lora.down.weight"),
    (".lora_B.default.weight", ".lora_A.default.weight"),
    (".lora_linear_layer.up.weight", ".lora_linear_layer.down.weight"),
    (".lora_B", ".lora_A"),
)
ALPHA_SUFFIX = ".alpha"
# Adapters ComfyUI applies that this module does not (yet): key fragment -> what it is.
UNSUPPORTED: tuple[tuple[str, str], ...] = (
    (".dora_scale", "DoRA"),
    (".lora_mid.weight", "LoCon (lora_mid)"),
    (".hada_", "LoHa"),
    (".lokr_", "LoKr"),
    (".oft_", "OFT"),
    (".diff_b", "bias difference"),
    (".diff", "full weight difference"),
    (".set_weight", "weight replacement"),
    (".w_norm", "norm difference"),
    (".b_norm", "norm difference"),
    (".reshape_weight", "reshaping (FLUX control LoRA)"),
)
TEXT_ENCODER_PREFIXES = ("lora_te", "text_encoder", "lora_clip", "clip_l.", "t5xxl.")
LOOKED_FOR = (
    "'diffusion_model.*', 'lora_unet_*', 'transformer.*' with lora_up/lora_down or lora_A/lora_B factors"
)


@dataclass(frozen=True)
class LoraTarget:
    """One diffusers parameter a LoRA module patches: its rows are the `up_rows` of the module's `up`,
    concatenated in this order (all of `up` for a plain linear; a part of it for a fused BFL tensor)."""

    param: str  # e.g. "transformer_blocks.0.attn.to_q.weight"
    up_rows: tuple[tuple[int, int], ...]


MAX_STRENGTH = 100.0  # ComfyUI's LoraLoader allows -100 to 100


@dataclass(frozen=True)
class LoraModule:
    """One LoRA pair in a file: delta(target) = scale * up[target.up_rows] @ down."""

    key: str  # the module's key in the file, e.g. "lora_unet_double_blocks_0_img_attn_qkv"
    up: str  # tensor keys
    down: str
    rank: int
    scale: float  # alpha / rank, or 1 without alpha (ComfyUI)
    targets: tuple[LoraTarget, ...]


@dataclass(frozen=True)
class LoraInfo:
    """What a LoRA file patches in one checkpoint, from its header (and alphas) alone."""

    path: str
    format: str  # "bfl", "kohya", "diffusers", or several joined by "+"
    modules: tuple[LoraModule, ...]
    skipped: tuple[str, ...]  # text-encoder keys, ignored as ComfyUI's model-only loader does

    @property
    def params(self) -> frozenset[str]:
        """The diffusers parameters this LoRA changes."""
        return frozenset(t.param for m in self.modules for t in m.targets)


# --------------------------------------------------------------------------------------------------
# Key names -> targets


def _name_table(info: CheckpointInfo) -> dict[str, tuple[str, tuple[LoraTarget, ...], tuple[int, int]]]:
    """LoRA module key -> (format, targets, the (out, in) shape its delta must have), for this checkpoint."""
    dims = info.dims
    shapes = {name: full_shape(stored, rows) for name, (stored, rows) in info.sources.items()}
    # BFL module -> [(diffusers param, rows of the BFL tensor)], from the one BFL <-> diffusers mapping.
    by_bfl: dict[str, list[tuple[str, tuple[tuple[int, int], ...] | None]]] = {}
    for param, source in info.model_family.sources(info.config).items():
        if param.endswith(".weight") and len(shapes[param]) == 2:
            by_bfl.setdefault(source.key.removesuffix(".weight"), []).append((param, source.rows))
    table: dict[str, tuple[str, tuple[LoraTarget, ...], tuple[int, int]]] = {}

    def bfl_entry(parts: list[tuple[str, tuple[tuple[int, int], ...] | None]], lo: int, hi: int) -> Any:
        targets = []
        for param, rows in parts:
            rows = rows or ((0, shapes[param][0]),)
            if all(lo <= a and b <= hi for a, b in rows):
                targets.append(LoraTarget(param, tuple((a - lo, b - lo) for a, b in rows)))
        return tuple(targets), (hi - lo, shapes[parts[0][0]][1])

    for module, parts in by_bfl.items():
        out = sum(b - a for p, rows in parts for a, b in (rows or ((0, shapes[p][0]),)))
        targets, shape = bfl_entry(parts, 0, out)
        table[f"diffusion_model.{module}"] = ("bfl", targets, shape)
        table["lora_unet_" + module.replace(".", "_")] = ("kohya", targets, shape)
        if module.endswith(".linear1"):  # ComfyUI's partial key: the q|k|v rows of linear1
            qkv = bfl_entry(parts, 0, 3 * dims.hidden)
            table[f"diffusion_model.{module}_qkv"] = ("bfl", *qkv)
    for param, shape in shapes.items():
        if param.endswith(".weight") and len(shape) == 2:
            module = param.removesuffix(".weight")
            entry = (LoraTarget(param, ((0, shape[0]),)),), (shape[0], shape[1])
            table[f"transformer.{module}"] = ("diffusers", *entry)
            table["lora_transformer_" + module.replace(".", "_")] = ("diffusers", *entry)
            table["lycoris_" + module.replace(".", "_")] = ("diffusers", *entry)
    return table


def _split(key: str) -> tuple[str, str] | None:
    """(module key, 'up' | 'down' | 'alpha') of a LoRA tensor key, or None when not a LoRA factor."""
    if key.endswith(ALPHA_SUFFIX):
        return key[: -len(ALPHA_SUFFIX)], "alpha"
    for up, down in FACTOR_SUFFIXES:
        if key.endswith(up):
            return key[: -len(up)], "up"
        if key.endswith(down):
            return key[: -len(down)], "down"
    return None


# --------------------------------------------------------------------------------------------------
# inspect_lora


def _check_file(path: Path) -> None:
    if not path.exists():
        parent = path.parent
        where = (
            f"'{parent}' has: {listing(parent)}. Pick one of those, or put the LoRA into that folder"
            if parent.is_dir()
            else f"nor does its folder '{parent}'; check the path"
        )
        raise LoraError(f"LoRA '{path}' does not exist; {where}")
    if path.is_dir():
        raise LoraError(f"LoRA '{path}' is a folder; pass the LoRA's .safetensors file")
    with open(path, "rb") as f:
        head = f.read(9)
    if not starts_like_safetensors(head, path.stat().st_size):
        raise LoraError(
            f"LoRA '{path}' is not a safetensors file ({truncation_detail(path)}); LoRAs are read from "
            ".safetensors files only. Download it again, or convert it with safetensors.torch.save_file"
        )


def inspect_lora(path: str | os.PathLike[str], info: CheckpointInfo) -> LoraInfo:
    """Which parameters of checkpoint `info` the LoRA at `path` patches, from its header and alphas only.

    Raises LoraError (a ConfigError) naming the file, the key, the shape found and the one expected.
    """
    path = Path(path).expanduser()
    _check_file(path)
    try:
        with safe_open(str(path), "pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            alphas = {k[: -len(ALPHA_SUFFIX)]: f.get_tensor(k) for k in shapes if k.endswith(ALPHA_SUFFIX)}
    except SafetensorError as err:
        raise LoraError(
            f"LoRA '{path}' is truncated or corrupt: {truncation_detail(path)}. Download or copy it again"
        ) from err
    skipped = tuple(sorted(k for k in shapes if k.startswith(TEXT_ENCODER_PREFIXES)))
    table = _name_table(info)
    found: dict[str, dict[str, str]] = {}  # module key -> {"up": tensor key, "down": ..., "alpha": ...}
    for key in sorted(shapes):
        if key in skipped:
            continue
        split = _split(key)
        module = split[0] if split else None
        if split is None or module not in table:
            found.setdefault("", {})[key] = key  # not (yet) understood; judged below
            continue
        found.setdefault(module, {})[split[1]] = key
    unknown = sorted(found.pop("", {}))
    if not found:
        _no_flux_keys(path, shapes, skipped)
    for key in unknown:
        _unknown_key(path, key, info)
    modules, formats = [], set()
    for module, parts in found.items():
        fmt, targets, (out_features, in_features) = table[module]
        if "up" not in parts or "down" not in parts:
            have, lack = ("up", "down") if "up" in parts else ("down", "up")
            raise LoraError(
                f"LoRA '{path}': '{parts.get(have, parts.get('alpha'))}' has no matching {lack} factor "
                f"for '{module}'; the file is incomplete. Download it again"
            )
        up, down = shapes[parts["up"]], shapes[parts["down"]]
        rank = down[0] if len(down) == 2 else -1
        for key, got, want in (
            (parts["down"], down, (rank, in_features)),
            (parts["up"], up, (out_features, rank)),
        ):
            if len(got) != 2 or rank < 1 or tuple(got) != want:
                raise LoraError(
                    f"LoRA '{path}': '{key}' has shape {list(got)} but this checkpoint's '{module}' needs "
                    f"{list(want)}; the LoRA was made for a different FLUX model"
                )
        scale = 1.0
        if module in alphas:
            alpha = float(alphas[module].float().reshape(-1)[0]) if alphas[module].numel() else math.nan
            if not math.isfinite(alpha):
                raise LoraError(f"LoRA '{path}': '{parts['alpha']}' is {alpha}, not a finite number")
            scale = alpha / rank
        modules.append(LoraModule(module, parts["up"], parts["down"], rank, scale, targets))
        formats.add(fmt)
    return LoraInfo(str(path), "+".join(sorted(formats)), tuple(modules), skipped)


def _no_flux_keys(path: Path, shapes: Mapping[str, Any], skipped: Sequence[str]) -> None:
    if skipped and len(skipped) == len(shapes):
        raise LoraError(
            f"LoRA '{path}' has only text-encoder keys ({len(skipped)}, e.g. '{skipped[0]}'), which "
            "ROCm Parallel does not apply: it patches the FLUX transformer only. Apply this LoRA to the "
            "CLIP/T5 model with ComfyUI's LoraLoader"
        )
    first = ", ".join(sorted(shapes)[:4]) or "none, the file is empty"
    raise LoraError(
        f"'{path}' has no FLUX LoRA keys (looked for {LOOKED_FOR}); it may be a LoRA for another model "
        f"(first keys: {first})"
    )


def _unknown_key(path: Path, key: str, info: CheckpointInfo) -> None:
    for fragment, kind in UNSUPPORTED:
        if fragment in key:
            raise LoraError(
                f"LoRA '{path}': '{key}' is a {kind} patch; ROCm Parallel applies plain LoRA factors "
                "(lora_up/lora_down or lora_A/lora_B, optional alpha) only. Use a plain LoRA file"
            )
    split = _split(key)
    if split is None:
        raise LoraError(
            f"LoRA '{path}': key '{key}' is not a LoRA factor (expected a name ending in .lora_up.weight, "
            ".lora_down.weight, .lora_A.weight, .lora_B.weight or .alpha); the file is not a plain LoRA"
        )
    raise LoraError(
        f"LoRA '{path}': '{key}' targets '{split[0]}', which this checkpoint "
        f"({info.dims.double_blocks} double + {info.dims.single_blocks} single blocks, "
        f"hidden {info.dims.hidden}) does not have; the LoRA was made for a different FLUX model"
    )


def check_loras(
    loras: Iterable[tuple[str | os.PathLike[str], float]], info: CheckpointInfo
) -> tuple[tuple[str, float], ...]:
    """Validate (path, strength) pairs against checkpoint `info`; returns them as (str, float) pairs.

    Runs in the caller's process: every file's header is read, nothing is applied.
    """
    out = []
    for i, item in enumerate(loras):
        try:
            path, strength = item
        except (TypeError, ValueError):
            raise LoraError(f"loras[{i}] is {item!r}; pass (path, strength) pairs") from None
        if isinstance(strength, bool) or not isinstance(strength, int | float) or not math.isfinite(strength):
            raise LoraError(
                f"LoRA '{path}': strength {strength!r} is not a finite number; use e.g. 1.0 "
                "(0 disables it, negative values invert it)"
            )
        if abs(strength) > MAX_STRENGTH:
            raise LoraError(
                f"LoRA '{path}': strength {strength!r} is beyond +-{MAX_STRENGTH:g} (ComfyUI's LoraLoader "
                "range; far beyond it the patched weights overflow to inf); use e.g. 1.0"
            )
        inspect_lora(path, info)
        out.append((str(path), float(strength)))
    return tuple(out)


# --------------------------------------------------------------------------------------------------
# Applying on a rank


def _cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def delta_slice(
    f: Any,
    module: LoraModule,
    target: LoraTarget,
    pieces: Pieces | None,
    strength: float,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """This rank's slice of one LoRA module's delta on one parameter, in float32, read from open file `f`.

    Only the factors' rows and columns the slice needs are read: `up` at the target's rows (those of this
    rank's rows for a row-split shard), `down` at this rank's columns for a column-split one.
    """
    up_rows = target.up_rows
    if pieces is not None and pieces.dim == 0:
        up_rows = tuple(compose(up_rows, pieces.ranges))
    up_slice, down_slice = f.get_slice(module.up), f.get_slice(module.down)
    up = _cat([up_slice[a:b].to(device, torch.float32) for a, b in up_rows], 0)
    if pieces is not None and pieces.dim == 1:
        down = _cat([down_slice[:, c:d].to(device, torch.float32) for c, d in pieces.ranges], 1)
    else:
        down = down_slice[:].to(device, torch.float32)
    # ComfyUI's order: (strength * alpha / rank) * (up @ down)
    return (strength * module.scale) * torch.mm(up, down)


def apply_loras(
    model: nn.Module,
    info: CheckpointInfo,
    loras: Sequence[tuple[LoraInfo, float]],
    *,
    restore: Iterable[str] = (),
    rank: int = 0,
    degree: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> frozenset[str]:
    """Set each parameter in `restore` or patched by `loras` to its checkpoint value plus the deltas.

    `model` holds this rank's shard (`degree` > 1: tensor-parallel rank `rank`) of checkpoint `info`.
    Each affected parameter is re-read from the checkpoint (never taken from the model, which may hold
    earlier deltas), the LoRAs' deltas for this rank's slice are added in order in float32, and the sum
    is cast to the parameter's dtype and copied into it (an fp8-resident weight is replaced by one in the
    compute dtype, see the module docstring). `restore` names parameters patched before
    that must go back to the checkpoint's values (pass the previous return value). `progress(done,
    total)` runs after each tensor. Returns the parameters that now hold deltas.
    """
    active = [(lora, strength) for lora, strength in loras if strength != 0.0]
    patched = frozenset(p for lora, _ in active for p in lora.params)
    todo = sorted(patched | set(restore))
    if not todo:
        return patched
    with contextlib.ExitStack() as stack, torch.no_grad():
        files = {lora.path: stack.enter_context(safe_open(lora.path, "pt")) for lora, _ in active}
        _apply(model, info, todo, active, files, rank, degree, progress)
    return patched


def _apply(
    model: nn.Module,
    info: CheckpointInfo,
    todo: list[str],
    active: list[tuple[LoraInfo, float]],
    files: Mapping[str, Any],
    rank: int,
    degree: int,
    progress: Callable[[int, int], None] | None,
) -> None:
    resolved = resolve_plan(model, info.model_family.tp.plan)
    params = dict(model.named_parameters())
    dims = info.dims
    compute = compute_dtype(model)
    by_param: dict[str, list[tuple[str, LoraModule, LoraTarget, float]]] = {}
    for lora, strength in active:
        for module in lora.modules:
            for target in module.targets:
                by_param.setdefault(target.param, []).append((lora.path, module, target, strength))
    for done, name in enumerate(todo, 1):
        param = params[name]
        stored, rows = info.sources[name]
        pieces = parameter_pieces(resolved, name, full_shape(stored, rows), rank, degree, dims)
        patches = by_param.get(name, [])
        resident = parameter_dtype(model, stored, name, compute)
        if not patches:  # back to exactly what the loader read
            fresh = read_parameter(info, name, pieces, resident, param.device)
        else:
            fresh = read_parameter(info, name, pieces, torch.float32, param.device)
            for path, module, target, strength in patches:
                delta = delta_slice(files[path], module, target, pieces, strength, param.device)
                _check_finite(delta, f"LoRA '{path}': the factors of '{module.key}' hold NaN or inf values; "
                              "the file is damaged or was saved from a broken training run: download it again")  # fmt: skip
                fresh += delta
            fresh = fresh.to(compute if is_fp8(resident) else resident)
            _check_finite(fresh, f"the LoRAs {sorted({p for p, *_ in patches})} at strengths "
                          f"{[s for *_, s in patches]} make '{name}' overflow {fresh.dtype} to inf; lower "
                          "the strengths")  # fmt: skip
        if fresh.shape != param.shape:  # the plan and the model disagree: a bug, not bad input
            raise RuntimeError(
                f"{name}: re-read {tuple(fresh.shape)} but the model holds {tuple(param.shape)}"
            )
        if fresh.dtype == param.dtype:
            param.copy_(fresh)
        else:  # fp8 <-> compute dtype: a new parameter (its module upcasts whichever it holds)
            module_name, _, pname = name.rpartition(".")
            setattr(model.get_submodule(module_name), pname, nn.Parameter(fresh, requires_grad=False))
        if progress is not None:
            progress(done, len(todo))


def _check_finite(tensor: torch.Tensor, message: str) -> None:
    """Refuse NaN/inf (one aminmax pass: NaN reaches both ends, an inf is one of them)."""
    if tensor.numel() and not all(math.isfinite(float(v)) for v in torch.aminmax(tensor.float())):
        raise LoraError(message)


__all__ = [
    "FACTOR_SUFFIXES",
    "MAX_STRENGTH",
    "LoraError",
    "LoraInfo",
    "LoraModule",
    "LoraTarget",
    "apply_loras",
    "check_loras",
    "delta_slice",
    "inspect_lora",
]
