"""The planner's model facts as data: `ModelFacts`, and every family preset's facts stored in facts.json.

Deriving a model's facts means building the family's diffusers model on the meta device (shapes.py), which
imports diffusers and torch's compiler: 40-68 s on a busy 2-core machine, for numbers that only change when
a family's model, TP plan or presets do. So `python -m rocm_parallel plan` reads the released models' facts
from facts.json, written by tests/tools/make_plan_facts.py from the meta model; tests/test_plan_facts.py
checks in CI that the file equals the meta model's facts for every preset, so it cannot go stale unseen.
Dims that are no preset's (a fine-tune with other widths, a tiny test model) fall back to the meta model.

The stored form is compact: parameters of repeated blocks are one entry (`transformer_blocks.{}.attn.to_q.weight`,
its block count, shape and TP split), and a split is its kind's name and fields (`{"kind": "Row", "reduce":
false}`), so nothing in the file depends on how a family spells its plan's patterns.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import ModelDims
from ..parallel import splits  # the split kinds, torch-free

FACTS_FILE = Path(__file__).with_name("facts.json")
_INDEX = re.compile(r"\.(\d+)\.")  # the first numeric path component: a repeated block's index


@dataclass(frozen=True)
class ModelFacts:
    """One family's model with given dims, as the planner prices it."""

    # (name, shape, TP split or None, whether the model class keeps it in float32: `_keep_in_fp32_modules`)
    parameters: tuple[tuple[str, tuple[int, ...], Any, bool], ...]
    modulation_width: int  # features of all Gathered (AdaLN modulation) outputs of one forward
    tp_all_reduces: int  # activation all-reduces of one forward under TP
    norm_all_reduces: int  # [tokens x 1] statistics all-reduces of norms across heads (NormAcrossHeads)
    attentions: int  # attention calls per forward over the sequence context parallelism splits
    # attention calls whose keys are the text alone (a family whose text is not joint: cross-attention from
    # the image tokens, local on every rank)
    cross_attentions: int
    image_macs: int  # multiply-accumulates per image token in the linear layers that read only image tokens
    text_macs: int  # ... only text tokens
    joint_macs: int  # ... the joint sequence (single-stream blocks)


_COUNTS = ("modulation_width", "tp_all_reduces", "norm_all_reduces", "attentions", "cross_attentions",
           "image_macs", "text_macs", "joint_macs")  # fmt: skip


def _split_record(split: Any) -> dict[str, Any] | None:
    if split is None:
        return None
    return {"kind": type(split).__name__, **dataclasses.asdict(split)}


def _split(record: Mapping[str, Any] | None) -> Any:
    if record is None:
        return None
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in record.items() if k != "kind"}
    return getattr(splits, record["kind"])(**fields)


def encode(facts: ModelFacts, dims: ModelDims) -> dict[str, Any]:
    """`facts` as facts.json stores them (plain JSON types): counts, then parameters grouped by block."""
    groups: dict[tuple[str, tuple[int, ...], str, bool], list[int]] = {}
    for name, shape, split, fp32 in facts.parameters:
        match = _INDEX.search(name)
        template = name if match is None else f"{name[: match.start()]}.{{}}.{name[match.end() :]}"
        key = (template, tuple(shape), json.dumps(_split_record(split), sort_keys=True), fp32)
        groups.setdefault(key, []).append(-1 if match is None else int(match.group(1)))
    parameters = []
    for (template, shape, split, fp32), indices in groups.items():
        entry: dict[str, Any] = {"name": template, "shape": list(shape), "split": json.loads(split)}
        if fp32:  # kept in float32 by the model class (only then stored: most parameters are not)
            entry["fp32"] = True
        if indices != [-1]:
            entry["blocks"] = len(indices) if indices == list(range(len(indices))) else indices
        parameters.append(entry)
    dims_record = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(dims).items()}
    return {"dims": dims_record, **{k: getattr(facts, k) for k in _COUNTS}, "parameters": parameters}


def decode(record: Mapping[str, Any]) -> ModelFacts:
    """The ModelFacts a facts.json record stores (parameters block by block)."""
    parameters = []
    for entry in record["parameters"]:
        split, shape, blocks = _split(entry["split"]), tuple(entry["shape"]), entry.get("blocks")
        indices = [None] if blocks is None else range(blocks) if isinstance(blocks, int) else blocks
        for i in indices:
            name = entry["name"] if i is None else entry["name"].replace("{}", str(i), 1)
            parameters.append((name, shape, split, bool(entry.get("fp32", False))))
    return ModelFacts(parameters=tuple(parameters), **{k: record[k] for k in _COUNTS})


@functools.cache
def stored() -> dict[str, dict[str, Any]]:
    """facts.json: family name -> preset name -> record (empty when the file is absent)."""
    return json.loads(FACTS_FILE.read_text()) if FACTS_FILE.is_file() else {}


def stored_facts(family: Any, dims: ModelDims) -> ModelFacts | None:
    """The stored facts of the `family` (a ModelFamily) preset whose dims are `dims`, or None when no preset
    has them (the caller derives them from the meta model then)."""
    records = stored().get(family.name, {})
    for preset, config in family.presets.items():
        if preset in records and family.dims(config) == dims:
            return decode(records[preset])
    return None


__all__ = ["FACTS_FILE", "ModelFacts", "decode", "encode", "stored", "stored_facts"]
