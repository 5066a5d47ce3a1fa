"""What a file that holds no LoRA for this model is instead, from its key names: an SDXL or SD 1.5 / 2.x
LoRA, or a model checkpoint given as a LoRA. The usual mistakes, named so the refusal says which file to
pick instead of "may be a LoRA for another model"."""

from __future__ import annotations

from collections.abc import Iterable

from ...family import families

# Words in the tensor names that only LoRA-like files have (kohya, PEFT, LyCORIS).
_ADAPTER_WORDS = ("lora", "hada_", "lokr_", "alpha", "dora_scale", "oft_", "boft_")
_DIFF_ENDS = (".diff", ".diff_b")  # ComfyUI's full-difference patches ('.diffusion_model' is no such name)
# SDXL's UNet in kohya's (SGM) names, and its second text encoder in every trainer's names.
_SDXL = ("input_blocks", "output_blocks", "middle_block", "lora_te2_", "text_encoder_2")
_SD_UNET = ("down_blocks", "up_blocks", "mid_block")  # a Stable Diffusion UNet in diffusers' names


# Where a LoRA's module path starts, in the trainers' spellings (kohya, ComfyUI, diffusers, PEFT).
_PATH_PREFIXES = ("lora_unet_", "lora_transformer_", "base_model.model.", "model.diffusion_model.",
                  "diffusion_model.", "transformer.")  # fmt: skip


def _block_names() -> tuple[str, ...]:
    """Every registered family's numbered blocks, in BFL and diffusers spelling ('double_blocks',
    'transformer_blocks', Wan's 'blocks')."""
    names = set()
    for family in families():
        for blocks in family.keys.blocks:
            names.update(name.strip(".") for name in (blocks.bfl, blocks.diffusers) if name.strip("."))
    return tuple(sorted(names))


def _own_model_key(key: str, blocks: tuple[str, ...]) -> bool:
    """A key a LoRA for one of the pack's transformers has: ComfyUI's or diffusers' transformer names, or a
    module path that starts with one of the families' block names (an SDXL 'input_blocks' does not)."""
    if "transformer" in key or "diffusion_model" in key:
        return True
    path = key
    for prefix in _PATH_PREFIXES:
        path = path.removeprefix(prefix)
    return any(path.startswith(name) and path[len(name) : len(name) + 1] in (".", "_") for name in blocks)


def plain_weights(keys: Iterable[str]) -> bool:
    """A file with tensors but no LoRA-like name at all: a model checkpoint, whatever it is for."""
    keys = list(keys)
    adapter = any(word in k.lower() for k in keys for word in _ADAPTER_WORDS)
    return bool(keys) and not adapter and not any(k.endswith(_DIFF_ENDS) for k in keys)


def plainly_foreign(keys: Iterable[str]) -> bool:
    """The names alone say the file is no LoRA for the pack's models: plain weights, or another model's
    LoRA with no name a LoRA for the pack's models has (one may carry a 'text_encoder_2' T5 part)."""
    keys = list(keys)
    if plain_weights(keys):
        return True
    blocks = _block_names()
    return other_model(keys) is not None and not any(_own_model_key(k, blocks) for k in keys)


def other_model(keys: Iterable[str]) -> str | None:
    """'an SDXL LoRA', 'a LoRA for a Stable Diffusion 1.5 / 2.x UNet' or 'a model checkpoint, not a LoRA',
    with the keys that say so; None when the names say nothing."""
    keys = list(keys)
    if plain_weights(keys):
        return "a model checkpoint (plain weights, no LoRA tensors), not a LoRA"
    if any(marker in k for k in keys for marker in _SDXL):
        return "an SDXL LoRA (its keys name SDXL's UNet blocks or its second text encoder)"
    if any(marker in k for k in keys for marker in _SD_UNET):
        return (
            "a LoRA for a Stable Diffusion 1.5 / 2.x UNet (its keys name down_blocks, mid_block, up_blocks)"
        )
    return None


__all__ = ["other_model", "plain_weights", "plainly_foreign"]
