"""The plan format: how one of ComfyUI's diffusion model classes is sharded, written as data.

A `ModelPlan` names ComfyUI's own module paths (`*` stands for one path component, e.g. a block index) and
says, for that class:

* `linears`: which linear layers tensor parallelism splits, and how (`Columns`, `Rows`, `Gathered`), fused
  sections included (FLUX's `qkv` is q | k | v, its single blocks' `linear1` q | k | v | mlp);
* `norms`: which norms span all attention heads (`HeadNorm`: the mean of squares summed over the ranks);
* `per_rank`: which attributes count heads or widths and so shrink by the tp degree on each rank
  (`num_heads` on FLUX's blocks: they reshape q / k / v by it);
* `sequence`: where the token sequence splits for ring attention and Ulysses (`SequenceSplit`: a method of
  the model whose arguments carry the token streams and their position ids, split alike; `BlockSplit`: the
  blocks' arguments, for a model with several streams and no such method; `TokenSplit`: the arguments of
  the modules the tokens pass through, for a model that makes its one token stream inside its forward)
  and `attention`,
  the modules whose attention then runs over the whole split sequence (through ComfyUI's attention hook);
  attention elsewhere (a cross-attention to the unsplit text) stays ComfyUI's own;
* `blocks`: the repeated blocks' class names (cancel points, compile), `unbatched`: the call's inputs that
  are the same for every batch entry (the batch split leaves them whole).

The generic code (apply.py, attention.py, load.py, engine.py) applies any plan and names no model; a plan
module names no parallel machinery. FLUX.1's plan, the worked example, is plans/flux.py `FLUX1`; how to
write one for another model: docs/internals.md ("The model engine").

Nothing here imports torch: a plan is read by the planner and by tests without it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# The fused parts of a linear's output (Columns) or input (Rows): an int n is n equal parts; names are
# attributes of the module that owns the linear (its parent), read before `per_rank` changes them, each
# holding one part's width (FLUX's single blocks: ("hidden_size",) * 3 + ("mlp_hidden_dim_first",)).
Sections = int | tuple[str, ...]


@dataclass(frozen=True)
class Columns:
    """Output features split across the tp ranks: the input is whole on every rank, the output stays split
    (the next layer reads this rank's heads / features). Each section is split evenly, so a rank keeps its
    slice of every fused part, in part order: a plain contiguous split of q | k | v would hand one rank all of
    q and another v, silently."""

    sections: Sections = 1


@dataclass(frozen=True)
class Rows:
    """Input features split: each rank multiplies its slice of the input (a Columns layer's output) and
    the partial sums are all-reduced over the tp group right after the layer; the bias is added once (only
    the group's first rank keeps it). `sections`: the input concatenates fused parts (FLUX's single-block
    `linear2` reads cat(attention, mlp)), each split evenly."""

    sections: Sections = 1


@dataclass(frozen=True)
class Gathered:
    """Output split like Columns, the whole output rebuilt on every rank by an all-gather (AdaLN modulation:
    FLUX.1-dev's 3.2 B parameters held once across the ranks instead of on each).

    Layers of one `bank` read the same input in a forward (FLUX's modulation linears all read silu(vec)): the
    first of them called evaluates every layer of the bank on that input and one all-gather serves them all,
    for the rest of the forward (a call with an input of another shape computes and gathers alone). An empty
    bank name: the layer gathers alone."""

    bank: str = ""


@dataclass(frozen=True)
class HeadNorm:
    """An RMS norm over all heads of a Columns layer's output (Wan's and Qwen-Image's q/k norms across heads):
    each rank holds its heads' slice of the weight and the mean of squares is summed over the tp group. A
    per-head norm (FLUX's) needs no entry: it is whole on every rank."""


Split = Columns | Rows | Gathered


@dataclass(frozen=True)
class Stream:
    """One token stream of a `SequenceSplit`: the method arguments that carry it, split alike along `dim`
    (the tokens and their position ids: FLUX's ("img", "img_ids")). The first argument's length is the
    stream's."""

    name: str
    inputs: tuple[str, ...]
    dim: int = 1


@dataclass(frozen=True)
class SequenceSplit:
    """Where context parallelism (ring, Ulysses) splits the token sequence.

    `method` is the diffusion model's method whose arguments carry every token stream (FLUX: `forward_orig`,
    after ComfyUI's patchify and position ids, before the embedders): each rank gets its 1/N of every
    stream, position ids split exactly like their tokens, and the method's output (the `output` stream,
    along its `dim`) is gathered back whole on every rank. `streams` are listed in the order the model
    concatenates them for joint attention (FLUX: text, then image): a stream whose length the degree does
    not divide is padded to whole pieces and the padded keys are dropped from every softmax (never unmasked
    padding), so the order tells which local keys are padding.

    `refused`: arguments of `method` that must be None under context parallelism, with the reason (inputs
    that index tokens globally: FLUX.2's timestep-zero reference modulation, a ControlNet's residuals).
    """

    method: str
    streams: tuple[Stream, ...]
    output: str
    refused: Mapping[str, str] = field(default_factory=dict)

    def stream(self, name: str) -> Stream:
        return next(s for s in self.streams if s.name == name)


@dataclass(frozen=True)
class BlockSplit:
    """Where context parallelism splits the tokens of a model whose forward builds its streams inside itself,
    with no method between that carries them (Qwen-Image's `_forward` patchifies, appends the reference
    latents, embeds and computes the RoPE of cat(text ids, image ids) in one body): at its blocks' arguments.

    Every rank gets its 1/N of each stream, split at the first of the `blocks` a forward calls (the blocks'
    outputs carry the rank's tokens on to the next); the arguments ComfyUI hands every block whole are split
    at each block exactly like their tokens: `joint` ones concatenate every stream in `streams` order along a
    dim (Qwen-Image's RoPE: name -> dim), `masks` hold one additive entry per token of a stream (a text mask:
    0 keeps a key, a large negative drops it; its dropped keys are dropped from every softmax, as padding's
    are), `indices` are an int index into a stream's tokens (Edit-2511's `timestep_zero_index`: where the
    reference tokens start), rewritten to the rank's local index. `output` is the module whose output is the
    `output_stream`'s tokens (along dim 1), gathered back whole (and unpadded) on every rank. Padding, the
    stream order and `refused` (the model's forward arguments that must be None) are SequenceSplit's.
    """

    blocks: str
    streams: tuple[Stream, ...]
    output: str
    output_stream: str
    joint: Mapping[str, int] = field(default_factory=dict)
    masks: Mapping[str, str] = field(default_factory=dict)
    indices: Mapping[str, str] = field(default_factory=dict)
    refused: Mapping[str, str] = field(default_factory=dict)

    def stream(self, name: str) -> Stream:
        return next(s for s in self.streams if s.name == name)


def attribute(owner: Any, path: str) -> Any:
    """`owner`'s attribute at `path`, dotted through submodules ('transformer_blocks.0.num_attention_heads'):
    a model whose root holds no head count names one on a block (nn.Module resolves '0' as a child)."""
    return functools.reduce(getattr, path.split("."), owner)


def _names_module(pattern: str, path: str) -> bool:
    """Whether a plan key (`*` = one path component) names the module at `path` ('' = the root)."""
    keys, parts = pattern.split(".") if pattern else [], path.split(".") if path else []
    return len(keys) == len(parts) and all(k in ("*", p) for k, p in zip(keys, parts, strict=True))


@dataclass(frozen=True)
class TokenSplit:
    """Where context parallelism splits tokens that no method argument carries: a model whose forward makes
    its tokens itself (Wan's `forward_orig` runs the Conv3d patch embedding on the whole latent video) and
    hands them to its `modules` (the repeated blocks, then the output head) as their `tokens` argument.

    Each rank takes its 1/N of the tokens (along `dim`) where they enter the first of `modules` a forward
    calls; the following modules get this rank's tokens from the one before. Every call of one of `modules`
    gets its `rows` arguments cut to this rank's tokens alike: an argument with one row per token along `dim`
    (the RoPE table), or one row per run of consecutive tokens (Wan 2.2's per-frame modulation), spread over
    the tokens by `spread` (the qualified name of ComfyUI's function that does it in the model, called as
    `spread(rows, tokens)` on row indices: Wan's `repeat_e`), or one row for all tokens (left whole). Every
    other argument stays whole (the text a cross-attention reads). The output of `gather` (the last of
    `modules`) is all-gathered back whole along `dim`, so the model's code after it (unpatchify) sees every
    token. A token count the degree does not divide is padded to whole pieces and the padded keys are dropped
    from every softmax (never unmasked padding)."""

    modules: tuple[str, ...]
    tokens: str
    rows: tuple[str, ...]
    gather: str
    spread: str = ""
    dim: int = 1


@dataclass(frozen=True)
class ModelPlan:
    """How one of ComfyUI's diffusion model classes is sharded (see the module docstring).

    `model_class` is the class's qualified name ('comfy.ldm.flux.model.Flux'); `when` the unet_config
    values (ComfyUI's detection output) that pick this plan among the plans of one class (FLUX.1 and FLUX.2
    share ComfyUI's Flux class). `heads` and `width`: the model's attributes holding its attention head
    count and attention width (heads x head dim), for validation and the LSE guard's numeric check; dotted
    paths reach into submodules (`attribute`), and neither may be one `per_rank` divides.
    """

    name: str
    model_class: str
    heads: str
    width: str
    linears: Mapping[str, Split]
    per_rank: Mapping[str, tuple[str, ...]]
    blocks: tuple[str, ...]
    when: Mapping[str, Any] = field(default_factory=dict)
    norms: Mapping[str, HeadNorm] = field(default_factory=dict)
    sequence: SequenceSplit | BlockSplit | TokenSplit | None = None
    attention: tuple[str, ...] = ()
    unbatched: tuple[str, ...] = ()
    # plan keys some checkpoints of the class lack (every other key must name a module)
    optional: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for role, path in (("heads", self.heads), ("width", self.width)):
            owner, _, name = path.rpartition(".")
            for pattern, names in self.per_rank.items():
                if name in names and _names_module(pattern, owner):
                    raise ValueError(
                        f"{self.name}: {role}={path!r} is divided per rank by per_rank[{pattern!r}]; name an "
                        "attribute holding the whole model's value"
                    )

    def matches(self, class_name: str, unet_config: Mapping[str, Any]) -> bool:
        """Whether this plan is the one for a model of `class_name` detected with `unet_config`."""
        return class_name == self.model_class and all(unet_config.get(k) == v for k, v in self.when.items())

    def head_count(self, model: Any) -> int:
        """The model's attention heads (whole: before or after the tensor-parallel split)."""
        return int(attribute(model, self.heads))

    def head_dim(self, model: Any) -> int:
        return int(attribute(model, self.width)) // self.head_count(model)


__all__ = [
    "BlockSplit",
    "Columns",
    "Gathered",
    "HeadNorm",
    "ModelPlan",
    "Rows",
    "Sections",
    "SequenceSplit",
    "Split",
    "Stream",
    "TokenSplit",
    "attribute",
]
