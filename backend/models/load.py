"""Each rank fills ComfyUI's (meta, plan-sharded) model with its own slices of the file: `fill_weights`.

The reading rules are the pack's, shared with the diffusers engine (backend/checkpoint/load.py
`read_tensor`): safetensors' lazy slices, only this rank's rows / columns of every (fused) stored tensor
read, every value checked for NaN / inf where it lands, fp8 converted with a range check. Which dtype a
parameter is held in is the same rule too (`held_dtype`): a linear layer's weight stored fp8 stays fp8 unless
the load asks otherwise ('fp8_*' converts every linear weight, 'compute' upcasts), and ComfyUI's
`manual_cast` ops (which build.py gets whenever a weight may differ from the compute dtype) upcast it per
layer, as in ComfyUI; everything else is held in the compute dtype, except what ComfyUI's class builds in
float32 whatever the model's dtype (Wan's patch embedding), which stays float32 as in ComfyUI.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from ..checkpoint.files import StoredTensor
from ..checkpoint.load import read_tensor, resident_dtype
from ..parallel.splits import Pieces


def held_dtype(
    module: nn.Module,
    param: str,
    stored: StoredTensor,
    weight_dtype: str,
    compute: torch.dtype,
    built: torch.dtype | None = None,
) -> torch.dtype:
    """The dtype a parameter read from `stored` is held in: the pack's rule (checkpoint/load.py
    `resident_dtype`), a linear layer's weight per `weight_dtype` ('default': fp8 stays fp8, 'fp8_*':
    converted, 'compute': upcast), everything else in the compute dtype, except a parameter ComfyUI's class
    builds (`built`: its meta dtype) in float32 whatever the model's dtype: Wan's patch embedding, a Conv3d
    ComfyUI runs on x.float() and its loader copies the file into, so it stays float32 as in ComfyUI."""
    linear_weight = isinstance(module, nn.Linear) and param == "weight"
    if built == torch.float32 and not linear_weight:
        return torch.float32
    return resident_dtype(stored, linear_weight, weight_dtype, compute)


def fill_weights(
    model: nn.Module,
    sources: Mapping[str, StoredTensor],
    pieces: Mapping[str, Pieces | None],
    weight_dtype: str,
    compute: torch.dtype,
    device: torch.device,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Replace every meta parameter of `model` by this rank's `pieces` of its stored tensor (`sources`: the
    parameter's tensor in the file, build.py), read onto `device`. `progress(done, total)` after each."""
    parameters = list(model.named_parameters())
    with torch.no_grad():
        for done, (name, meta) in enumerate(parameters, 1):
            module_name, _, param = name.rpartition(".")
            module = model.get_submodule(module_name) if module_name else model
            dtype = held_dtype(module, param, sources[name], weight_dtype, compute, meta.dtype)
            tensor = read_tensor(sources[name], pieces.get(name), dtype, device)
            if tuple(tensor.shape) != tuple(meta.shape):  # the plan and the model disagree: a bug
                raise RuntimeError(
                    f"{name}: read {tuple(tensor.shape)} but the model expects {tuple(meta.shape)}"
                )
            setattr(module, param, nn.Parameter(tensor, requires_grad=False))
            if progress is not None:
                progress(done, len(parameters))
    left = [n for n, b in model.named_buffers() if b.is_meta]
    if left:
        raise RuntimeError(f"buffers still on the meta device after the load: {', '.join(left[:5])}")


__all__ = ["fill_weights", "held_dtype"]
