"""Context parallelism (ring attention, Ulysses, both) on ComfyUI's own model, by a plan's `SequenceSplit`.

Every rank holds the whole model (or its tensor-parallel shard) and 1/N of the tokens:

* **The split.** The plan names the method that carries the token streams (FLUX: `forward_orig(img, img_ids,
  txt, txt_ids, ...)`). It is wrapped on the model instance: each stream's arguments — the tokens and their
  position ids, alike, so the rotary embedding ComfyUI computes inside from the ids is this rank's — are
  split along the stream's dimension over the ring x Ulysses group, and the method's output is all-gathered
  back whole. Everything between runs ComfyUI's code on the local tokens.
* **The attention.** ComfyUI calls every attention through `wrap_attn`, which hands it to
  `transformer_options["optimized_attention_override"](func, q, k, v, heads, ...)` when present (ComfyUI
  0.3.75 and 0.33.0 both). The override runs the attention of the plan's `attention` modules (forward
  hooks tell it when it is inside one) over the whole sequence: diffusers' templated ring / Ulysses /
  unified attention (`_templated_context_parallel_attention`), with this pack's per-device kernel, its
  numeric LSE guard (parallel/lse.py, lse_check.py) and key-validity channel, all from parallel/context.py
  (`ContextAttention`). Any other attention (outside those modules) is ComfyUI's own function, unchanged.
* **Uneven lengths.** A stream the degree does not divide is padded to ceil(L / N) tokens per rank (at most
  one pad each) and the padded keys are dropped from every softmax through the validity channel, in the
  stream order the plan gives (the order the model concatenates them): never unmasked padding. The padded
  outputs are cut away after the gather.

diffusers' parallel config is built here on the layout's ("ring", "ulysses") sub-mesh (parallel/mesh.py),
as `enable_parallelism` would build it, without a diffusers model.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config import ConfigError, ParallelLayout
from ..parallel.comm import collectives_need_host, route_diffusers_gathers_through_host
from ..parallel.context import (
    ContextAttention,
    ContextState,
    LocalPadding,
    _check_mesh,
    choose_attention_kernel,
    pad_for_ranks,
    probe_ring,
    split_sizes,
    unpad_from_ranks,
)
from ..parallel.lse_check import guard_ring_kernel
from ..parallel.tensor import resolve_plan
from .plan import BlockSplit, ModelPlan, SequenceSplit, TokenSplit

OVERRIDE_KEY = (
    "optimized_attention_override"  # ComfyUI's transformer_options key (comfy/ldm/modules/attention.py)
)


def parallel_config(mesh: Any, layout: ParallelLayout, device: torch.device) -> Any:
    """diffusers' ParallelConfig for ring x Ulysses on `mesh` (the layout's ("ring", "ulysses") sub-mesh), set
    up as `ModelMixin.enable_parallelism` sets it up. Collective the first time (it flattens the mesh)."""
    from diffusers import ContextParallelConfig
    from diffusers.models._modeling_parallel import ParallelConfig

    _check_mesh(mesh, layout.ring, layout.ulysses)
    config = ParallelConfig(
        context_parallel_config=ContextParallelConfig(
            ring_degree=layout.ring, ulysses_degree=layout.ulysses, mesh=mesh
        )
    )
    config.setup(dist.get_rank(), dist.get_world_size(), device, mesh=mesh)
    return config


@dataclass
class SequenceState:
    """One model's context parallelism: the attention dispatch, the group the tokens split over, and
    whether the current call is inside a module whose attention spans the split sequence."""

    attention: ContextAttention
    config: Any  # diffusers' ParallelConfig
    group: Any
    degree: int
    rank: int
    depth: int = 0
    key_masks: bool = False  # the plan declares key masks (BlockSplit.masks): they reach the attention

    @property
    def context(self) -> ContextState:
        return self.attention.state


def _enter(state: SequenceState, *_: Any) -> None:
    state.depth += 1


def _leave(state: SequenceState, *_: Any) -> None:
    state.depth -= 1


def attention_override(state: SequenceState) -> Callable[..., Any]:
    """The function for `transformer_options["optimized_attention_override"]`: ComfyUI's `func` outside the
    plan's attention modules, the sequence-parallel attention inside them."""

    def override(
        func: Callable[..., Any],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        heads: int,
        mask: torch.Tensor | None = None,
        attn_precision: Any = None,
        skip_reshape: bool = False,
        skip_output_reshape: bool = False,
        **kwargs: Any,
    ) -> torch.Tensor:
        if state.depth <= 0:
            return func(
                q, k, v, heads, mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                skip_output_reshape=skip_output_reshape, **kwargs,
            )  # fmt: skip
        if (mask is not None and not state.key_masks) or kwargs.get("enable_gqa"):
            raise ConfigError(
                "ring / Ulysses attention got an attention mask (or grouped keys); this model's plan splits no "
                "masked attention: use layout 'tp'"
            )
        if mask is not None:  # the plan's key mask, split with its tokens: which local keys are kept
            mask = ~_dropped_keys(mask).reshape(q.shape[0], -1)
        if skip_reshape:  # [B, H, S, D] -> diffusers' [B, S, H, D]
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        else:  # [B, S, H * D]
            q, k, v = (t.unflatten(-1, (heads, -1)) for t in (q, k, v))
        out = state.attention(
            q, k, v, mask, 0.0, False, kwargs.get("scale"), False, parallel_config=state.config
        ).to(q.dtype)
        return out.transpose(1, 2) if skip_output_reshape else out.flatten(-2)

    return override


