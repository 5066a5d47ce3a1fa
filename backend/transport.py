"""Moving tensors between the client and the workers without big pickles over the control socket.

Tensors above a few KiB are written as safetensors files into a private directory on tmpfs
(/dev/shm: shared memory, no disk I/O) and replaced in the message by a small reference. safetensors
holds only raw tensor data, so reading a file never runs code.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from typing import Any

import torch
from safetensors.torch import load_file, save_file

INLINE_LIMIT = 64 * 1024  # bytes; smaller tensors are cheaper to pickle than to put in a file
_REF = "__rocm_parallel_tensor__"
_counter = itertools.count()


def private_dir(prefix: str = "rocm-parallel-") -> str:
    """A 0700 directory on tmpfs when there is one (shared memory), else in the temp directory."""
    shm = "/dev/shm"
    base = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
    return tempfile.mkdtemp(prefix=prefix, dir=base)


def pack(obj: Any, directory: str, tag: str) -> Any:
    """Replace large CPU-copyable tensors in a nested structure by references to files in `directory`."""
    if isinstance(obj, torch.Tensor) and obj.numel() * obj.element_size() > INLINE_LIMIT:
        path = os.path.join(directory, f"{tag}-{os.getpid()}-{next(_counter)}.safetensors")
        save_file({"t": obj.detach().to("cpu").contiguous()}, path)
        return {_REF: path}
    if isinstance(obj, dict):
        return {k: pack(v, directory, tag) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(pack(v, directory, tag) for v in obj)
    return obj


def unpack(obj: Any, remove: bool = True) -> Any:
    """Inverse of `pack`; deletes each file once read unless `remove` is False."""
    if isinstance(obj, dict):
        if set(obj) == {_REF}:
            path = obj[_REF]
            tensor = load_file(path)["t"]
            if remove:
                os.unlink(path)
            return tensor
        return {k: unpack(v, remove) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(unpack(v, remove) for v in obj)
    return obj


def files_in(obj: Any) -> list[str]:
    """Paths referenced by a packed structure (to clean up after a call)."""
    if isinstance(obj, dict):
        if set(obj) == {_REF}:
            return [obj[_REF]]
        return [p for v in obj.values() for p in files_in(v)]
    if isinstance(obj, list | tuple):
        return [p for v in obj for p in files_in(v)]
    return []
