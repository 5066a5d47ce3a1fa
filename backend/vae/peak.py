"""A CPU worker's peak memory during one VAE job, the figures a GPU's `max_memory_allocated` gives there.

torch's CPU allocator keeps no peak counter (there is no `torch.cpu.max_memory_allocated`), so two figures
are measured by hand:

* `LiveBytes`: the peak of the bytes of tensor storages created while it is active and alive at once
  (every storage an aten op returns, counted once when it first appears and uncounted when Python's last
  reference to it goes). What existed before (the weights, the request's input) is not counted, so it is
  the planner's activations (+ the gathered image on rank 0), measured on real kernels: a CPU kernel's own
  scratch outside tensors (oneDNN's workspaces, gloo's buffers) is not in it.
* `ResidentHighWater`: the rise of the process's resident set (Linux `VmHWM`, reset through
  `/proc/self/clear_refs`) over its size at the start: every byte the process touched, scratch included,
  but also blind to memory the C allocator reuses from earlier frees and bloated by what it keeps cached.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary


class LiveBytes(TorchDispatchMode):
    """`peak`: the most bytes of tensor storages created under this mode and alive at one time."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def _count(self, out: Any) -> None:
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            if storage in self._seen:
                continue
            nbytes = storage.nbytes()
            self._seen[storage] = nbytes
            weakref.finalize(storage, self._free, nbytes)
            self.live += nbytes
            self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self._count(out)
        return out


_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kb(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class ResidentHighWater:
    """`rise`: the process's resident high-water mark during the block minus its resident size at the start
    (bytes); 0 where Linux's `/proc/self/clear_refs` cannot reset it (another OS, a read-only /proc)."""

    def __init__(self) -> None:
        self.rise = 0
        self._start: int | None = None

    def __enter__(self) -> ResidentHighWater:
        try:
            _CLEAR_REFS.write_text("5")  # "5": reset the peak RSS (Documentation/filesystems/proc.rst)
            self._start = _status_kb("VmRSS")
        except OSError:
            self._start = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._start is not None:
            self.rise = max(0, _status_kb("VmHWM") - self._start) * 1024


__all__ = ["LiveBytes", "ResidentHighWater"]