def _piece(value: torch.Tensor, dim: int, state: SequenceState, padded: bool) -> torch.Tensor:
    """This rank's piece of a stream's tensor along `dim` (padded to whole pieces first when any stream is)."""
    if padded:
        value = pad_for_ranks(value, dim, state.degree)
    return value.chunk(state.degree, dim)[state.rank]


def _padding(lengths: Mapping[str, int], state: SequenceState, device: torch.device) -> LocalPadding | None:
    """This rank's key validity over its pieces of the streams (`lengths`, in attention order); None when
    the degree divides every stream."""
    if not any(n % state.degree for n in lengths.values()):
        return None
    valid = [
        torch.arange(-(-n // state.degree)) < split_sizes(n, state.degree)[state.rank]
        for n in lengths.values()
    ]
    return LocalPadding(torch.cat(valid).to(device, torch.float32), ())


def _gathered(out: torch.Tensor, dim: int, length: int, state: SequenceState, padded: bool) -> torch.Tensor:
    """The whole stream of `length` tokens from every rank's piece `out` (padding cut away)."""
    pieces = [torch.empty_like(out) for _ in range(state.degree)]
    dist.all_gather(pieces, out.contiguous(), group=state.group)
    gathered = torch.cat(pieces, dim)
    return unpad_from_ranks(gathered, dim, split_sizes(length, state.degree)) if padded else gathered


def _refuse(refused: Mapping[str, str], arguments: Mapping[str, Any]) -> None:
    for name, why in refused.items():
        if arguments.get(name) is not None:
            raise ConfigError(f"{name} is set, which ring / Ulysses cannot split: {why}")


def _split_method(model: nn.Module, split: SequenceSplit, state: SequenceState) -> None:
    """Wrap `model.<split.method>`: its stream arguments split over the group, its output gathered."""
    method = getattr(model, split.method)
    signature = inspect.signature(method)

    @functools.wraps(method)
    def split_call(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        _refuse(split.refused, arguments)
        lengths = {s.name: int(arguments[s.inputs[0]].shape[s.dim]) for s in split.streams}
        padded = any(n % state.degree for n in lengths.values())
        for stream in split.streams:
            length = lengths[stream.name]
            for name in stream.inputs:
                value = arguments[name]
                if value.shape[stream.dim] != length:
                    raise RuntimeError(
                        f"{split.method}: '{name}' has {value.shape[stream.dim]} entries along dim {stream.dim}, "
                        f"'{stream.inputs[0]}' {length}: the plan splits them alike"
                    )
                arguments[name] = _piece(value, stream.dim, state, padded)
        state.context.padding = _padding(lengths, state, arguments[split.streams[0].inputs[0]].device)
        state.depth = 0  # a previous call that failed inside a block left it raised
        try:
            out = method(*bound.args, **bound.kwargs)
        finally:
            state.context.padding = None
        return _gathered(out, split.stream(split.output).dim, lengths[split.output], state, padded)

    setattr(model, split.method, split_call)


@dataclass
class _BlockForward:
    """One forward under a BlockSplit: the streams' whole lengths, read at its first block (None before)."""

    lengths: dict[str, int] | None = None
    padded: bool = False


def _dropped_keys(mask: torch.Tensor) -> torch.Tensor:
    """A ComfyUI additive key mask's dropped keys (a large negative: ComfyUI writes -finfo.max); any other
    value than 0 would weigh a key, which ring / Ulysses cannot split."""
    dropped = mask <= torch.finfo(mask.dtype).min / 2
    if not bool((dropped | (mask == 0)).all()):
        raise ConfigError(
            "an attention mask holds values other than 0 (keep) and a large negative (drop), which ring / "
            "Ulysses cannot split; use layout 'tp'"
        )
    return dropped


def _split_blocks(model: nn.Module, split: BlockSplit, state: SequenceState) -> None:
    """Split the streams at the first of `split.blocks` each forward calls, each block's whole arguments at
    every block, and gather `split.output`'s output (plan.py BlockSplit)."""
    blocks = [model.get_submodule(n) for n in resolve_plan(model, {split.blocks: None})]
    signature = inspect.signature(type(blocks[0]).forward)
    forward = _BlockForward()
    state.key_masks = bool(split.masks)

    def start(_module: nn.Module, _args: Any, kwargs: dict[str, Any]) -> None:
        _refuse(split.refused, kwargs)
        forward.lengths, state.depth = None, 0  # a previous call that failed inside a block left them set
        state.context.padding, state.context.masked = None, False

    def end(*_: Any) -> None:
        state.context.padding, state.context.masked = None, False

    def first_block(arguments: dict[str, Any]) -> dict[str, int]:
        lengths = {s.name: int(arguments[s.inputs[0]].shape[s.dim]) for s in split.streams}
        forward.lengths, forward.padded = lengths, any(n % state.degree for n in lengths.values())
        device = arguments[split.streams[0].inputs[0]].device
        state.context.padding = _padding(lengths, state, device)
        masks = [arguments.get(n) for n in split.masks]  # whole: decided alike on every rank
        state.context.masked = forward.padded or any(
            m is not None and m.is_floating_point() and bool(_dropped_keys(m).any()) for m in masks
        )
        for stream in split.streams:
            for name in stream.inputs:
                arguments[name] = _piece(arguments[name], stream.dim, state, forward.padded)
        return lengths

    def at_block(block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        arguments = dict(signature.bind(block, *args, **kwargs).arguments)
        arguments.pop(next(iter(signature.parameters)))  # self
        lengths = forward.lengths or first_block(arguments)
        padded = forward.padded
        for name, dim in split.joint.items():
            value = arguments.get(name)
            if value is not None:
                if value.shape[dim] != sum(lengths.values()):
                    raise RuntimeError(
                        f"{name} has {value.shape[dim]} entries along dim {dim}, the streams {lengths} together"
                    )
                parts = value.split(list(lengths.values()), dim)
                arguments[name] = torch.cat([_piece(p, dim, state, padded) for p in parts], dim)
        for name, stream in split.masks.items():
            if arguments.get(name) is not None:
                arguments[name] = _piece(arguments[name], split.stream(stream).dim, state, padded)
        for name, stream in split.indices.items():
            if arguments.get(name) is not None:
                sizes = split_sizes(lengths[stream], state.degree)
                start = sum(sizes[: state.rank])
                arguments[name] = min(max(int(arguments[name]) - start, 0), sizes[state.rank])
        return (), arguments

    def gather(_module: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
        if forward.lengths is None:  # no block ran: nothing was split
            return out
        length = forward.lengths[split.output_stream]
        return _gathered(out, split.stream(split.output_stream).dim, length, state, forward.padded)

    model.register_forward_pre_hook(start, with_kwargs=True)
    model.register_forward_hook(end)
    for block in blocks:
        block.register_forward_pre_hook(at_block, with_kwargs=True)
    model.get_submodule(split.output).register_forward_hook(gather)


@dataclass
class _TokenForward:
    """One forward under a TokenSplit: the whole token count (None until the first module splits the tokens)
    and the arguments cut so far, by identity (the model hands one RoPE table and one modulation to every
    block: each is cut once per forward)."""

    length: int | None = None
    padded: bool = False
    cut: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def _qualified(name: str) -> Callable[..., Any]:
    module, _, attribute = name.rpartition(".")
    return getattr(importlib.import_module(module), attribute)


def _split_tokens(model: nn.Module, split: TokenSplit, state: SequenceState) -> None:
    """Split the tokens where they enter the first of `split.modules`, cut the `rows` arguments of every one
    of them to this rank's tokens, gather the output of `split.gather` (plan.py TokenSplit)."""
    modules = [model.get_submodule(n) for n in resolve_plan(model, dict.fromkeys(split.modules))]
    spread = _qualified(split.spread) if split.spread else None
    forward = _TokenForward()
    dim, degree = split.dim, state.degree

    def piece(value: torch.Tensor, along: int = dim) -> torch.Tensor:
        if forward.padded:
            value = pad_for_ranks(value, along, degree)
        return value.chunk(degree, along)[state.rank]

    def start(*_: Any) -> None:  # a previous call that failed inside a module left these set
        forward.length, forward.cut, state.depth = None, {}, 0
        state.context.padding = None

    def token_rows(name: str, rows: int, device: torch.device) -> torch.Tensor:
        """The row of a `rows`-row argument each whole-sequence token reads (ComfyUI's own `spread`)."""
        length = forward.length
        index = None
        if spread is not None:
            index = spread(
                torch.arange(rows, device=device)[None], torch.empty((1, length, 0), device="meta")
            )[0]
        if index is None or index.shape[0] != length:
            raise RuntimeError(
                f"'{name}' has {rows} rows along dim {dim} for {length} tokens, which the plan's spread "
                f"({split.spread or 'none'}) does not map onto the tokens"
            )
        return index

    def cut(name: str, value: torch.Tensor) -> torch.Tensor:
        rows = value.shape[dim]
        if rows == 1:  # one row for every token
            return value
        held = forward.cut.get(id(value))
        if held is not None and held[0] is value:
            return held[1]
        if rows == forward.length:
            out = piece(value)
        else:
            out = value.index_select(dim, piece(token_rows(name, rows, value.device), 0))
        forward.cut[id(value)] = (value, out)
        return out

    def enter(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
        arguments = bound.arguments
        if forward.length is None:  # the first module of this forward: the tokens are whole
            tokens = arguments[split.tokens]
            forward.length = int(tokens.shape[dim])
            forward.padded = forward.length % degree != 0
            if forward.padded:
                sizes, width = split_sizes(forward.length, degree), -(-forward.length // degree)
                valid = (torch.arange(width) < sizes[state.rank]).to(tokens.device, torch.float32)
                state.context.padding = LocalPadding(valid, ())
            arguments[split.tokens] = piece(tokens)
        for name in split.rows:
            if torch.is_tensor(arguments.get(name)):
                arguments[name] = cut(name, arguments[name])
        return bound.args, bound.kwargs

    def gather(_module: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
        if forward.length is None:  # nothing was split in this forward
            return out
        pieces = [torch.empty_like(out) for _ in range(degree)]
        dist.all_gather(pieces, out.contiguous(), group=state.group)
        gathered = torch.cat(pieces, dim)
        if forward.padded:
            gathered = unpad_from_ranks(gathered, dim, split_sizes(forward.length, degree))
        start()
        return gathered

    model.register_forward_pre_hook(start)
    for module in modules:
        module.register_forward_pre_hook(enter, with_kwargs=True)
    model.get_submodule(split.gather).register_forward_hook(gather)


def apply_context_parallel(
    model: nn.Module,
    plan: ModelPlan,
    layout: ParallelLayout,
    mesh: Any,
    device: torch.device,
    dtype: torch.dtype,
    attention: str | None = None,
) -> SequenceState | None:
    """Split `model`'s token sequence over `mesh` (the layout's ("ring", "ulysses") sub-mesh) by `plan`;
    returns the state whose `attention_override(state)` goes into each call's transformer_options (None
    when the layout has no ring or Ulysses degree). Collective: every rank calls it alike. `attention`
    overrides the kernel chosen for the device (parallel/context.py ATTENTION_KERNELS)."""
    if layout.cp == 1:
        return None
    if plan.sequence is None:
        raise ConfigError(
            f"{plan.name}'s plan has no sequence split; ring and Ulysses do not apply: use layout 'tp'"
        )
    heads = plan.head_count(model) // layout.tp
    if heads % layout.ulysses:
        raise ConfigError(
            f"ulysses_degree={layout.ulysses} does not divide the {heads} attention heads each rank holds"
        )
    config = parallel_config(mesh, layout, device)
    cp = config.context_parallel_config
    group = cp._flattened_mesh.get_group()
    context = ContextState(layout=layout, kernel=choose_attention_kernel(device, dtype, attention))
    if collectives_need_host(dist.get_backend(group), device):
        route_diffusers_gathers_through_host()  # before the probe and the guard, which gather too
    if layout.ring > 1:
        context.lse_shape = probe_ring(config, device, layout.ring)
        context.kernel = guard_ring_kernel(
            context.kernel, config, device, dtype, context.lse_shape, plan.head_dim(model)
        )
    state = SequenceState(
        ContextAttention(context), config, group, dist.get_world_size(group), dist.get_rank(group)
    )
    for name in resolve_plan(model, dict.fromkeys(plan.attention), plan.optional):
        module = model.get_submodule(name)
        module.register_forward_pre_hook(functools.partial(_enter, state))
        module.register_forward_hook(functools.partial(_leave, state))
    if isinstance(plan.sequence, BlockSplit):
        _split_blocks(model, plan.sequence, state)
    elif isinstance(plan.sequence, TokenSplit):
        _split_tokens(model, plan.sequence, state)
    else:
        _split_method(model, plan.sequence, state)
    return state


__all__ = ["OVERRIDE_KEY", "SequenceState", "apply_context_parallel", "attention_override", "parallel_config"]
