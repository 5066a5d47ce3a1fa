"""What the caller and the workers say about a text encoder (backend/encoders/jobs.py serves them).

| method (encoders/jobs.py) | request             | reply                                       |
|---------------------------|---------------------|---------------------------------------------|
| encoder_load              | EncoderLoadRequest  | LoadReport (resident/messages.py)           |
| encoder_run               | EncodeRequest       | EncodeReply (rank 0: the hidden states)     |
| encoder_offload           | EncoderPlacement    | LoadReport (the shard moved to/from host)   |

An `EncoderLoadRequest` is a resident module request (resident/group.py `ResidentGroup.call_resident`): it
names its slot, its load method and the bytes of weights it puts on each rank, so the group keeps it beside the
diffusion models and evicts it by the same rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import ParallelLayout
from ..runtime.transport import record
from .files import EncoderInfo

ENCODER_SLOT = (
    "text encoder"  # the group's default slot for a text encoder (a graph's second one names its own)
)


@record
@dataclass(frozen=True)
class EncoderLoadRequest:
    """Make the text encoder of `info` resident in `slot`, tensor-parallel over the group (`layout`: tp =
    every device), each rank reading its slices of the file itself.

    `dtypes`: the dtype each parameter is held in, by name (ComfyUI's choice for its own copy, so the pack
    rounds the file's numbers exactly as ComfyUI does: e.g. an fp32 T5 file held in fp16; an fp8 file stays
    fp8); parameters it does not name keep the file's dtype. Linear weights and the token embeddings stay in
    that dtype; norms and biases are held in float32 (the compute dtype: ComfyUI's text encoders compute in
    float32 whatever their weights). `embedding`: "vocab" (the token embeddings split by vocabulary) or
    "replicated". `weight_bytes`: what each rank holds (the planner's count)."""

    checkpoint: str
    info: EncoderInfo
    layout: ParallelLayout
    dtypes: dict[str, str] = field(default_factory=dict, hash=False)
    embedding: str = "vocab"
    weight_bytes: int = 0
    slot: str = ENCODER_SLOT
    load_method: str = "encoder_load"
    park_method: str = (
        "encoder_offload"  # it may wait in host memory between jobs (backend/resident/parking.py)
    )

    def describe(self) -> str:
        """The panel's layout column for a resident text encoder."""
        return f"text encoder, {self.layout.describe()}"

    def placement(self, on_device: bool) -> EncoderPlacement:
        """The park method's message: this encoder to its devices (True) or to host memory (False)."""
        return EncoderPlacement(self.slot, on_device)


@record
@dataclass(frozen=True)
class EncodeRequest:
    """One encode on the text encoder resident in `slot`: ComfyUI's transformer stack on the embeddings of a
    batch of prompts, sent as token ids (`ids` [B, S]; -1 where the row is an embedding ComfyUI made itself, a
    textual inversion or an image's tokens, whose values `external` [n, D] holds for the positions
    `external_at` (flat indices into B x S)) with ComfyUI's `attention_mask` [B, S] (None: no mask),
    `position_ids` ([1, S] or Qwen2.5-VL's [3, S]; None: 0..S-1), and its layer selection."""

    ids: torch.Tensor
    slot: str = ENCODER_SLOT
    external_at: torch.Tensor | None = None
    external: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    intermediate_output: Any = None  # None, an index, a list of indices or "all" (ComfyUI's)
    final_layer_norm_intermediate: bool = True


@record
@dataclass(frozen=True)
class EncodeReply:
    rank: int
    out: torch.Tensor | None  # rank 0: the last hidden state [B, S, D] float32; other ranks: None
    intermediate: torch.Tensor | None  # rank 0: the selected intermediate output, or None
    seconds: float


@record
@dataclass(frozen=True)
class EncoderPlacement:
    """Move the text encoder's shard in `slot` to host memory (`on_device=False`: pinned, each rank its own)
    or back to its device, between a graph's phases (the planner's choice when encoder and diffusion model
    do not fit the GPUs together)."""

    slot: str = ENCODER_SLOT
    on_device: bool = True


__all__ = ["ENCODER_SLOT", "EncodeReply", "EncodeRequest", "EncoderLoadRequest", "EncoderPlacement"]
