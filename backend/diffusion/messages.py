"""What the caller and the workers say about a diffusion model: its load and its model calls
(diffusion/jobs.py and diffusion/serve.py serve them; forward_client.py is the caller's side).

| method (module)                 | request          | reply                                   |
|---------------------------------|------------------|-----------------------------------------|
| load (diffusion/jobs.py)        | LoadRequest      | LoadReport (resident/messages.py)       |
| model_call (diffusion/serve.py) | ForwardRequest   | ForwardReply                            |

Status and unloads are every resident model's (resident/messages.py).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..checkpoint import CheckpointInfo, StoredTensor
from ..config import DEFAULT_SLOT, ParallelLayout
from ..runtime.transport import record, register

# The layout and the checkpoint's header travel as they are: the workers neither rebuild the layout from
# numbers nor read the header again.
register(ParallelLayout, CheckpointInfo, StoredTensor)

Lora = tuple[str, float]  # (path, strength), applied in order


# --------------------------------------------------------------------------------------------------
# Loading and status


@record
@dataclass(frozen=True)
class Loaded:
    """What a rank holds, as its status reports it (and what it compares to decide a reload)."""

    checkpoint: str  # the path as the caller named it
    layout: ParallelLayout
    dtype: str | None
    weight_dtype: str
    attention: str | None = None
    loras: tuple[Lora, ...] = ()
    compile: str = "off"  # compile.COMPILE_MODES: the repeated blocks compiled on every rank

    def same_weights(self, other: Any) -> bool:
        """The same model in the same layout, whatever the LoRAs: a LoRA change re-reads only what they touch."""
        return isinstance(other, Loaded) and replace(self, loras=()) == replace(other, loras=())


@record
@dataclass(frozen=True)
class LoadRequest:
    """Make `checkpoint` resident in `layout` with `loras` applied; what `ParallelModel.resident` keeps.

    `info` is the caller's reading of the checkpoint's header (read once per run and carried along);
    `dtype` the compute dtype (None: the devices' default); `weight_dtype` how the linear weights are held
    (config.WEIGHT_DTYPE_BYTES: 'default', 'fp8_e4m3fn', 'fp8_e5m2', 'compute'); `compile` whether the
    repeated transformer blocks run compiled (compile.py; 'off', 'inductor', 'aot_eager'); `slot` which of
    the group's resident models it is (a graph that uses two models keeps both, each in its own slot).
    """

    checkpoint: str
    info: CheckpointInfo
    layout: ParallelLayout
    dtype: str | None = None
    weight_dtype: str = "default"
    attention: str | None = None
    loras: tuple[Lora, ...] = ()
    compile: str = "off"
    slot: str = DEFAULT_SLOT  # which of the group's resident models this is (several can be resident)

    def weight_bytes_on(self, device: str) -> int:
        """Parameter bytes one rank holds for this model on `device`: the planner's exact count for its layout
        and dtypes (what the group weighs against the devices' memory: resident/group.py)."""
        from ..checkpoint import planned_weight_dtype, resolve_dtype
        from ..dtypes import WEIGHT_DTYPES, compute_dtype_named
        from ..plan import weight_bytes

        compute = str(resolve_dtype(self.dtype, device)).removeprefix("torch.")
        fp8 = WEIGHT_DTYPES.get(planned_weight_dtype(self.weight_dtype, self.info))
        return weight_bytes(
            self.info.dims,
            self.layout,
            compute_dtype_named(compute).bytes,
            family=self.info.family,
            linear_bytes=fp8.bytes if fp8 is not None else None,
        )

    def loaded(self) -> Loaded:
        return Loaded(
            self.checkpoint,
            self.layout,
            self.dtype,
            self.weight_dtype,
            self.attention,
            self.loras,
            self.compile,
        )


# --------------------------------------------------------------------------------------------------
# The forward service (serve.py on the workers, forward_client.py in the caller)

CONDITIONING_SLOTS = 4  # prompts kept per rank: a CFG batch, a second sampler, a refiner pass


@record
@dataclass(frozen=True)
class Conditioning:
    """A prompt's inputs of a model call, by the family's names (its `CallSpec`'s held inputs: the text
    features, a pooled vector, reference latents, a text key mask, ...; None where a prompt has none): sent
    once, kept by every rank under a key."""

    inputs: dict[str, Any]


@record
@dataclass(frozen=True)
class ForwardRequest:
    """One model call, ComfyUI's `diffusion_model(x, timestep, **inputs)`: the prompt's inputs held under
    `cond_key` (sent along as `cond` when the ranks lack them) and the inputs that change every call
    (`inputs`: guidance, a placement) on the model resident in `slot`."""

    x: torch.Tensor
    timestep: torch.Tensor
    cond_key: int
    inputs: dict[str, Any] = field(default_factory=dict)
    cond: Conditioning | None = None
    slot: str = DEFAULT_SLOT


@record
@dataclass(frozen=True)
class ForwardReply:
    rank: int
    out: torch.Tensor | None  # rank 0: the output [B, C, H, W] in the compute dtype; other ranks: None
    seconds: float  # the forward on this rank
    compiled: str | None = None  # compile.note_compiles' line when this call compiled the blocks
    # rank 0: whether `out` holds no NaN or inf, checked where it was just written (in cache; the caller's
    # own pass over the fresh copy it reads cost 0.4 ms of a 1 MB output, `bench call`)
    finite: bool = True


class ConditioningSlots:
    """Least recently used key -> value, `CONDITIONING_SLOTS` long. The client and every rank make the
    same uses in the same order, so they evict the same keys (the rule both sides of the service share)."""

    def __init__(self, capacity: int = CONDITIONING_SLOTS) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[int, Any] = OrderedDict()

    def get(self, key: int) -> Any:
        value = self.entries.get(key)
        if value is not None:
            self.entries.move_to_end(key)
        return value

    def put(self, key: int, value: Any) -> None:
        self.entries[key] = value
        self.entries.move_to_end(key)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def forget(self, key: int) -> None:
        self.entries.pop(key, None)
