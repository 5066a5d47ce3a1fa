"""Wan's context-parallel spec: which processor to rebuild, and how a forward's video tokens are padded.

diffusers' `_cp_plan` for WanTransformer3DModel (0.42.1) splits the video tokens at the first block, both
RoPE outputs (dim 1) and a per-token timestep at the root (Wan 2.2's, dim 1), and gathers `proj_out`. The text
is not split: every rank's tokens cross-attend to all of it (the processor passes no parallel config there,
and parallel/context.py then attends locally). Only the self-attention's sequence is split, so the padding of
a token count that does not divide by the degree is the video's alone: `local_padding(0, tokens, ...)`, its
validity carried through ring and Ulysses as for every family (context.py).

The tokens only exist after the patch embedding, inside diffusers' forward, so the padding is spread over the
points where they appear: the RoPE module pads its own output (`ComfyRope3D.pad`), a forward pre-hook on
`blocks.0` pads the tokens and one on the model the per-token timestep (torch runs them before diffusers'
split, which wraps the module's forward), and a forward hook on `proj_out` unpads the gathered output
before diffusers folds the tokens back into frames.
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
    """The forward's arguments by name."""
    bound = inspect.signature(type(model).forward).bind(model, *args, **kwargs)
    arguments = dict(bound.arguments)
    arguments.pop("self", None)
    return arguments


def video_tokens(model: nn.Module, hidden_states: torch.Tensor) -> int:
    """Tokens of a [B, C, T, H, W] input (already padded to whole patches by the family's call)."""
    pt, ph, pw = model.config.patch_size
    _, _, t, h, w = hidden_states.shape
    return (t // pt) * (h // ph) * (w // pw)


def pad_video_tokens(model: nn.Module, state: ContextState, spec: ContextParallelSpec) -> None:
    """Pad the video tokens (and their RoPE and per-token timesteps) so that every rank holds ceil(S / N) of
    them, padding last; unpad the gathered output (module doc)."""
    degree = state.layout.ring * state.layout.ulysses
    cp_config = model._parallel_config.context_parallel_config

    def pad(tensor: torch.Tensor, dim: int) -> torch.Tensor:
        return pad_for_ranks(tensor, dim, degree)

    def pad_inputs(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        kw = _arguments(module, args, kwargs)
        tokens = video_tokens(module, kw["hidden_states"])
        state.layout.validate_sequence(tokens)
        rank = dist.get_rank(cp_config._flattened_mesh.get_group())
        state.padding = local_padding(0, tokens, degree, rank, kw["hidden_states"].device)
        state.masked = state.padding is not None
        module.rope.pad = pad if state.padding is not None else None
        timestep = kw["timestep"]
        if state.padding is not None and timestep.ndim == 2:  # one per token (Wan 2.2's per-frame steps)
            kw["timestep"] = pad(timestep, 1)
        return (), kw

    def pad_tokens(block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if state.padding is None:
            return None
        if args:
            return (pad(args[0], 1), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": pad(kwargs["hidden_states"], 1)}

    def unpad_output(module: nn.Module, args: Any, output: torch.Tensor) -> Any:
        padding = state.padding
        return output if padding is None else unpad_from_ranks(output, 1, list(padding.image_sizes))

    def clear(module: nn.Module, args: Any, output: Any) -> Any:
        state.padding, state.masked = None, False
        module.rope.pad = None
        return output

    model.register_forward_pre_hook(pad_inputs, with_kwargs=True)
    model.blocks[0].register_forward_pre_hook(pad_tokens, with_kwargs=True)
    model.proj_out.register_forward_hook(unpad_output)
    model.register_forward_hook(clear)


# parallel/context.py rebuilds the processor from the module that defines it (this package's attention.py,
# whatever name the pack was imported under)
WAN_CP = ContextParallelSpec(
    processors={"WanComfyAttnProcessor": __name__.rpartition(".")[0] + ".attention"},
    padding=pad_video_tokens,
)

__all__ = ["WAN_CP", "pad_video_tokens", "video_tokens"]
