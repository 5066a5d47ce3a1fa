"""`apply_loras`: set each rank's shard to checkpoint + LoRAs, the way ComfyUI's LoraLoaderModelOnly does.

ComfyUI (comfy/model_patcher.py `patch_weight_to_device`, comfy/lora.py `calculate_weight`) copies each
patched weight to float32, applies its patches in the order the LoRAs were added, and casts the result back
(rounding stochastically where this rounds to nearest). Here each rank does the same on its shard:

* the parameter's shard is re-read from the checkpoint (never taken from the model, which may hold earlier
  LoRAs: adding then subtracting a delta in bf16 does not give the weight back, so "no LoRA" is
  bit-identical to a fresh load only this way);
* each patch adds only the shard's rows and columns of its delta (`AdapterKind.block` reads just those
  factor rows and columns), so no rank builds a whole delta for an additive patch;
* DoRA needs norms over whole rows (dora_scale [out, 1]) or whole columns ([1, in]) of the weight ComfyUI
  patches (a fused BFL tensor may be several diffusers parameters). When the shard has them, they are
  computed from the shard. When it does not (a row-parallel shard and a row norm; a column-parallel shard,
  or a module spanning several parameters, and a column norm), that module's whole current weight is
  rebuilt from the checkpoint and the patches before this one (`_full`, `_module_weight`): one layer's
  full weight and delta at a time, and each column norm once per rank (cached).

fp8-resident weights (load_model(weight_dtype=...)): a patched weight is held in the compute dtype, not
cast back to fp8. fp8 keeps 3 (e4m3fn) or 2 (e5m2) mantissa bits, far coarser than a LoRA delta (ComfyUI
keeps fp8 and rounds stochastically, which is right only on average). So a patched tensor equals the
same LoRA on an upcast-at-load model bit for bit, and costs the compute dtype's bytes: a LoRA touching
every linear gives up the fp8 saving for the tensors it touches (the status' parameter_bytes shows it).
Removing the LoRA re-reads those tensors in fp8 again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from ...parallel.tensor import Pieces, parameter_pieces
from ...parallel.weights import compute_dtype, is_fp8, is_held_quantized, linear_weight
from ..info import CheckpointInfo
from ..load import full_shape, parameter_dtype, read_parameter
from .calltime import CallTimePatch, ResidentFile, rounded_as_stored
from .dora import decompose, input_norm, output_norm
from .kinds import KINDS
from .reading import read_cols, read_rows
from .records import LoraError, LoraInfo, LoraModule, LoraTarget, Segments

Runs = list[tuple[int, int, int]]  # (row of the tensor being patched, weight row, rows)


@dataclass(frozen=True)
class Patch:
    """One module's patch on one parameter; `order` is its place in ComfyUI's sequence (LoRA, then module)."""

    order: int
    file: Any  # the open LoRA file
    module: LoraModule
    target: LoraTarget
    strength: float


def shard_runs(segments: Segments, pieces: Pieces | None) -> Runs:
    """The target's segments as rows of this rank's shard: (shard row, weight row, rows)."""
    if pieces is None or pieces.dim == 1:  # every row is here
        return list(segments)
    runs, local = [], 0
    for a, b in pieces.ranges:
        for param_row, weight_row, n in segments:
            lo, hi = max(a, param_row), min(b, param_row + n)
            if lo < hi:
                runs.append((local + lo - a, weight_row + lo - param_row, hi - lo))
        local += b - a
    return runs


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class Patcher:
    """This rank's view of the patches: which apply to each parameter, in order, and how to compute them."""

    def __init__(
        self,
        model: nn.Module,
        info: CheckpointInfo,
        active: Sequence[tuple[LoraInfo, float]],
        files: dict[str, Any],
        rank: int,
        degree: int,
    ) -> None:
        self.model, self.info, self.rank, self.degree = model, info, rank, degree
        self.active = active
        self.resolved = info.model_family.tp.resolve(model)
        self.params = dict(model.named_parameters())
        self.compute = compute_dtype(model)
        self.patches: dict[str, list[Patch]] = {}
        order = 0
        for lora, strength in active:
            for module in lora.modules:
                for target in module.targets:
                    patch = Patch(order, files[lora.path], module, target, strength)
                    self.patches.setdefault(target.param, []).append(patch)
                order += 1
        self.names = {id(f): path for path, f in files.items()}
        self._column_norms: dict[int, torch.Tensor] = {}
        self._output_norms: dict[tuple[Any, ...], torch.Tensor] = {}

    def pieces(self, name: str) -> Pieces | None:
        stored, rows = self.info.sources[name]
        return parameter_pieces(
            self.resolved, name, full_shape(stored, rows), self.rank, self.degree, self.info.dims
        )

    def set(self, name: str) -> None:
        """Parameter `name` := its checkpoint shard plus its patches, in its resident dtype."""
        param = self.params[name]
        if _quantized(self.model, name):
            self.set_call_time(name)
            return
        stored, _ = self.info.sources[name]
        pieces = self.pieces(name)
        resident = parameter_dtype(self.model, stored, name, self.compute)
        patches = self.patches.get(name, [])
        if not patches:  # back to exactly what the loader read
            fresh = read_parameter(self.info, name, pieces, resident, param.device)
        else:
            fresh = read_parameter(self.info, name, pieces, torch.float32, param.device)
            for patch in patches:
                self.apply(fresh, name, pieces, patch)
            fresh = rounded_as_stored(stored, fresh)
            fresh = fresh.to(self.compute if is_fp8(resident) else resident)
            if not bool(torch.isfinite(fresh).all()):  # check_loras bounds this; a file changed since?
                self._not_finite(name, patches, fresh.dtype)
        if fresh.shape != param.shape:  # the plan and the model disagree: a bug, not bad input
            raise RuntimeError(
                f"{name}: re-read {tuple(fresh.shape)} but the model holds {tuple(param.shape)}"
            )
        if fresh.dtype == param.dtype:
            param.copy_(fresh)
        else:  # fp8 <-> compute dtype: a new parameter (its module upcasts whichever it holds)
            module_name, _, pname = name.rpartition(".")
            setattr(self.model.get_submodule(module_name), pname, nn.Parameter(fresh, requires_grad=False))

    def set_call_time(self, name: str) -> None:
        """A GGUF weight held quantized: its patches run on the dequantized weight at every call
        (calltime.py); checked once here as the result of a dense patch is."""
        module = self.model.get_submodule(name.rpartition(".")[0])
        patches = self.patches.get(name, [])
        module.weight_patch = CallTimePatch(self, name, self.pieces(name), patches) if patches else None
        if patches:
            patched = linear_weight(module, self.compute)
            if not bool(torch.isfinite(patched).all()):
                self._not_finite(name, patches, patched.dtype)

    def _not_finite(self, name: str, patches: list[Patch], dtype: torch.dtype) -> None:
        files = sorted({self.names[id(p.file)] for p in patches})
        raise LoraError(
            f"the LoRAs {files} make '{name}' hold inf or NaN in {str(dtype).removeprefix('torch.')} on rank "
            f"{self.rank}; lower their strengths, or check that the files did not change since they were checked"
        )

    # ----------------------------------------------------------------------------------------------
    # One patch

    def apply(self, weight: torch.Tensor, name: str, pieces: Pieces | None, patch: Patch) -> None:
        """Apply `patch` in place to `weight`, parameter `name`'s `pieces` (None: the whole parameter)."""
        runs = shard_runs(patch.target.segments, pieces)
        if not runs:
            return
        cols = pieces.ranges if pieces is not None and pieces.dim == 1 else None
        module, kind = patch.module, KINDS[patch.module.kind]
        if not module.dora:  # ComfyUI: weight += (strength * scale) * lora_diff
            block = kind.block(patch.file, module, [(w, w + n) for _, w, n in runs], cols, weight.device)
            delta = (patch.strength * module.scale) * block
            offset = 0
            for row, _, n in runs:
                weight[row : row + n] += delta[offset : offset + n]
                offset += n
            return
        runs.sort(key=lambda run: run[1])  # weight order: the order ComfyUI's column norm sums in
        rows = [(w, w + n) for _, w, n in runs]
        current = _cat([weight[row : row + n] for row, _, n in runs])
        lora_diff = kind.block(patch.file, module, rows, cols, weight.device)
        dora_key = module.tensor("dora_scale")
        if module.dora == "output":
            dora_scale = read_rows(patch.file, dora_key, rows, weight.device)
        else:
            dora_scale = read_cols(patch.file, dora_key, cols, weight.device)
        norm = self._norm(name, pieces, patch, runs, cols)
        new = decompose(current, lora_diff, module.scale, dora_scale, patch.strength, module.dora, norm)
        offset = 0
        for row, _, n in runs:
            weight[row : row + n] = new[offset : offset + n]
            offset += n

    def _norm(
        self,
        name: str,
        pieces: Pieces | None,
        patch: Patch,
        runs: Runs,
        cols: Sequence[tuple[int, int]] | None,
    ) -> torch.Tensor | None:
        """DoRA's norms for these rows or columns when the shard lacks what they need; None when it has it."""
        module = patch.module
        if module.dora == "output":
            if cols is None:  # whole rows are here
                return None
            # A row-parallel shard holds some columns of each row: rebuild the whole rows (every row of a
            # dim-1 shard is here, so its rows are the parameter's rows). Kept: a call-time patch asks
            # for the same norm at every call, and the weights it is made of never change.
            key = (name, patch.order, tuple(runs))
            if key not in self._output_norms:
                full = self._full(name, patch.order)
                self._output_norms[key] = output_norm(_cat([full[row : row + n] for row, _, n in runs]))
            return self._output_norms[key]
        whole_rows = pieces is None or pieces.dim == 1
        if whole_rows and module.targets == (patch.target,) and sum(n for *_, n in runs) == module.shape[0]:
            return None  # every row of the module is in this shard
        norms = self._column_norm(patch)
        return norms if cols is None else torch.cat([norms[:, c:d] for c, d in cols], 1)

    # ----------------------------------------------------------------------------------------------
    # Whole tensors, for DoRA norms a shard cannot compute alone

    def _full(self, name: str, before: int) -> torch.Tensor:
        """Parameter `name`, whole, as float32, with the patches ordered before `before` applied."""
        weight = read_parameter(self.info, name, None, torch.float32, self.params[name].device)
        for patch in self.patches.get(name, []):
            if patch.order >= before:
                break
            self.apply(weight, name, None, patch)
        return weight

    def _module_weight(self, patch: Patch) -> torch.Tensor:
        """The tensor ComfyUI patches with `patch`'s module (its weight rows), as it is before the patch."""
        module = patch.module
        out = torch.empty(module.shape, dtype=torch.float32, device=self.params[patch.target.param].device)
        covered = 0
        for target in module.targets:
            full = self._full(target.param, patch.order)
            for param_row, weight_row, n in target.segments:
                out[weight_row : weight_row + n] = full[param_row : param_row + n]
                covered += n
            del full
        if covered != module.shape[0]:  # names.py maps every row of a module: a bug, not bad input
            raise RuntimeError(f"{module.key}: its targets cover {covered} of {module.shape[0]} rows")
        return out

    def _column_norm(self, patch: Patch) -> torch.Tensor:
        """[1, in]: the column norms of the module's weight + scale * delta (ComfyUI's weight_calc)."""
        if patch.order not in self._column_norms:
            module = patch.module
            weight_calc = self._module_weight(patch)
            kind = KINDS[module.kind]
            lora_diff = kind.block(patch.file, module, [(0, module.shape[0])], None, weight_calc.device)
            lora_diff *= module.scale
            weight_calc += lora_diff
            del lora_diff
            self._column_norms[patch.order] = input_norm(weight_calc)
        return self._column_norms[patch.order]


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
    """Set each parameter in `restore` or patched by `loras` to its checkpoint value plus the patches.

    `model` holds this rank's shard (`degree` > 1: tensor-parallel rank `rank`) of checkpoint `info`.
    Each affected parameter is re-read from the checkpoint, the LoRAs' patches for this rank's slice are
    applied in order in float32 (ComfyUI's formulas, module docstring), and the result is cast to the
    parameter's dtype and copied into it (an fp8-resident weight is replaced by one in the compute dtype).
    `restore` names parameters patched before that must go back to the checkpoint's values (pass the
    previous return value). `progress(done, total)` runs after each tensor. Returns the parameters that
    now hold patches.
    """
    active = [(lora, strength) for lora, strength in loras if strength != 0.0]
    patched = frozenset(p for lora, _ in active for p in lora.params)
    todo = sorted(patched | set(restore))
    if not todo:
        return patched
    with contextlib.ExitStack() as stack, torch.no_grad():
        files = {lora.path: stack.enter_context(safe_open(lora.path, "pt")) for lora, _ in active}
        patcher = Patcher(model, info, active, files, rank, degree)
        call_time = _call_time_patcher(patcher, files, todo)
        for done, name in enumerate(todo, 1):
            (call_time if call_time is not None and _quantized(model, name) else patcher).set(name)
            if progress is not None:
                progress(done, len(todo))
    return patched


def _quantized(model: nn.Module, name: str) -> bool:
    module_name, _, pname = name.rpartition(".")
    return pname == "weight" and is_held_quantized(model.get_submodule(module_name))


def _call_time_patcher(patcher: Patcher, files: dict[str, Any], todo: Sequence[str]) -> Patcher | None:
    """`patcher`'s twin that the quantized weights' call-time patches keep (calltime.py): it reads the LoRAs
    from copies in host memory, since the files close here. None when no quantized weight is patched."""
    if not any(_quantized(patcher.model, name) for name in todo):
        return None
    resident = {
        lora.path: ResidentFile(files[lora.path], {key for m in lora.modules for _, key in m.tensors})
        for lora, _ in patcher.active
    }
    return Patcher(patcher.model, patcher.info, patcher.active, resident, patcher.rank, patcher.degree)


__all__ = ["Patch", "Patcher", "apply_loras", "shard_runs"]
