"""Every `python -m rocm_parallel ...` and `python custom_nodes/rocm-parallel ...` command (a checkout's and a
ComfyUI install's form of the one CLI; tests/test_readme_install.py runs the README's in that install) the
README, BENCHMARKS.md and docs/ show is one the CLI takes: each is parsed by the CLI's own parser (a benchmark's layouts are checked while parsing), and the
`plan` commands, which answer in seconds, are run. The benchmarks themselves take minutes each and run in
BENCHMARKS.md's sessions, not here."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from rocm_parallel.backend import cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
PREFIXES = ("python -m rocm_parallel ", "python custom_nodes/rocm-parallel ")
INLINE = re.compile(r"`((?:[A-Z_]+=\S+ )*python (?:-m rocm_parallel|custom_nodes/rocm-parallel) [^`]+)`")
PLACEHOLDER = re.compile(r"<\w+>|\.\.\.|\s[A-Z]\b")  # `bench <name>`, `bench ...`, `--model M`


def documented_commands() -> list[tuple[str, str]]:
    """(file name, argv text after `python -m rocm_parallel`) of every command shown, inline or in a
    code block, with environment assignments and trailing comments dropped."""
    found = []
    for path in DOCS:
        text = path.read_text()
        shown = [m.group(1) for m in INLINE.finditer(re.sub(r"\s*\n\s*", " ", text))]
        for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, re.S):
            shown += [
                line.split("  #")[0].strip()
                for line in block.splitlines()
                if any(p in line for p in PREFIXES)
            ]
        for command in shown:
            prefix = next(p for p in PREFIXES if p in command)
            argv = command[command.index(prefix) + len(prefix) :].strip()
            if not PLACEHOLDER.search(" " + argv):
                found.append((path.name, argv))
    return sorted(set(found))


def test_the_docs_show_commands() -> None:
    names = {argv.split()[0] for _, argv in documented_commands()}
    assert {"plan", "bench", "doctor"} <= names


@pytest.mark.parametrize(("doc", "argv"), documented_commands(), ids=lambda v: v)
def test_each_documented_command_parses(doc: str, argv: str) -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            args = cli._parser().parse_args(shlex.split(argv))
        except SystemExit:
            pytest.fail(f"{doc}: `{argv}` is refused: {err.getvalue().strip()}")
    if args.command == "plan":  # answers in seconds (stored model facts): run it
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(shlex.split(argv))
        assert code in (0, 1), f"{doc}: `{argv}` exited {code}: {err.getvalue()}"  # 1: nothing fits
        assert "| layout |" in out.getvalue()
