"""A model call as ComfyUI's diffusion models take it: `x`, `timestep` and the family's named inputs.

ComfyUI calls a diffusion model as `diffusion_model(x, timestep, context=..., control=...,
transformer_options=..., **extra_conds)` (comfy/model_base.py `_apply_model`): everything but x and the
timestep travels by name, and each model class takes its own names (FLUX.1: `context`, `y`, `guidance`,
`ref_latents`, `ref_latents_method`; Qwen-Image: `context`, `attention_mask`, `ref_latents`, ...). A family
declares its call as data (`CallSpec`): its inputs, which of them are a prompt's (sent to the ranks once
and kept there) and which change every step, which carry the batch, which add tokens to the sequence,
and its own checks. Everything generic reads that declaration: the ROCm Parallel Model's proxy (which
inputs ComfyUI may pass), the checks below, admission and the planner (the tokens a call holds), the
wire (messages.ForwardRequest) and the workers' batch split (serve.py).

Values are tensors, sequences of tensors (`many`: ComfyUI's lists of reference latents), strings (a
placement such as `ref_latents_method`) or None (not given).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..config import ConfigError
from .sampling import check_finite, check_real

if TYPE_CHECKING:
    from ..checkpoint import CheckpointInfo
    from ..config import ParallelLayout

Inputs = dict[str, Any]

# How a token count is read from an input's shape (`CallInput.tokens`).
TEXT_TOKENS = "text"  # dim 1 of [B, tokens, width]: text in the joint sequence
LATENT_TOKENS = "latent"  # each tensor is a latent, patchified like x (reference latents)


@dataclass(frozen=True)
class CallInput:
    """One input of a family's model call besides x and timestep, by ComfyUI's keyword.

    - `held`: the same for every step of a prompt (text features, reference latents): sent once under a
      key and kept by every rank (serve.py); otherwise it travels with each call (guidance, a placement).
    - `many`: a sequence of tensors (reference latents); `batched`: each tensor's first dimension is the
      call's batch (split by a batch degree); `cast`: floating tensors go to the compute dtype on the ranks
      (a boolean mask stays boolean).
    - `tokens`: what it adds to the sequence the transformer attends over (TEXT_TOKENS, LATENT_TOKENS or
      None): admission and the planner count them.
    - `fix`: what to tell a user whose input holds NaN or inf (the rest of the message names it, as `shown`:
      the name a ComfyUI user knows it by, e.g. "y (pooled_output)"; the input's name when empty).
    """

    name: str
    held: bool = True
    many: bool = False
    batched: bool = True
    cast: bool = True
    tokens: str | None = None
    fix: str = "re-encode the prompt (a broken text encoder or a bad upstream node)"
    shown: str = ""

    @property
    def label(self) -> str:
        return self.shown or self.name


# (dims, batch, text tokens, device) -> example inputs of a call (empty tensors of the right shapes; None
# where a call may leave an input out): what the planner's meta probe and the benchmarks call the model with.
CallExample = Callable[[Any, int, int, Any], Inputs]

# (info, cond, extras, where) -> None: the family's check of one CONDITIONING entry (the text tensor and its
# extras dict, e.g. a pooled vector's width) before anything runs; ConfigError naming `where` otherwise.
PromptCheck = Callable[["CheckpointInfo", Any, Mapping[str, Any], str], None]

# (info, layout, x, timestep, inputs) -> the inputs as they go to the ranks: the family's own shape and
# value checks of one call, with messages in ComfyUI's terms; it may normalise (a text mask to a boolean
# key mask, a guidance the model has no embedder for to None) and fill defaults (an empty tuple of
# references). It runs on every step: cheap checks only (the generic ones run around it).
CallCheck = Callable[["CheckpointInfo", "ParallelLayout", torch.Tensor, torch.Tensor, Inputs], Inputs]


@dataclass(frozen=True)
class CallSpec:
    """A family's model call, as data (its `ModelFamily.call_spec`).

    - `inputs`: every input the family's `call(model_fn, x, timestep, **inputs)` takes, in its order.
    - `positional`: the names `ParallelModel.forward(x, timestep, *args)` binds its positional arguments
      to, in ComfyUI's order for the family's diffusion model.
    - `check`: the family's checks of one call (`CallCheck`).
    - `example`: example inputs for a model of given dims (`CallExample`).
    - `check_prompt`: the family's check of a CONDITIONING entry's extras, for the nodes (`PromptCheck`).
    - `aliases`: older keywords the API still takes for an input ({"ref_method": "ref_latents_method"}).
    """

    inputs: tuple[CallInput, ...]
    check: CallCheck
    example: CallExample
    positional: tuple[str, ...] = ("context",)
    aliases: Mapping[str, str] = None  # type: ignore[assignment]
    check_prompt: PromptCheck | None = None

    def __post_init__(self) -> None:
        if self.aliases is None:
            object.__setattr__(self, "aliases", {})

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(i.name for i in self.inputs)

    def get(self, name: str) -> CallInput | None:
        return next((i for i in self.inputs if i.name == name), None)

    def held(self) -> tuple[CallInput, ...]:
        return tuple(i for i in self.inputs if i.held)

    def per_call(self) -> tuple[CallInput, ...]:
        return tuple(i for i in self.inputs if not i.held)


def bind(spec: CallSpec, args: Sequence[Any], kwargs: Mapping[str, Any], model: str) -> Inputs:
    """The call's inputs by name from `forward(x, timestep, *args, **kwargs)`: positional arguments in
    the family's order, keywords (and their aliases) by name. A keyword the family does not take is refused
    when it carries a value (ComfyUI passes None for what a prompt did not set); so is a name given twice."""
    if len(args) > len(spec.positional):
        raise ConfigError(
            f"{model} takes at most {len(spec.positional)} positional inputs after x and timestep "
            f"({', '.join(spec.positional)}); got {len(args)}: pass the others by name"
        )
    inputs: Inputs = dict(zip(spec.positional, args, strict=False))
    for given, value in kwargs.items():
        name = spec.aliases.get(given, given)
        if name in inputs and not (value is None or inputs[name] is None):
            raise ConfigError(f"{name} was given twice (positionally and as {given}=)")
        if spec.get(name) is None:
            if value is not None:
                raise ConfigError(
                    f"{given} is not an input of {model}'s model call; it takes {', '.join(spec.names)}"
                )
            continue
        if value is not None or name not in inputs:
            inputs[name] = value
    return {i.name: inputs.get(i.name) for i in spec.inputs}


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors an input value holds (none for None or a string)."""
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, list | tuple):
        return [v for v in value if torch.is_tensor(v)]
    return []


