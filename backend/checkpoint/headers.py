"""A checkpoint's or LoRA's header, whichever kind of file it is: safetensors (files.py) or GGUF (gguf.py).

Its own module so that files.py, which gguf.py builds on, never imports gguf.py back.
"""

from __future__ import annotations

from pathlib import Path

from .files import StoredTensor, check_file_kind, is_gguf, read_safetensors_header
from .gguf_header import read_gguf_header


def read_header(path: Path) -> tuple[dict[str, StoredTensor], dict[str, str]]:
    """(key -> stored tensor, string metadata) of a safetensors file (its `__metadata__`) or of a GGUF file
    (its string fields), after the file's kind is checked (files.py `check_file_kind`)."""
    check_file_kind(path)
    return read_gguf_header(path) if is_gguf(path) else read_safetensors_header(path)


__all__ = ["read_header"]
