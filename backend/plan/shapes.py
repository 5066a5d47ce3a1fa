"""What the planner knows about a model, derived from the family's meta model: shapes, splits, work.

Nothing here is written per family. For a family and its dims, the family's own diffusers model is built
once on the meta device (no weights; cached) from `config_from_dims`, and read:

* every parameter's shape, and the split the family's TP plan gives it (the engine's `shard_pieces`
  then says what a rank keeps): exact weight bytes per rank;
* the modulation vector width (the out features of the plan's `Gathered` layers: one all-gather) and the
  all-reduces one TP forward issues (`BlockForward.reductions` per replaced block, plus one per
  row-parallel layer that reduces itself);
* the work of a forward: one tiny call through the family's own `call` on meta tensors, with hooks that
  record which linear layers read image tokens, text tokens or both (per-token MACs), and how many
  attention calls there are. Per-token work scales linearly with the tokens, so one call prices any size.

The released models' facts are stored (facts.py, facts.json) so that `plan` does not import diffusers;
`model_facts` reads them first and builds the meta model only for other dims.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

from ..config import ModelDims, ParallelLayout
from ..family import families, get_family
from ..parallel.splits import shard_pieces
from .facts import ModelFacts, stored_facts

# The probe call's token counts: distinct, so a layer's input length says which tokens it read.
_PROBE_IMAGE_PATCHES = (1, 2)  # (rows, columns) of patches: 2 image tokens
_PROBE_TEXT = 3


@functools.lru_cache(maxsize=32)
def model_facts(family: str, dims: ModelDims) -> ModelFacts:
    """The facts of `family`'s model with `dims`: a released model's from facts.json (no diffusers import),
    any other's from the meta model (built once per family and dims)."""
    return stored_facts(get_family(family), dims) or meta_model_facts(family, dims)


