"""Reading the parts of a LoRA tensor a shard needs, as float32 (ComfyUI's `intermediate_dtype`).

safetensors' slices read only the requested rows (and columns) from the file, so a rank reads its rows of
`up` and its columns of `down`, never a whole fused factor it does not need.
"""

from __future__ import annotations

from typing import Any

import torch

from .records import LoraModule, Ranges, Segments

Device = str | torch.device


def _cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def read_all(f: Any, key: str, device: Device = "cpu") -> torch.Tensor:
    """Tensor `key` of open file `f`, as float32 on `device`."""
    return f.get_tensor(key).to(device, torch.float32)


def read_rows(f: Any, key: str, rows: Ranges, device: Device = "cpu") -> torch.Tensor:
    """Rows `rows` (concatenated) of tensor `key`."""
    sl = f.get_slice(key)
    return _cat([sl[a:b].to(device, torch.float32) for a, b in rows], 0)


def read_cols(f: Any, key: str, cols: Ranges | None, device: Device = "cpu") -> torch.Tensor:
    """Columns `cols` (concatenated; None: all) of the 2-D tensor `key`."""
    sl = f.get_slice(key)
    if cols is None:
        return sl[:].to(device, torch.float32)
    return _cat([sl[:, c:d].to(device, torch.float32) for c, d in cols], 1)


def read_block(f: Any, key: str, rows: Ranges, cols: Ranges | None, device: Device = "cpu") -> torch.Tensor:
    """Rows `rows` x columns `cols` of the 2-D tensor `key` (a 1-D tensor: its `rows`)."""
    sl = f.get_slice(key)
    if len(sl.get_shape()) == 1 or cols is None:
        return _cat([sl[a:b].to(device, torch.float32) for a, b in rows], 0)
    return _cat([_cat([sl[a:b, c:d].to(device, torch.float32) for c, d in cols], 1) for a, b in rows], 0)


def indices(ranges: Ranges, device: Device = "cpu") -> torch.Tensor:
    """The integers of `ranges`, in order."""
    if not ranges:
        return torch.zeros(0, dtype=torch.long, device=device)
    return torch.cat([torch.arange(a, b, device=device) for a, b in ranges])


def map_rows(segments: Segments, rows: Ranges) -> list[tuple[int, int]]:
    """`rows` (ranges of segments' source rows) as ranges of their destination rows, in order.

    segments: (destination row, source row, rows); every source row in `rows` must be covered.
    """
    out: list[tuple[int, int]] = []
    for a, b in rows:
        pos = a
        while pos < b:
            for dst, src, n in segments:
                if src <= pos < src + n:
                    stop = min(b, src + n)
                    out.append((dst + pos - src, dst + stop - src))
                    pos = stop
                    break
            else:
                raise ValueError(f"row {pos} is outside the segments {segments}")
    return out


def delta_ranges(module: LoraModule, rows: Ranges) -> list[tuple[int, int]]:
    """The file's delta rows holding the module's weight `rows` (they differ where ComfyUI reorders the delta:
    `delta_rows` maps weight rows to delta rows)."""
    flipped = tuple((delta, weight, n) for weight, delta, n in module.delta_rows)
    return map_rows(flipped, rows)


__all__ = [
    "Device",
    "delta_ranges",
    "indices",
    "map_rows",
    "read_all",
    "read_block",
    "read_cols",
    "read_rows",
]
