"""An input as a message shows it: whole when short, cut and measured when long, so that no message repeats
the ten thousand characters someone sent (the status route answers anyone who reaches ComfyUI's port)."""

from __future__ import annotations

ECHO_CHARS = 60


def echo(value: object, limit: int = ECHO_CHARS) -> str:
    """`repr(value)` up to `limit` characters; a longer one cut, with the value's length: "'tp999...' (10002
    characters)". A whole number too long to write is named by its size ("a 5000-digit number")."""
    if isinstance(value, int) and value.bit_length() > 3 * limit:  # str() refuses past 4300 digits
        return f"a number of about {int(value.bit_length() * 0.30103)} digits"
    text = repr(value)
    if len(text) <= limit:
        return text
    size = len(value) if isinstance(value, str) else len(text)
    return f"{text[: limit - 4]}...{text[0] if isinstance(value, str) else ''} ({size} characters)"