def meta_model_facts(family: str, dims: ModelDims) -> ModelFacts:
    """The facts of `family`'s model with `dims`, read from its diffusers model built on the meta device."""
    import torch
    from torch import nn

    from ..checkpoint.load import kept_in_fp32
    from ..parallel.tensor import Gathered, NormAcrossHeads, PackedRow, Row, resolve_plan

    fam = get_family(family)
    config = fam.config_from_dims(dims)
    model = fam.build(config, device="meta")
    splits = fam.tp.resolve(model)
    parameters = tuple(
        (name, tuple(p.shape), splits.get(name.rpartition(".")[0]), kept_in_fp32(model, name))
        for name, p in model.named_parameters()
    )
    modulation = sum(
        model.get_submodule(m).out_features for m, s in splits.items() if isinstance(s, Gathered)
    )
    reducing = sum(isinstance(s, PackedRow) or (isinstance(s, Row) and s.reduce) for s in splits.values())
    norms = sum(isinstance(s, NormAcrossHeads) for s in splits.values())
    blocks = resolve_plan(model, fam.tp.block_forwards)
    all_reduces = reducing + sum(b.reductions for b in blocks.values())

    image = math.prod(_PROBE_IMAGE_PATCHES)
    macs = {image: 0, _PROBE_TEXT: 0, image + _PROBE_TEXT: 0}
    attentions = {False: 0, True: 0}  # cross-attention -> calls

    def linear(module: nn.Linear, args: tuple[Any, ...]) -> None:
        x = args[0] if args else None
        if (
            x is not None and x.dim() == 3
        ):  # [batch, tokens, features]; [batch, features] reads one vector per image
            macs[x.shape[1]] += module.in_features * module.out_features

    def attention(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # diffusers' attention modules take (hidden_states, encoder_hidden_states, ...): with a text that does
        # not join the image tokens, a call given the text attends to it only
        text = kwargs.get("encoder_hidden_states", args[1] if len(args) > 1 else None)
        attentions[text is not None and not fam.text.joint] += 1

    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_pre_hook(linear)
        elif hasattr(module, "processor"):
            module.register_forward_pre_hook(attention, with_kwargs=True)
    _, ph, pw = fam.geometry.patch
    rows, cols = _PROBE_IMAGE_PATCHES[0] * ph, _PROBE_IMAGE_PATCHES[1] * pw
    x = torch.empty(1, fam.input_channels(config), rows, cols, device="meta")
    if fam.latent.dimensions == 3:
        x = x.unsqueeze(2)  # one frame
    step = torch.empty(1, device="meta")
    inputs = fam.call_spec.example(dims, 1, _PROBE_TEXT, "meta")
    with torch.no_grad():
        fam.call(fam.model_fn(model), x, step, **inputs)
    return ModelFacts(
        parameters=parameters,
        modulation_width=modulation,
        tp_all_reduces=all_reduces,
        norm_all_reduces=norms,
        attentions=attentions[False],
        cross_attentions=attentions[True],
        image_macs=macs[image],
        text_macs=macs[_PROBE_TEXT],
        joint_macs=macs[image + _PROBE_TEXT],
    )


def weight_bytes(
    dims: ModelDims,
    layout: ParallelLayout,
    dtype_bytes: int,
    rank: int = 0,
    family: str | None = None,
    linear_bytes: float | None = None,
    linear_bytes_of: Mapping[str, float] | None = None,
) -> int:
    """Parameter bytes one rank holds in `layout`: a TP shard, or the full model under context parallelism.

    `family`: the model family whose shapes and TP plan count (the first registered when None). `linear_bytes`: bytes
    per element of the linear weights (the 2-D parameters) when they are held in another dtype than the
    rest (fp8 weights: 1; GGUF blocks: their bytes per value); biases and norm scales always take `dtype_bytes`,
    and the modules the model class keeps in float32 (diffusers' `_keep_in_fp32_modules`, e.g. Wan's time
    embedder) 4 bytes, as in the loader
    (checkpoint/load.py resident_dtype). `linear_bytes_of`: a checkpoint's own bytes per value for the linear
    weights it names, tensor by tensor (plan.setup.FileWeights: a GGUF file mixing Q4_K and Q6_K).
    """
    linear = dtype_bytes if linear_bytes is None else linear_bytes
    own = linear_bytes_of or {}
    total = 0.0
    for name, shape, split, fp32 in model_facts(family or families()[0].name, dims).parameters:
        pieces = None
        if layout.tp > 1 and split is not None:
            pieces = shard_pieces(split, name.rpartition(".")[2], shape, rank, layout.tp, dims)
        held = shape if pieces is None else pieces.shape(shape)
        size = max(dtype_bytes, 4) if fp32 else own.get(name, linear) if len(shape) == 2 else dtype_bytes
        total += size * math.prod(held)
    return round(total)  # a GGUF type's bytes per value are fractional


def split_inside_block(
    dims: ModelDims, tp: int, family: str | None, blocks: Mapping[str, int]
) -> tuple[str, int, int] | None:
    """The first quantized linear weight whose rows tensor parallelism of degree `tp` would split inside a
    quantization block, as (parameter, the value where, its block); None when every rank holds whole blocks.
    `blocks`: parameter name -> block (plan.setup.Setup.quantized_blocks). The loader's own check, on the
    file's tensors, is checkpoint/gguf.py `check_block_splits`; this one needs no torch."""
    if tp == 1 or not blocks:
        return None
    for name, shape, split, _ in model_facts(family or families()[0].name, dims).parameters:
        block = blocks.get(name)
        if not block or split is None:
            continue
        for rank in range(tp):
            pieces = shard_pieces(split, name.rpartition(".")[2], shape, rank, tp, dims)
            if pieces is None or pieces.dim == 0:  # whole rows: a block never crosses a row
                continue
            for edge in (e for r in pieces.ranges for e in r):
                if edge % block:
                    return name, edge, block
    return None


__all__ = ["ModelFacts", "meta_model_facts", "model_facts", "split_inside_block", "weight_bytes"]
