"""What a file that holds no LoRA for this model is instead, from its key names: an SDXL or SD 1.5 / 2.x
LoRA, or a model checkpoint given as a LoRA. The usual mistakes, named so the refusal says which file to
pick instead of "may be a LoRA for another model"."""

from __future__ import annotations

from collections.abc import Iterable

# Words in the tensor names that only LoRA-like files have (kohya, PEFT, LyCORIS, ComfyUI's .diff).
_ADAPTER_WORDS = ("lora", "hada_", "lokr_", ".diff", "alpha", "dora_scale", "oft_", "boft_")
# SDXL's UNet in kohya's (SGM) names, and its second text encoder in every trainer's names.
_SDXL = ("input_blocks", "output_blocks", "middle_block", "lora_te2_", "text_encoder_2")
_SD_UNET = ("down_blocks", "up_blocks", "mid_block")  # a Stable Diffusion UNet in diffusers' names


def other_model(keys: Iterable[str]) -> str | None:
    """'an SDXL LoRA', 'a LoRA for a Stable Diffusion 1.5 / 2.x UNet' or 'a model checkpoint, not a LoRA',
    with the keys that say so; None when the names say nothing."""
    keys = list(keys)
    if keys and not any(word in k.lower() for k in keys for word in _ADAPTER_WORDS):
        return "a model checkpoint (plain weights, no LoRA tensors), not a LoRA"
    if any(marker in k for k in keys for marker in _SDXL):
        return "an SDXL LoRA (its keys name SDXL's UNet blocks or its second text encoder)"
    if any(marker in k for k in keys for marker in _SD_UNET):
        return (
            "a LoRA for a Stable Diffusion 1.5 / 2.x UNet (its keys name down_blocks, mid_block, up_blocks)"
        )
    return None


__all__ = ["other_model"]
