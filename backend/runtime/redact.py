"""Paths in messages: how every message writes one (`quoted`), and the text anyone may see (`file_names_only`).

A message for the user who gave the path names it whole; the web panel and the status route are readable
by anyone who reaches ComfyUI's port, so what they show keeps the file name alone, whatever the folders
hold (quotes, newlines, spaces, any script). That works only because every message writes a path the
same way: as Python writes a string literal (`repr`: quotes chosen and escaped, a newline as `\\n`), which
`file_names_only` reads back exactly. A folder's listing is written as names (`listing_text`) that read
back exactly too, and the panel drops it whole: its entries are the user's other files and folders.
"""

from __future__ import annotations

import ast
import os
import re
import warnings
from collections.abc import Iterable

# A Python string literal as `repr` writes it, not glued to a word (the apostrophe in "rank 0's" opens none).
_LITERAL = r"""(?<![\w'"\\])(?:'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*")"""
# A plain name: letters, digits, '_', '+', '-' and inner dots (a sentence's full stop is not part of it).
_PLAIN = r"[\w+-](?:[\w.+-]*[\w+-])?"
# A listing entry: a plain name, or a literal for any other; a folder ends in '/'.
_ENTRY = rf"(?:{_PLAIN}|{_LITERAL})/?"
_LISTING = re.compile(
    rf"(?:[;,] )?(?:{_LITERAL} |it )has: (?:nothing \(it is empty\)|{_ENTRY}(?:, {_ENTRY})*(?: and \d+ more)?)"
)
_QUOTED = re.compile(_LITERAL)
_PLAIN_NAME = re.compile(_PLAIN)
_SEPARATORS = re.compile(r"[/\\]")
# An unquoted absolute or home path (a library's message, not ours): folders may hold spaces (up to the
# next separator), the file name not; a separator between spaces is prose ('torch.save / .ckpt').
_UNQUOTED = re.compile(r"(?<![\w.])(?:~|[A-Za-z]:)?[/\\](?!\s)(?:[^/\\'\"\n;,]+?[/\\])*([^\s/\\'\";,]*)")


def quoted(path: str | os.PathLike[str]) -> str:
    """`path` as every message names it: a Python string literal, so that `file_names_only` finds where it
    ends whatever it holds."""
    return repr(os.fspath(path))


def listing_text(names: Iterable[str]) -> str:
    """Folder entries for a message: plain names as they are, any other quoted (`quoted`)."""
    return ", ".join(n if _PLAIN_NAME.fullmatch(n.removesuffix("/")) else _quoted_entry(n) for n in names)


def _quoted_entry(name: str) -> str:
    return quoted(name.removesuffix("/")) + ("/" if name.endswith("/") else "")


def file_name(path: str) -> str:
    """The last non-empty component of a path written with '/' or '\\' (a ComfyUI name, a Windows path)."""
    return next((part for part in reversed(_SEPARATORS.split(path)) if part), "")


def file_names_only(text: str) -> str:
    """`text` with every path shortened to its file name and folder listings dropped."""
    text = _LISTING.sub("", text)
    pieces, end = [], 0
    for match in _QUOTED.finditer(text):
        pieces += [_unquoted_names(text[end : match.start()]), _literal_name(match.group())]
        end = match.end()
    return "".join([*pieces, _unquoted_names(text[end:])])


def _literal_name(literal: str) -> str:
    """A quoted path as its quoted file name; any other literal unchanged."""
    body = literal[1:-1]
    if not _SEPARATORS.search(body):
        return literal
    try:
        value = _evaluate(literal)
    except (SyntaxError, ValueError):  # not what repr writes (a raw Windows path): cut the text itself
        return literal[0] + file_name(body) + literal[0]
    return quoted(file_name(value))


def _evaluate(literal: str) -> str:
    """The string `repr` wrote as `literal`; ValueError for any other text (it is not evaluated as code)."""
    with warnings.catch_warnings():  # '\\M' in a raw Windows path: an invalid escape, warned about
        warnings.simplefilter("ignore")
        value = ast.literal_eval(literal)
    if not isinstance(value, str) or repr(value) != literal:
        raise ValueError(literal)
    return value


def _unquoted_names(text: str) -> str:
    return _UNQUOTED.sub(lambda m: m.group(1), text)
