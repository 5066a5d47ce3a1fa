"""Qwen-Image's context-parallel spec: which processor to rebuild, and how a forward's streams are padded.

diffusers' `_cp_plan` for QwenImageTransformer2DModel (0.42.1) splits the image and text streams at the first
block, the text mask and Edit-2511's `modulate_index` at every block, both RoPE outputs (dim 0), and gathers
`proj_out`. It has no root entry and no position-id arguments (RoPE comes from `pos_embed`), so FLUX's
padding (context.py `pad_token_streams`) does not apply; `pad_streams` below is its Qwen form.

The text mask: diffusers' ring attention applies a rank's *local* mask to every rotated K/V chunk (rank r's
mask on rank r+1's keys: silently wrong; 0.124 off on a tiny model), and ring x Ulysses with a mask fails on
shapes. The engine instead treats the mask as key validity, like the padding it adds for uneven lengths
(context.py): the validity rides with K through the ring and Ulysses' all-to-all, so every chunk carries its
own. Whether a forward carries it is decided here, from the whole mask, for every rank alike.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.context import (
    ContextParallelSpec,
    ContextState,
    local_padding,
    pad_for_ranks,
    unpad_from_ranks,
)


def _arguments(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The forward's arguments by name (ComfyUI's and the tests' callers pass keywords, but need not)."""
    bound = inspect.signature(type(model).forward).bind(model, *args, **kwargs)
    arguments = dict(bound.arguments)
    arguments.pop("self", None)
    return arguments


def pad_streams(model: nn.Module, state: ContextState, spec: ContextParallelSpec) -> None:
    """Pad the image, the text, the text mask, both RoPE outputs (`ComfyRope.pad`) and `modulate_index`
    so that every rank holds ceil(L / N) tokens of each stream, padding last; unpad the gathered output.

    Padded text positions are False in the mask; padded image positions are marked invalid by the engine
    (state.padding). Hooks: a forward pre-hook on the model (diffusers has none on Qwen's root), a forward
    pre-hook on each block for `modulate_index` (torch runs it before diffusers' split, which wraps the
    block's forward), a forward hook to unpad.
    """
    degree = state.layout.ring * state.layout.ulysses
    cp_config = model._parallel_config.context_parallel_config

    def pad(tensor: torch.Tensor, dim: int) -> torch.Tensor:
        return pad_for_ranks(tensor, dim, degree)

    def pad_inputs(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        kw = _arguments(module, args, kwargs)
        image, text = kw["hidden_states"], kw["encoder_hidden_states"]
        state.layout.validate_sequence(image.shape[1])
        rank = dist.get_rank(cp_config._flattened_mesh.get_group())
        state.padding = local_padding(text.shape[1], image.shape[1], degree, rank, image.device)
        mask = kw.get("encoder_hidden_states_mask")
        if mask is not None:
            mask = kw["encoder_hidden_states_mask"] = mask.to(torch.bool)
        if state.padding is not None:
            kw["hidden_states"], kw["encoder_hidden_states"] = pad(image, 1), pad(text, 1)
            if mask is not None:
                kw["encoder_hidden_states_mask"] = pad(mask, 1)  # pads with False: never a key
        module.pos_embed.pad = pad if state.padding is not None else None
        # decided from the whole sequence: a rank whose piece is all valid still carries the channel, or
        # the ranks' collectives would differ in size
        state.masked = state.padding is not None or (mask is not None and not bool(mask.all()))
        return (), kw

    def pad_modulate_index(block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        index = kwargs.get("modulate_index")
        if (
            state.padding is not None
            and index is not None
            and index.shape[1] != kwargs["hidden_states"].shape[1]
        ):
            kwargs = {**kwargs, "modulate_index": pad(index, 1)}
        return args, kwargs

    def unpad_output(module: nn.Module, args: Any, output: Any) -> Any:
        padding, state.padding, state.masked = state.padding, None, False
        module.pos_embed.pad = None
        if padding is None:
            return output
        sample = output[0] if isinstance(output, tuple) else output.sample
        sample = unpad_from_ranks(sample, 1, list(padding.image_sizes))
        return (sample, *output[1:]) if isinstance(output, tuple) else type(output)(sample=sample)

    model.register_forward_pre_hook(pad_inputs, with_kwargs=True)
    for block in model.transformer_blocks:
        block.register_forward_pre_hook(pad_modulate_index, with_kwargs=True)
    model.register_forward_hook(unpad_output)


QWEN_CP = ContextParallelSpec(
    processors={"QwenDoubleStreamAttnProcessor2_0": "diffusers.models.transformers.transformer_qwenimage"},
    output_class="diffusers.models.modeling_outputs.Transformer2DModelOutput",
    padding=pad_streams,
)

__all__ = ["QWEN_CP", "pad_streams"]
