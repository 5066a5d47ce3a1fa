"""Count the collectives a piece of code issues, with their payload sizes.

torch's CommDebugMode does the counting but its module tracker fails on diffusers' FluxTransformer2DModel
(IndexError in `_fw_set_module_hook`, torch 2.13), so this is the same dispatch-level idea without
module tracking, plus byte counts.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# c10d op -> (kind, which argument carries the payload)
_PAYLOAD = {
    "allreduce_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 0),  # output buffer: the gathered size
    "allgather_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
    "alltoall_base_": ("all_to_all", 0),
    "alltoall_": ("all_to_all", 0),
    "broadcast_": ("broadcast", 0),
    "send": ("send", 0),
    "recv_": ("recv", 0),
}


def _bytes(arg: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(arg) if isinstance(t, torch.Tensor))


@dataclass
class CollectiveLog:
    counts: Counter[str] = field(default_factory=Counter)
    payload_bytes: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def wire_bytes_per_rank(self, world_size: int) -> float:
        """Bytes each rank sends with ring algorithms: all-reduce 2(N-1)/N, gathers/scatters (N-1)/N."""
        n = world_size
        factors = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
                   "all_to_all": (n - 1) / n}
        return sum(self.payload_bytes[k] * factors.get(k, 1.0) for k in self.payload_bytes)


class CountCollectives(TorchDispatchMode):
    """`with CountCollectives() as log: ...` then `log.log.counts['all_reduce']`."""

    def __init__(self) -> None:
        super().__init__()
        self.log = CollectiveLog()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        packet = func._overloadpacket
        if packet.__module__.endswith("c10d") or getattr(func, "namespace", "") == "c10d":
            name = packet.__name__
            kind, index = _PAYLOAD.get(name, (name, 0))
            self.log.counts[kind] += 1
            self.log.payload_bytes[kind] += _bytes(args[index]) if len(args) > index else 0
        return func(*args, **(kwargs or {}))
