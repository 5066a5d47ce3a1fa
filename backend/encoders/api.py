"""A text encoder resident on a worker group, tensor-parallel: the caller's side.

>>> from rocm_parallel.backend.api import ParallelModel
>>> from rocm_parallel.backend.encoders.api import ParallelEncoder
>>> with ParallelModel(["cuda:0", "cuda:1"]) as group:
...     t5 = ParallelEncoder(group, "models/text_encoders/t5xxl_fp16.safetensors")
...     hidden, _ = t5.encode(ids)       # ids: [B, S] token ids; hidden: [B, S, 4096] float32

The encoder stays resident in its own slot of the group (`messages.ENCODER_SLOT`) beside the diffusion models,
each rank holding its tensor-parallel shard read from the file by itself (attention heads, MLP and, by
default, the token embeddings split). `encode` runs ComfyUI's transformer stack: the ROCm Parallel Text
Encoder Loader (nodes/comfy_clip.py) puts it under ComfyUI's own CLIP, whose tokenizer, templates, layer
selection and post-processing stay ComfyUI's. Everything a caller can get wrong is checked here before any
rank runs: the file (files.py), the split (kind.py), the token ids, the prompt's length, the masks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..config import ConfigError, ParallelLayout
from ..dtypes import dtype_named, stored_dtype
from ..plan.encoder import encoder_bytes
from ..platforms import host_sizes
from ..resident.admission import refuse_unless_fits
from ..resident.group import ResidentGroup
from ..resident.parking import DEFAULT_POLICY, check_policy
from .files import EncoderInfo, inspect_encoder
from .kind import EMBEDDINGS, EncoderKind
from .messages import ENCODER_SLOT, EncodeRequest, EncoderLoadRequest


@dataclass(frozen=True)
class Encoded:
    """An encode's result: the last hidden state [B, S, D] and the selected intermediate output (or None),
    float32, on the CPU."""

    out: torch.Tensor
    intermediate: torch.Tensor | None
    seconds: float


class ParallelEncoder:
    """The text encoder at `checkpoint` on `group`'s ranks (module docstring).

    `dtypes`: the dtype each parameter is held in, by parameter name (ComfyUI's choice; the nodes pass what
    ComfyUI's own CLIP would hold); a name it lacks keeps the file's dtype. `embedding`: "vocab" (the token
    embeddings split over the ranks) or "replicated"."""

    def __init__(
        self,
        group: ResidentGroup,
        checkpoint: str | os.PathLike[str] | EncoderInfo,
        *,
        dtypes: Mapping[str, str] | None = None,
        embedding: str = "vocab",
        slot: str = ENCODER_SLOT,
        placement: str = DEFAULT_POLICY,
    ) -> None:
        self.group = group
        info = checkpoint if isinstance(checkpoint, EncoderInfo) else inspect_encoder(checkpoint)
        if embedding not in EMBEDDINGS:
            raise ConfigError(f"embedding={embedding!r} is not offered; use {' or '.join(EMBEDDINGS)}")
        if not isinstance(slot, str) or not slot:
            raise ConfigError(f"slot={slot!r} must be a non-empty name")
        self.placement = check_policy(placement)
        kind = info.encoder
        degree = len(group.devices)
        if len(host_sizes(group.devices)) > 1:  # every rank holds a TP shard: a host's devices only
            raise ConfigError(
                f"the text encoder is split over every device of its group with tensor parallelism, which stays "
                f"inside a host; devices {', '.join(group.devices)} span hosts: give the text encoder this host's "
                "devices (docs/hosts.md)"
            )
        kind.validate_tp(degree, info.config)
        held = {n: _held_name(info, n, dtypes) for n in info.tensors}
        # a scaled weight is held as stored (fp8); `held` names the dtype ComfyUI dequantizes it to (load.py).
        # Its one scale per tensor (2-4 bytes a layer) is left out of the bytes
        kept = {
            n: stored_dtype(info.tensors[n].dtype) if n in info.scales else dtype_named(d)
            for n, d in held.items()
        }
        weight_bytes = encoder_bytes(kind, info.config, degree, embedding, kept.__getitem__)
        self.info, self.kind = info, kind
        self.request = EncoderLoadRequest(
            checkpoint=info.path,
            info=info,
            layout=ParallelLayout(tp=degree),
            dtypes=held,
            embedding=embedding,
            weight_bytes=weight_bytes,
            slot=slot,
        )
        group.set_park_policy(slot, self.placement)
        self.last_seconds = 0.0

    @property
    def dims(self) -> Any:
        return self.kind.dims(self.info.config)

    def load(self, progress: Any = None) -> None:
        """Make the encoder resident now (otherwise the first `encode` does)."""
        self.group.hold(self.request, progress)

    def place(self, on_device: bool) -> None:
        """Move the shards to pinned host memory (False) or back to the devices (True, loading the encoder
        first if the group does not hold it)."""
        if on_device:
            self.load()
        else:
            self.group.park(self.request.slot)

    @property
    def on_host(self) -> bool:
        """Whether the shards wait in host memory now (the next encode brings them back)."""
        return self.request.slot in self.group.parked

    def check(
        self,
        ids: torch.Tensor,
        *,
        external_at: torch.Tensor | None = None,
        external: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        intermediate_output: Any = None,
        final_layer_norm_intermediate: bool = True,
    ) -> EncodeRequest:
        """Validate an encode before any rank runs; the request the ranks get."""
        return check_encode(
            self.kind,
            self.info,
            self.request.slot,
            ids,
            external_at,
            external,
            attention_mask,
            position_ids,
            intermediate_output,
            final_layer_norm_intermediate,
        )

    def activation_bytes(self, batch: int, tokens: int) -> float:
        """About the bytes one rank allocates to encode `batch` prompts of `tokens` tokens (a rough model, for
        refusing a prompt no device can hold): the stack's [tokens x tokens] maps (the kind's `square_maps`;
        on CPU workers also the attention's scores and softmax, which torch's CPU kernel materialises for a
        masked attention, per local head) and the per-token activations of one layer (the residual stream,
        q/k/v/o and the MLP's share), float32."""
        dims, degree = self.dims, len(self.group.devices)
        heads = dims.heads // degree
        maps = self.kind.square_maps(batch, heads)
        if self.group.devices[0] == "cpu":
            maps += 2 * batch * heads
        per_token = 6 * dims.width + 4 * heads * dims.head_dim + 3 * dims.mlp // degree
        return 4.0 * (maps * tokens * tokens + batch * tokens * per_token)

    def admit(self, batch: int, tokens: int) -> None:
        """Refuse an encode whose activations cannot fit the devices, naming the longest prompt that would
        (a 100,000-token prompt once reached the ranks and one failed allocating 40 GB)."""

        def fits(limit: float) -> str:
            low, high = 0, 1
            while self.activation_bytes(batch, high) <= limit and high < 1 << 24:
                low, high = high, high * 2
            while high - low > 1:
                middle = (low + high) // 2
                low, high = (middle, high) if self.activation_bytes(batch, middle) <= limit else (low, middle)
            return f"prompts of at most {low} tokens (batch {batch}); shorten the prompt"

        need = self.activation_bytes(batch, tokens)
        what = f"encoding a prompt of {tokens} tokens (batch {batch}) with {self.kind.title}"
        refuse_unless_fits(need, self.group.devices, self.group.reports, what=what, fits=fits)

    def encode(self, ids: torch.Tensor, **options: Any) -> Encoded:
        """ComfyUI's transformer stack on token ids [B, S] (`check`'s keywords for the rest)."""
        request = self.check(ids, **options)
        self.admit(*request.ids.shape)
        replies = self.group.call_resident(self.request, "encoder_run", request)
        first = next(r for r in replies if r.rank == 0)
        self.last_seconds = max(r.seconds for r in replies)
        if self.group.park_policy.get(self.request.slot) == "host":
            self.group.park(self.request.slot)
        return Encoded(first.out, first.intermediate, self.last_seconds)


def _held_name(info: EncoderInfo, name: str, dtypes: Mapping[str, str] | None) -> str:
    given = (dtypes or {}).get(name)
    if given is not None:
        found = dtype_named(given)
        if found is None or not (found.compute or found.fp8):
            raise ConfigError(f"dtypes[{name!r}]={given!r} is not a dtype the pack holds weights in")
        return found.name
    stored = stored_dtype(info.tensors[name].dtype)
    if stored is None or not (stored.compute or stored.fp8):
        raise ConfigError(
            f"'{info.path}': tensor '{info.encoder.prefix}{name}' is stored as {info.tensors[name].dtype}, which "
            "the pack cannot hold (bf16, fp16, fp32, fp8 e4m3fn / e5m2)"
        )
    return stored.name


def check_encode(
    kind: EncoderKind,
    info: EncoderInfo,
    slot: str,
    ids: Any,
    external_at: Any,
    external: Any,
    attention_mask: Any,
    position_ids: Any,
    intermediate_output: Any,
    final_layer_norm_intermediate: bool,
) -> EncodeRequest:
    dims = kind.dims(info.config)
    if not torch.is_tensor(ids) or ids.ndim != 2 or ids.dtype not in (torch.int64, torch.int32):
        raise ConfigError(f"ids must be an integer tensor [batch, tokens]; got {_describe(ids)}")
    batch, tokens = ids.shape
    if tokens == 0 or batch == 0:
        raise ConfigError(f"ids {list(ids.shape)} holds no prompt")
    if dims.max_tokens and tokens > dims.max_tokens:
        raise ConfigError(
            f"the prompt is {tokens} tokens long; {kind.title} takes at most {dims.max_tokens} "
            f"(its position embeddings): shorten the prompt"
        )
    high = int(ids.max())
    if high >= dims.vocab:
        raise ConfigError(
            f"token id {high} is outside {kind.title}'s vocabulary of {dims.vocab} tokens: the tokenizer and "
            f"the file '{info.name}' do not belong together"
        )
    marked = ids < 0
    count = int(marked.sum())
    if count:
        if external is None or external_at is None:
            raise ConfigError(f"{count} positions are marked as embeddings (-1) but no embeddings were given")
        if external.ndim != 2 or external.shape != (count, dims.width) or external_at.shape != (count,):
            raise ConfigError(
                f"embeddings for {count} positions must be [{count}, {dims.width}] with {count} indices; got "
                f"{list(external.shape)} and {list(external_at.shape)}"
            )
        if not torch.equal(torch.sort(external_at.long()).values, marked.flatten().nonzero().flatten()):
            raise ConfigError("the embeddings' indices are not the positions marked -1 in ids")
    elif external is not None:
        raise ConfigError("embeddings were given but no position of ids is marked -1")
    if attention_mask is not None and tuple(attention_mask.shape) != (batch, tokens):
        raise ConfigError(
            f"attention_mask must be [{batch}, {tokens}] like ids; got {list(attention_mask.shape)}"
        )
    if position_ids is not None and (position_ids.ndim != 2 or position_ids.shape[1] != tokens):
        raise ConfigError(f"position_ids must be [rows, {tokens}]; got {list(position_ids.shape)}")
    return EncodeRequest(
        ids=ids.long(),
        slot=slot,
        external_at=external_at.long() if count else None,
        external=external.to(torch.float32) if count else None,
        attention_mask=attention_mask,
        position_ids=position_ids,
        intermediate_output=intermediate_output,
        final_layer_norm_intermediate=final_layer_norm_intermediate,
    )


def _describe(value: Any) -> str:
    if torch.is_tensor(value):
        return f"a {value.dtype} tensor {list(value.shape)}"
    return type(value).__name__


__all__ = ["Encoded", "ParallelEncoder", "check_encode"]
