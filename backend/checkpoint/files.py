"""Safetensors files as the loaders see them: headers, file-kind and truncation checks, listings.

Everything here reads headers and the first bytes only, so the caller's process can check a path before
any worker starts. `CheckpointError` is the error every checkpoint message comes in; it is a ConfigError,
so callers that catch bad input catch it too.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigError
from ..runtime.redact import listing_text, quoted

# ComfyUI's full checkpoints (and some diffusion_models files) put the transformer under this prefix.
COMFY_PREFIX = "model.diffusion_model."


class CheckpointError(ConfigError):
    """A checkpoint that cannot be loaded; the message names the path, what was found and the fix."""


@dataclass(frozen=True)
class StoredTensor:
    """One tensor in a safetensors or GGUF file."""

    file: str
    key: str
    shape: tuple[int, ...]
    dtype: str  # safetensors' name, e.g. "BF16", "F8_E4M3"; a GGUF tensor's GGML type, e.g. "Q4_K", "F16"
    offset: int | None = None  # a GGUF tensor's first byte in its file (gguf.py); None for safetensors


def listing(folder: Path, limit: int = 12) -> str:
    """What `folder` holds, for messages: its first `limit` names (folders marked with '/'; a name that is
    not plain is quoted, so the public text can drop the listing whole: redact.listing_text)."""
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    if not names:
        return "nothing (it is empty)"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return listing_text(names[:limit]) + more


# What the kernel serves as files: reading a FIFO waits for a writer forever, a device never ends or
# fails (/dev/zero, /dev/sda), a file of /proc or /sys is the kernel's data (/proc/self/mem fails with EIO).
_SPECIAL = (
    (stat.S_ISFIFO, "a named pipe (FIFO): reading it waits for a writer"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)
_KERNEL_FOLDERS = ("/proc", "/sys")


def special_kind(path: Path) -> str | None:
    """What `path` (a link: what it names) is when it is no file to read a model from; None for a regular
    file or folder outside /proc and /sys. Decided from its type alone: nothing is opened."""
    mode = os.stat(path).st_mode
    for test, kind in _SPECIAL:
        if test(mode):
            return kind
    real = os.path.realpath(path)
    for folder in _KERNEL_FOLDERS:
        try:
            kernel = os.stat(folder).st_dev == os.stat(path).st_dev
        except OSError:  # no such folder here (not Linux)
            kernel = False
        if kernel or real == folder or real.startswith(folder + "/"):
            return f"a file of {folder}, the kernel's own data"
    return None


def refuse_special(path: Path, what: str, fix: str) -> None:
    """ConfigError (`CheckpointError`) for a named pipe, device, socket or kernel file given as `what`."""
    kind = special_kind(path)
    if kind is not None:
        raise CheckpointError(f"{what} {quoted(path)} is {kind}, not a file of weights; {fix}")


def missing_checkpoint(path: Path) -> CheckpointError:
    """The error for a checkpoint path that does not exist, naming what its folder has instead."""
    parent = path.parent
    if parent.is_dir():
        return CheckpointError(
            f"checkpoint {quoted(path)} does not exist; {quoted(parent)} has: {listing(parent)}. "
            "Pick one of those, or put the FLUX file into that folder"
        )
    return CheckpointError(f"checkpoint {quoted(path)} does not exist, nor does its folder; check the path")


def starts_like_safetensors(head: bytes, size: int) -> bool:
    """8-byte little-endian header length that fits the file, then the header's JSON '{'.

    The length's first byte can be anything (0x80 for a 8320-byte header), so a pickle's 0x80 magic
    alone proves nothing: only a file that is not shaped like safetensors is judged by its magic.
    """
    return len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") <= size - 8


CHECKPOINT_FIX = "pass a .safetensors checkpoint (or a diffusers folder) from models/diffusion_models"


def check_file_kind(path: Path) -> None:
    """Recognize the formats people mistake for safetensors by their first bytes (special files by their
    type, before anything is opened)."""
    refuse_special(path, "checkpoint", CHECKPOINT_FIX)
    with open(path, "rb") as f:
        head = f.read(9)
    if starts_like_safetensors(head, path.stat().st_size) or is_gguf(path, head):
        return
    if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":
        raise CheckpointError(
            f"{quoted(path)} is a PyTorch pickle (torch.save / .ckpt / .bin), not safetensors; convert it with "
            "safetensors.torch.save_file(torch.load(path, weights_only=True), 'model.safetensors')"
        )


def truncation_detail(path: Path, error: object = None) -> str:
    """What is wrong with a file safetensors refused: how many bytes the header promises against what is
    on disk, or, when those agree, safetensors' own reason (`error`: the damage is inside the file)."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                return f"its header length field says {n} bytes but the file has only {size}"
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, struct.error):
        return f"its {size} bytes do not start with a safetensors header"
    if 8 + n + end != size:
        return f"its header promises {8 + n + end} bytes but the file has {size}"
    reason = (str(error).strip() or type(error).__name__) if error is not None else "no reason given"
    return f"its size matches its header ({size} bytes), but safetensors refuses the header: {reason}"


def is_gguf(path: Path, head: bytes | None = None) -> bool:
    """A GGUF file (its magic, or its name when it is too damaged to have one): gguf.py reads it."""
    if head is None:
        with open(path, "rb") as f:
            head = f.read(4)
    return head[:4] == b"GGUF" or path.suffix.lower() == ".gguf"


def read_safetensors_header(path: Path) -> tuple[dict[str, StoredTensor], dict[str, str]]:
    """(key -> stored tensor, the header's `__metadata__` strings) of a safetensors file (headers.py reads
    either kind of file)."""
    from safetensors import SafetensorError, safe_open  # here: `plan` imports this module without it

    try:
        with safe_open(str(path), "pt") as f:
            out = {}
            for key in f.keys():
                s = f.get_slice(key)
                out[key] = StoredTensor(str(path), key, tuple(s.get_shape()), s.get_dtype())
            return out, dict(f.metadata() or {})
    except SafetensorError as err:
        raise CheckpointError(
            f"{quoted(path)} is truncated or corrupt: {truncation_detail(path, err)}. Download or copy it again"
        ) from err


def full_shape(stored: StoredTensor, rows: tuple[tuple[int, int], ...] | None) -> tuple[int, ...]:
    """The shape of the parameter made of `rows` of `stored` (None: all of it)."""
    if rows is None:
        return stored.shape
    return (sum(b - a for a, b in rows), *stored.shape[1:])


def numel(shape: tuple[int, ...]) -> int:
    """Elements of a tensor of `shape` (from a header: no tensor needed)."""
    n = 1
    for s in shape:
        n *= s
    return n


__all__ = [
    "CHECKPOINT_FIX",
    "COMFY_PREFIX",
    "CheckpointError",
    "StoredTensor",
    "check_file_kind",
    "full_shape",
    "is_gguf",
    "listing",
    "missing_checkpoint",
    "numel",
    "read_safetensors_header",
    "refuse_special",
    "special_kind",
    "starts_like_safetensors",
    "truncation_detail",
]
