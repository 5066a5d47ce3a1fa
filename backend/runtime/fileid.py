"""Is the file on another host the same as this one's? Its size and a hash of its header, compared before any
rank loads it (docs/hosts.md).

The header of a checkpoint names every tensor with its dtype, shape and offset: two files with the same size
and header hold the same tensors at the same places (a re-quantized, pruned or other release differs there).
Reading the header costs a few MB at most, where hashing a 24 GB file would take a minute per host.

- safetensors: the 8-byte length and the JSON header it announces;
- GGUF: everything before the tensor data (key-value metadata and tensor infos), walked here (the `gguf`
  package reads the same, but imports numpy into the runtime for one offset);
- any other file (a LoRA in .pt, a config): its first MiB; a folder (a diffusers model): each file's.

Torch-free: the caller's side and the agent run it.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from typing import BinaryIO

OTHER_HEAD = 1 << 20  # bytes hashed of a file that is neither safetensors nor GGUF
MAX_HEADER = 512 << 20  # a header longer than this is no checkpoint's: hash the first MiB instead
GGUF_MAGIC = b"GGUF"
# GGUF value types (gguf spec): fixed sizes by type id; 8 = string, 9 = array
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


@dataclass(frozen=True)
class FileIdentity:
    """What two hosts compare: the size in bytes, the header's SHA-256 and what was hashed."""

    size: int
    digest: str
    header: str  # 'safetensors header', 'GGUF header', 'first MiB', 'folder of 5 files'

    def differs(self, other: FileIdentity) -> str:
        """'' when the same, else what differs, in words (this host's value first)."""
        if self.size != other.size:
            return f"its size is {other.size:,} bytes there, {self.size:,} here"
        if self.digest != other.digest:
            return f"its {self.header} differs (SHA-256 {other.digest[:12]} there, {self.digest[:12]} here)"
        return ""


def identity(path: str) -> FileIdentity:
    """The identity of a file, or of a folder (every file in it, by relative name)."""
    if os.path.isdir(path):
        digest, total, count = hashlib.sha256(), 0, 0
        for root, dirs, files in os.walk(path):
            dirs.sort()
            for name in sorted(files):
                full = os.path.join(root, name)
                one = identity(full)
                digest.update(f"{os.path.relpath(full, path)}\0{one.size}\0{one.digest}\n".encode())
                total, count = total + one.size, count + 1
        return FileIdentity(total, digest.hexdigest(), f"folder of {count} files")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        length, what = _header_length(f, size)
        f.seek(0)
        digest = hashlib.sha256()
        left = length
        while left > 0:
            chunk = f.read(min(left, 1 << 20))
            if not chunk:
                break
            digest.update(chunk)
            left -= len(chunk)
    return FileIdentity(size, digest.hexdigest(), what)


def _header_length(f: BinaryIO, size: int) -> tuple[int, str]:
    """How many bytes from the start make the file's header, and what it is."""
    head = f.read(8)
    if len(head) == 8 and head[:4] == GGUF_MAGIC:
        try:
            return _gguf_header_end(f), "GGUF header"
        except (struct.error, ValueError):
            pass
    elif len(head) == 8:
        length = struct.unpack("<Q", head)[0]
        if 2 <= length <= min(MAX_HEADER, size - 8):
            f.seek(8)
            if f.read(1) == b"{":
                return 8 + length, "safetensors header"
    return min(size, OTHER_HEAD), "first MiB"


def _gguf_header_end(f: BinaryIO) -> int:
    """The offset where a GGUF file's tensor infos end (its data follows, aligned)."""
    f.seek(4)
    version, tensors, fields = struct.unpack("<IQQ", f.read(20))
    if version < 2 or tensors > 1 << 24 or fields > 1 << 24:
        raise ValueError("not a GGUF header this reader knows")
    for _ in range(fields):
        _skip_string(f)
        _skip_value(f, struct.unpack("<I", f.read(4))[0])
    for _ in range(tensors):
        _skip_string(f)
        dims = struct.unpack("<I", f.read(4))[0]
        f.seek(8 * dims + 4 + 8, os.SEEK_CUR)  # the shape, the GGML type, the offset
    return f.tell()


def _skip_string(f: BinaryIO) -> None:
    length = struct.unpack("<Q", f.read(8))[0]
    if length > MAX_HEADER:
        raise ValueError("a GGUF string longer than any header")
    f.seek(length, os.SEEK_CUR)


def _skip_value(f: BinaryIO, kind: int) -> None:
    if kind == 8:
        _skip_string(f)
    elif kind == 9:
        item, count = struct.unpack("<IQ", f.read(12))
        if item in _GGUF_SIZES:
            f.seek(_GGUF_SIZES[item] * count, os.SEEK_CUR)
        else:
            for _ in range(count):
                _skip_value(f, item)
    elif kind in _GGUF_SIZES:
        f.seek(_GGUF_SIZES[kind], os.SEEK_CUR)
    else:
        raise ValueError(f"GGUF value type {kind} unknown")
