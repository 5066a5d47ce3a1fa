"""The vocabulary of a tensor-parallel plan and which slice of a tensor each rank keeps: the split kinds
(`Column`, `Row`, `PackedRow`, `PackedColumn`, `Gathered`, `NormAcrossHeads`, `Vocab`) and `shard_pieces`.

Plain data and arithmetic, without torch: `python -m rocm_parallel plan` decodes its stored model facts into
these kinds and prices a rank's shard with `shard_pieces`, and importing torch would cost it ~2 s of CPU on a
2-core machine. tensor.py (the engine, which applies a plan) imports and re-exports all of it; the checkpoint
loader reads exactly these pieces from disk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the tensor type of `Pieces.take`; importing it here would make this module import torch
    import torch

    from ..config import ModelDims


# --------------------------------------------------------------------------------------------------
# Split kinds (the vocabulary of a plan)


@dataclass(frozen=True)
class Column:
    """Output features split across ranks; the input is replicated, the output stays sharded."""


@dataclass(frozen=True)
class Row:
    """Input features split; each rank yields a partial sum. The bias is added once, after the reduction.

    reduce=False leaves the partial sum to the owning block, which reduces several at once.
    """

    reduce: bool = True


@dataclass(frozen=True)
class PackedRow:
    """Row-parallel over an input that concatenates independently column-sharded parts.

    FLUX's single-block `proj_out` reads cat(attention [hidden], mlp [mlp]); each rank owns its slice of
    *each* part. A contiguous split of the whole input would pair rank 0's attention columns with
    rank 1's activations: silent noise, not an error.
    """

    parts: tuple[str, ...] = ("hidden", "mlp")


@dataclass(frozen=True)
class Gathered:
    """AdaLN modulation: output split, full vector rebuilt by one all-gather shared by all such layers."""


@dataclass(frozen=True)
class PackedColumn:
    """Column-parallel over an output that concatenates independent parts (FLUX.2's fused projections).

    FLUX.2's single-block `to_qkv_mlp_proj` writes [q | k | v | gate | up] and its SwiGLU feed-forward
    `linear_in` writes [gate | up]; the processor splits the local output by the same proportions and
    SwiGLU halves it. Each rank must therefore own its slice of *each* part, in part order: a contiguous
    split would hand rank 0 all of q and k and rank 1 v and the MLP (silent noise, not an error).
    """

    parts: tuple[str, ...]


@dataclass(frozen=True)
class NormAcrossHeads:
    """An RMS norm over the whole attention width, all heads together (Wan's `norm_q` / `norm_k`, diffusers'
    qk_norm "rms_norm_across_heads"), applied to a column-parallel projection's output. Each rank holds its
    heads' slice of the norm's weight; the mean of squares is a sum over every rank's slice: one small
    all-reduce of [B, S, 1] per call (`HeadShardedRMSNorm`). A per-rank norm would normalise each rank's heads
    by their own statistics: silent noise, not an error."""


@dataclass(frozen=True)
class Vocab:
    """An embedding table split by rows (tokens): each rank holds a block of the vocabulary and one
    all-reduce rebuilds the looked-up rows (parallel/vocab.py). A text encoder's token embeddings."""


Split = Column | Row | PackedRow | PackedColumn | Gathered | NormAcrossHeads | Vocab

# --------------------------------------------------------------------------------------------------
# Slicing: which part of a full tensor a rank keeps. Shared with the checkpoint loader, which reads
# exactly these pieces from disk.


@dataclass(frozen=True)
class Pieces:
    """A rank's shard of one tensor: the concatenation along `dim` of the [start, stop) ranges."""

    dim: int
    ranges: tuple[tuple[int, int], ...]

    def take(self, full: torch.Tensor) -> torch.Tensor:
        import torch  # only here: the planner uses `shape`, never `take`

        parts = [full.narrow(self.dim, a, b - a) for a, b in self.ranges]
        # clone: a narrow view would keep the whole unsharded storage alive.
        return (parts[0] if len(parts) == 1 else torch.cat(parts, self.dim)).clone(
            memory_format=torch.contiguous_format
        )

    def shape(self, full_shape: tuple[int, ...]) -> tuple[int, ...]:
        out = list(full_shape)
        out[self.dim] = sum(b - a for a, b in self.ranges)
        return tuple(out)


def vocab_range(size: int, rank: int, degree: int) -> tuple[int, int]:
    """Rows [start, stop) of a table of `size` rows that `rank` holds: blocks of ceil(size / degree), the last
    rank's shorter when the degree does not divide the vocabulary (T5's 32128 rows over 3 ranks, say)."""
    block = -(-size // degree)
    return min(rank * block, size), min((rank + 1) * block, size)


def _even(size: int, rank: int, degree: int, offset: int = 0) -> tuple[int, int]:
    chunk = size // degree
    return (offset + rank * chunk, offset + (rank + 1) * chunk)


def shard_pieces(
    split: Split, param: str, full_shape: tuple[int, ...], rank: int, degree: int, dims: ModelDims
) -> Pieces | None:
    """The slice of parameter `param` ('weight' or 'bias') that `rank` keeps, or None when replicated."""
    if isinstance(split, Column | Gathered | NormAcrossHeads):
        return Pieces(0, (_even(full_shape[0], rank, degree),))
    if isinstance(split, Vocab):  # blocks of ceil(rows / degree): a vocabulary need not divide
        return Pieces(0, (vocab_range(full_shape[0], rank, degree),))
    if isinstance(split, PackedColumn):  # weight rows and bias entries alike
        return Pieces(0, _packed_ranges(split.parts, full_shape[0], rank, degree, dims, "output"))
    if param != "weight":  # row-parallel bias: whole on every rank, added after the reduction
        return None
    if isinstance(split, Row):
        return Pieces(1, (_even(full_shape[1], rank, degree),))
    if isinstance(split, PackedRow):
        return Pieces(1, _packed_ranges(split.parts, full_shape[1], rank, degree, dims, "input"))
    raise TypeError(f"unknown split kind {split!r}")


def _packed_ranges(
    parts: tuple[str, ...], total: int, rank: int, degree: int, dims: ModelDims, side: str
) -> tuple[tuple[int, int], ...]:
    """This rank's range in each part of a packed dimension, in part order."""
    sizes = [getattr(dims, part) for part in parts]
    if sum(sizes) != total:
        raise ValueError(f"packed {side} of {total} features is not {parts} = {sizes}")
    return section_ranges(sizes, rank, degree)


def section_ranges(sizes: Sequence[int], rank: int, degree: int) -> tuple[tuple[int, int], ...]:
    """This rank's range in each of the consecutive sections of widths `sizes` (a fused q | k | v | mlp
    dimension), each section split evenly, in section order."""
    ranges, offset = [], 0
    for size in sizes:
        ranges.append(_even(size, rank, degree, offset))
        offset += size
    return tuple(ranges)


__all__ = [
    "Column",
    "Gathered",
    "NormAcrossHeads",
    "PackedColumn",
    "PackedRow",
    "Pieces",
    "Row",
    "Split",
    "Vocab",
    "section_ranges",
    "shard_pieces",
    "vocab_range",
]