def check_call(info: CheckpointInfo, layout: ParallelLayout, x: Any, timestep: Any, inputs: Inputs) -> Inputs:
    """One call checked against the resident checkpoint before any rank runs it, by ComfyUI's names:
    every tensor is a real one (not meta, on a CPU or GPU), the family's own checks pass, the sequence is
    long enough for the layout's context parallelism, and x, the timestep and the per-call inputs hold no
    NaN or inf (a prompt's inputs are checked once, when they are sent: `check_held_values`). Returns the
    inputs as the ranks get them."""
    family = info.model_family
    spec = family.call_spec
    for name, value in (("x", x), ("timestep", timestep), *inputs.items()):
        for i, tensor in enumerate(tensors_of(value)):
            check_real(name if torch.is_tensor(value) else f"{name}[{i}]", tensor)
    checked = spec.check(info, layout, x, timestep, dict(inputs))
    layout.validate_sequence(image_tokens(info, x, checked))
    check_finite(
        "x", x, "the latent entering this model call is broken: check the nodes before the sampler (a VAE "
        "Encode of a broken image, a latent upscale, a noise node)",
    )  # fmt: skip
    check_finite("timestep", timestep, "it is the sampler's sigma: check the scheduler or SIGMAS input")
    for item in spec.per_call():
        for tensor in tensors_of(checked.get(item.name)):
            if tensor.is_floating_point():
                check_finite(item.label, tensor, item.fix)
    return checked


def check_held_values(spec: CallSpec, held: Mapping[str, Any]) -> None:
    """No NaN or inf in a prompt's inputs (checked once per prompt, when it is first sent)."""
    for item in spec.held():
        value = held.get(item.name)
        for i, tensor in enumerate(tensors_of(value)):
            if tensor.is_floating_point():
                check_finite(item.label if torch.is_tensor(value) else f"{item.label}[{i}]", tensor, item.fix)


def image_tokens(info: CheckpointInfo, x: Any, inputs: Mapping[str, Any]) -> int:
    """Tokens of the latent and of every input that joins it (reference latents): what context
    parallelism splits besides the text."""
    geometry = info.model_family.geometry
    tokens = geometry.tokens(tuple(x.shape))
    for item in info.model_family.call_spec.inputs:
        if item.tokens == LATENT_TOKENS:
            tokens += sum(geometry.tokens(tuple(t.shape)) for t in tensors_of(inputs.get(item.name)))
    return tokens


def reference_tokens(info: CheckpointInfo, inputs: Mapping[str, Any]) -> int:
    """Tokens the inputs add to the latent's own (reference latents)."""
    geometry = info.model_family.geometry
    return sum(
        geometry.tokens(tuple(t.shape))
        for item in info.model_family.call_spec.inputs
        if item.tokens == LATENT_TOKENS
        for t in tensors_of(inputs.get(item.name))
    )


def text_tokens(info: CheckpointInfo, inputs: Mapping[str, Any]) -> int:
    """Text tokens of the call (dim 1 of each text input); the family's usual prompt length when none."""
    found = [
        int(t.shape[1])
        for item in info.model_family.call_spec.inputs
        if item.tokens == TEXT_TOKENS
        for t in tensors_of(inputs.get(item.name))
        if t.ndim >= 2
    ]
    return max(sum(found), 1) if found else info.model_family.text.tokens


__all__ = [
    "LATENT_TOKENS",
    "TEXT_TOKENS",
    "CallCheck",
    "CallExample",
    "CallInput",
    "CallSpec",
    "Inputs",
    "PromptCheck",
    "bind",
    "check_call",
    "check_held_values",
    "image_tokens",
    "reference_tokens",
    "tensors_of",
    "text_tokens",
]
