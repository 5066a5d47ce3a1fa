"""LoRAs on a rank's shard, computed by ComfyUI's own LoRA code: `apply_loras`.

What ComfyUI's LoraLoaderModelOnly does (`comfy.sd.load_lora_for_models`: `lora.model_lora_keys_unet` on the
model, `lora_convert.convert_lora`, `lora.load_lora`, `ModelPatcher.add_patches`) builds the patches here,
on ComfyUI's model of the file; then, for each patched weight, what `ModelPatcher.patch_weight_to_device`
does (the whole stored weight in ComfyUI's LoRA compute dtype, `lora.calculate_weight`, rounding back with
`float.stochastic_rounding` seeded by the key) runs on the whole stored tensor, and the rank keeps its plan
slice of the result. So every adapter kind ComfyUI applies (LoRA, LoHa, LoKr, `.diff` on norms and
embeddings, `.diff_b`, `.set_weight`, ...) is applied with ComfyUI's numbers, and the patched slice equals
the same slice of ComfyUI's patched weight, fp8 included. The cost: each rank reads the whole stored tensor
of every patched weight once (one at a time, then dropped).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ..checkpoint.files import StoredTensor
from ..checkpoint.load import read_tensor
from ..checkpoint.lora.records import LoraError
from ..parallel.splits import Pieces
from ..runtime.redact import quoted

PREFIX = "diffusion_model."  # ComfyUI's model keys: the BaseModel's state dict names its diffusion model so
Patches = dict[str, list[tuple[Any, ...]]]


def lora_patches(
    key_map: Mapping[str, Any], names: Iterable[str], loras: Iterable[tuple[str, float]], model: str
) -> Patches:
    """ComfyUI's patches of `loras` ((path, strength), in order) through ComfyUI's LoRA `key_map` of the model
    (build.py `MetaModel.lora_keys`): model key -> [(strength_patch, adapter, strength_model, offset,
    function), ...], as `ModelPatcher.add_patches` records them. `names`: the parameters of the whole (unsplit)
    diffusion model; a key ComfyUI does not load, or loads for no such parameter, refuses the LoRA by name
    (`model`: the class, for the message)."""
    import comfy.lora
    import comfy.lora_convert
    import comfy.utils

    model_keys = {PREFIX + n for n in names}
    patches: Patches = {}
    for path, strength in loras:
        with _NotLoaded() as missing:
            lora = comfy.lora_convert.convert_lora(comfy.utils.load_torch_file(path, safe_load=True))
            loaded = comfy.lora.load_lora(lora, dict(key_map))
        unused = list(missing.keys)
        for k, adapter in loaded.items():
            key, offset, function = (
                (k, None, None) if isinstance(k, str) else (k[0], k[1], (k[2:] or (None,))[0])
            )
            if key in model_keys:
                patches.setdefault(key, []).append((strength, adapter, 1.0, offset, function))
            else:
                unused.append(key)
        if unused:
            raise LoraError(
                f"LoRA {quoted(path)}: ComfyUI's LoRA loader applies {len(unused)} of its keys to nothing of "
                f"this {model} (e.g. {', '.join(map(repr, unused[:3]))}): the LoRA "
                "was made for another model"
            )
    return patches


class _NotLoaded(logging.Handler):
    """The keys ComfyUI's `lora.load_lora` reports it did not load (its warning 'lora key not loaded: <key>'):
    ComfyUI skips them; the pack refuses the file by name instead."""

    PREFIX = "lora key not loaded: "

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.keys: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(self.PREFIX):
            self.keys.append(message[len(self.PREFIX) :])

    def __enter__(self) -> _NotLoaded:
        logging.getLogger().addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger().removeHandler(self)


def patched_weight(
    key: str, stored: StoredTensor, patches: list[tuple[Any, ...]], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The whole stored weight patched as ComfyUI's `patch_weight_to_device` patches it, in `dtype`."""
    import comfy.float
    import comfy.lora
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.utils

    lora_dtype = getattr(mm, "lora_compute_dtype", None)  # 0.33.0; 0.3.75 patches in float32
    compute = lora_dtype(device) if lora_dtype is not None else torch.float32
    weight = read_tensor(stored, None, compute, device)
    out = comfy.lora.calculate_weight(patches, weight, key)
    # 0.33.0 has comfy.utils.string_to_seed; 0.3.75 keeps it in comfy.model_patcher
    seed = getattr(comfy.utils, "string_to_seed", None) or comfy.model_patcher.string_to_seed
    return comfy.float.stochastic_rounding(out, dtype, seed=seed(key))


def apply_loras(
    model: nn.Module,
    key_map: Mapping[str, Any],
    sources: Mapping[str, StoredTensor],
    pieces: Mapping[str, Pieces | None],
    loras: Iterable[tuple[str, float]],
    restore: Iterable[str] = (),
    progress: Callable[[int, int], None] | None = None,
) -> frozenset[str]:
    """Set the weights of `model` (ComfyUI's diffusion model, this rank's shard) to the file's plus `loras`
    (through ComfyUI's LoRA `key_map` of the whole model); the parameters in `restore` (what the previous set
    patched) are read back from the file first. Returns the parameters now patched. A rank lacking a patched
    parameter (a Rows bias, kept by the group's first rank) skips it."""
    held = dict(model.named_parameters())
    found = lora_patches(key_map, sources, loras, type(model).__name__) if loras else {}
    patches = {k.removeprefix(PREFIX): p for k, p in found.items()}
    todo = sorted((set(restore) | set(patches)) & set(held))
    with torch.no_grad():
        for done, name in enumerate(todo, 1):
            param = held[name]
            if name in patches:
                whole = patched_weight(PREFIX + name, sources[name], patches[name], param.dtype, param.device)
                part = pieces.get(name)
                value = whole if part is None else part.take(whole)
            else:
                value = read_tensor(sources[name], pieces.get(name), param.dtype, param.device)
            param.copy_(value)
            if progress is not None:
                progress(done, len(todo))
    return frozenset(patches) & frozenset(held)


__all__ = ["apply_loras", "lora_patches", "patched_weight"]
