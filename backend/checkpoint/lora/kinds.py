"""The adapter kinds ComfyUI applies that the pack applies too, by the name `LoraModule.kind` carries, and
the ones it refuses by name (with why)."""

from __future__ import annotations

from . import diff, loha, lokr, plain
from .records import AdapterKind

KINDS: dict[str, AdapterKind] = {
    "lora": plain.KIND,
    "loha": loha.KIND,
    "lokr": lokr.KIND,
    "diff": diff.WEIGHT,
    "diff_b": diff.BIAS,
}
WEIGHT_KINDS = ("lora", "loha", "lokr", "diff")  # at most one per module: each replaces ComfyUI's patch
# Tensors any weight kind may carry beside its factors (comfy/lora.py load_lora reads them first).
SHARED_ROLES = {"alpha": ".alpha", "dora_scale": ".dora_scale"}

# Convolution-only factors: ComfyUI's formulas for them reshape to 4-D kernels (`mat3.shape[2]`, einsum
# "i j k l, ...") and raise on a linear layer, and FLUX's transformer has linear layers only; a file with
# them was made for another model.
CONV_ONLY: dict[str, str] = {
    ".lora_mid.weight": "LoCon Tucker (lora_mid)",
    ".hada_t1": "LoHa Tucker (hada_t1)",
    ".hada_t2": "LoHa Tucker (hada_t2)",
    ".lokr_t2": "LoKr Tucker (lokr_t2)",
}
# What ComfyUI applies and the pack does not, and why:
# * OFT / BOFT (oft_blocks, rescale): a blockwise orthogonal rotation of the weight, not a delta; its
#   blocks cut across the rows a fused BFL target or a tensor-parallel shard splits, so it needs its own
#   sharded form, and FLUX files using it are rare.
# * GLoRA (a1/a2/b1/b2): ComfyUI's own code marks it unfinished (disabled in its adapter map).
# * set_weight: replaces a tensor outright; ComfyUI makes it only from BFL's Canny/Depth control LoRAs,
#   together with reshape_weight.
# * reshape_weight: pads img_in to more input channels (a control LoRA): the model's shape and ComfyUI's
#   model class change, which a resident sharded model cannot follow.
# * w_norm / b_norm: norm-layer differences, keyed by the norm's weight name, which ComfyUI 0.3.75 (`scale`)
#   and 0.33 (`weight`) spell differently for FLUX's RMS norms, so a file means different things per
#   version.
REFUSED: dict[str, str] = {
    ".oft_blocks": "OFT/BOFT",
    ".rescale": "OFT/BOFT",
    ".a1.weight": "GLoRA",
    ".a2.weight": "GLoRA",
    ".b1.weight": "GLoRA",
    ".b2.weight": "GLoRA",
    ".set_weight": "weight replacement (set_weight)",
    ".reshape_weight": "reshaping (FLUX control LoRA)",
    ".w_norm": "norm difference (w_norm)",
    ".b_norm": "norm difference (b_norm)",
}
APPLIED = "LoRA, LoHa and LoKr factors (optional alpha and DoRA dora_scale) and .diff/.diff_b differences"

__all__ = ["APPLIED", "CONV_ONLY", "KINDS", "REFUSED", "SHARED_ROLES", "WEIGHT_KINDS"]
