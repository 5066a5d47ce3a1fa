"""The ComfyUI names the pack uses, found by an AST scan of its sources, checked against what each ComfyUI
version the pack is tested with really has (tests/data/comfy_api-<version>.json, written from that real
ComfyUI by tests/tools/dump_comfy_api.py). CI has no ComfyUI checkout, so the record is what it checks;
the comfy tier (tests/comfy/test_comfy_api_record.py) checks the record against its live ComfyUI.

A use is a module imported (`import comfy.model_management as mm`), an attribute chain on such a module
(`mm.unload_all_models`, `comfy.samplers.KSampler.SAMPLERS`; also through `getattr(x, "name", ...)`,
`sys.modules.get("server")` and `importlib.import_module("comfyui_version")`), a call of one (its
positional count and keyword names are bound to the recorded signature), a subclass of a ComfyUI class and
the methods it overrides (each must still accept every parameter ComfyUI's own method has), the
(module, attribute) pairs the parallel MODEL checks at run time (nodes/comfy_model.py `_REQUIRED`), and the
`comfy.supported_models` classes the model families name (`ComfyModel(config_class=...)`). A use inside
`try:` / `except ImportError` (or AttributeError), or read by `getattr` with a default, is a version shim:
it may be absent from a version, not from all of them.

Why not comfy-import-guard alone: it resolves `comfy.*` only, against a git clone of ComfyUI that CI cannot
reach, and it does not see `nodes`, `folder_paths`, `server`, `comfy_extras` or the names the pack reaches
through `getattr`. It was run beside this check on both tier versions (docs/testing.md).

    python tests/comfy_uses.py [--report FILE]   # exit 1 when a use fails for any recorded version
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"
RECORD_GLOB = "comfy_api-*.json"
# ComfyUI's top-level modules a custom node can import (the pack's own `nodes` is imported relatively).
COMFY_ROOTS = (
    "comfy", "comfy_extras", "comfy_api", "comfy_execution", "folder_paths", "server", "node_helpers", "nodes",
    "comfyui_version", "latent_preview", "execution", "comfy_aimdo",
)  # fmt: skip
# What is scanned: the ComfyUI side of the pack (the nodes, the model engine), and the families' ComfyUI
# config class names.
SCANNED = ("__init__.py", "nodes/*.py", "backend/**/family.py", "backend/models/**/*.py")
_LOADERS = ("sys.modules.get", "importlib.import_module")  # calls that return a module by its name
_GUARDS = {"ImportError", "ModuleNotFoundError", "AttributeError"}


@dataclasses.dataclass(frozen=True)
class Use:
    """One place the pack relies on a ComfyUI name."""

    name: str  # dotted: 'comfy.model_management.unload_all_models'
    where: str  # 'nodes/comfy_model.py:327'
    kind: str  # import | attr | call | subclass | override | declared
    positional: int = 0  # call: positional arguments given
    keywords: tuple[str, ...] = ()  # call: keyword names given
    via_instance: bool = False  # call of a method on an instance (`SamplerCustom().sample(...)`)
    params: tuple[tuple[str, str, bool], ...] = ()  # override: the pack's own method's parameters
    guarded: bool = False  # inside `try:` whose `except` catches ImportError / AttributeError: may be absent


@dataclasses.dataclass(frozen=True)
class Finding:
    version: str
    use: Use
    problem: str  # '' when the use holds

    absent: bool = False  # missing in this version, and the pack handles that (guarded, or an override)

    def line(self) -> str:
        status = "FAIL" if self.problem else "ok  "
        text = f"ComfyUI {self.version}  {status} {self.use.where}  {self.use.kind} {self.use.name}"
        if self.absent:
            text += " (absent here; the pack handles that)"
        return f"{text}: {self.problem}" if self.problem else text


def _is_comfy(dotted: str) -> bool:
    return dotted.split(".")[0] in COMFY_ROOTS


def _literal(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _params_of(args: ast.arguments) -> tuple[tuple[str, str, bool], ...]:
    """A def's parameters as (name, inspect kind name, has default), `self` dropped."""
    out: list[tuple[str, str, bool]] = []
    positional = args.posonlyargs + args.args
    defaults = [False] * (len(positional) - len(args.defaults)) + [True] * len(args.defaults)
    for arg, has_default in zip(positional, defaults, strict=True):
        kind = "POSITIONAL_ONLY" if arg in args.posonlyargs else "POSITIONAL_OR_KEYWORD"
        out.append((arg.arg, kind, has_default))
    if args.vararg:
        out.append((args.vararg.arg, "VAR_POSITIONAL", False))
    for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        out.append((arg.arg, "KEYWORD_ONLY", default is not None))
    if args.kwarg:
        out.append((args.kwarg.arg, "VAR_KEYWORD", False))
    return tuple(out[1:]) if out and out[0][0] in ("self", "cls") else tuple(out)


class _Scanner(ast.NodeVisitor):
    """Every Use in one file. Aliases are per file (the pack names each ComfyUI module one way)."""

    def __init__(self, rel: str) -> None:
        self.rel, self.aliases, self.uses = rel, {}, []
        self.parents: dict[ast.AST, ast.AST] = {}

    def scan(self, tree: ast.AST) -> list[Use]:
        for parent in ast.walk(tree):
            for child in ast.iter_child_nodes(parent):
                self.parents[child] = parent
        for node in ast.walk(tree):  # aliases first: imports inside functions bind before their uses
            if isinstance(node, ast.Import | ast.ImportFrom):
                self._bind(node)
        for node in ast.walk(tree):  # `server = sys.modules.get("server")` binds a module too
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
            ):
                loader = isinstance(node.value, ast.Call) and ast.unparse(node.value.func) in _LOADERS
                if loader and (module := self.resolve(node.value)):
                    self.aliases[node.targets[0].id] = module
        self.visit(tree)
        return self.uses

    def _add(self, node: ast.AST, name: str, kind: str, **extra: Any) -> None:
        where = f"{self.rel}:{getattr(node, 'lineno', 0)}"
        extra.setdefault("guarded", self._guarded(node))
        self.uses.append(Use(name, where, kind, **extra))

    def _guarded(self, node: ast.AST) -> bool:
        """In the body of a `try:` that catches a missing module or attribute (a version shim)."""
        child, parent = node, self.parents.get(node)
        while parent is not None:
            if isinstance(parent, ast.Try) and child in parent.body:
                caught = {
                    n.id if isinstance(n, ast.Name) else ""
                    for h in parent.handlers
                    for n in ([h.type] if not isinstance(h.type, ast.Tuple) else h.type.elts)
                }
                if caught & _GUARDS:
                    return True
            child, parent = parent, self.parents.get(parent)
        return False

    def _bind(self, node: ast.Import | ast.ImportFrom) -> None:
        if isinstance(node, ast.Import):
            for a in node.names:
                if _is_comfy(a.name):
                    self.aliases[a.asname or a.name.split(".")[0]] = (
                        a.name if a.asname else a.name.split(".")[0]
                    )
                    self._add(node, a.name, "import")
        elif node.level == 0 and node.module and _is_comfy(node.module):
            for a in node.names:
                self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                self._add(node, f"{node.module}.{a.name}", "import")

    def resolve(self, node: ast.AST) -> str | None:
        """The dotted ComfyUI name an expression stands for, or None."""
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.resolve(node.value)
            return f"{base}.{node.attr}" if base else None
        if isinstance(node, ast.Call):
            func = node.func
            text = ast.unparse(func)
            first = _literal(node.args[0]) if node.args else None
            if text in _LOADERS and first and _is_comfy(first):
                return first
            if text == "getattr" and len(node.args) >= 2:
                base, attr = self.resolve(node.args[0]), _literal(node.args[1])
                return f"{base}.{attr}" if base and attr else None
        return None

    def visit_Attribute(self, node: ast.Attribute) -> None:
        parent = self.parents.get(node)
        outermost = not (isinstance(parent, ast.Attribute) and parent.value is node)
        name = self.resolve(node)
        if outermost and name and not (isinstance(parent, ast.Call) and parent.func is node):
            self._add(node, name, "attr")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        name = self.resolve(node)
        if name and ast.unparse(node.func) == "getattr":
            parent = self.parents.get(node)
            if not (isinstance(parent, ast.Call) and parent.args and parent.args[0] is node):
                # getattr(mod, "x") is a use of mod.x; with a default (`getattr(mod, "x", None)`) the pack
                # handles its absence, a version shim like `try: ... except AttributeError`
                self._add(node, name, "attr", guarded=len(node.args) >= 3 or self._guarded(node))
        func, via_instance = node.func, False
        target = self.resolve(func)
        if target is None and isinstance(func, ast.Attribute) and isinstance(func.value, ast.Call):
            owner = self.resolve(func.value.func)  # SamplerCustom().sample(...)
            target, via_instance = (f"{owner}.{func.attr}", True) if owner else (None, False)
        if target and ast.unparse(func) not in ("getattr", *_LOADERS):
            starred = any(isinstance(a, ast.Starred) for a in node.args) or any(
                k.arg is None for k in node.keywords
            )
            if starred:  # *args / **kwargs: not bindable statically
                self._add(node, target, "attr")
            else:
                keywords = tuple(k.arg for k in node.keywords if k.arg)
                self._add(node, target, "call", positional=len(node.args), keywords=keywords,
                          via_instance=via_instance)  # fmt: skip
        self._declared_config_class(node)
        self.generic_visit(node)

    def _declared_config_class(self, node: ast.Call) -> None:
        """`ComfyModel(config_class=X)` in a family: X names a comfy.supported_models class."""
        if not (isinstance(node.func, ast.Name) and node.func.id == "ComfyModel"):
            return
        for k in node.keywords:
            if k.arg != "config_class":
                continue
            values = [_literal(k.value)] if _literal(k.value) else self._assigned(node, k.value)
            for value in values:
                self._add(node, f"comfy.supported_models.{value}", "declared")

    def _assigned(self, node: ast.AST, value: ast.AST) -> list[str]:
        """The string literals assigned to the name `value` in the function around `node`."""
        if not isinstance(value, ast.Name):
            return []
        scope = node
        while scope in self.parents and not isinstance(scope, ast.FunctionDef):
            scope = self.parents[scope]
        return [
            s
            for n in ast.walk(scope)
            if isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == value.id for t in n.targets)
            for s in [_literal(n.value)]
            if s
        ]

    def visit_Tuple(self, node: ast.Tuple) -> None:
        """(module, attribute path) pairs the pack checks at run time (comfy_model._REQUIRED)."""
        if len(node.elts) == 2:
            module, path = (_literal(e) for e in node.elts)
            if module and path and _is_comfy(module) and all(p.isidentifier() for p in path.split(".")):
                self._add(node, f"{module}.{path}", "declared")
        self.generic_visit(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for base in node.bases:
            name = self.resolve(base)
            if not name:
                continue
            self._add(base, name, "subclass")
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    self._add(item, f"{name}.{item.name}", "override", params=_params_of(item.args))
        self.generic_visit(node)


def pack_files(root: Path = ROOT) -> Iterator[Path]:
    for pattern in SCANNED:
        yield from sorted(root.glob(pattern))


def scan(files: Iterable[Path] | None = None, root: Path = ROOT) -> list[Use]:
    """Every ComfyUI name the pack's sources use (the files in SCANNED), in file order."""
    uses: list[Use] = []
    for path in files if files is not None else pack_files(root):
        rel = path.relative_to(root).as_posix()
        uses += _Scanner(rel).scan(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
    return uses


def records(data: Path = DATA) -> dict[str, dict[str, Any]]:
    """Each recorded ComfyUI version's entries: {version: {"version", "commit", "names": {...}}}."""
    out = {}
    for path in sorted(data.glob(RECORD_GLOB)):
        record = json.loads(path.read_text())
        out[record["version"]] = record
    return out


def _signature(params: Iterable[Iterable[Any]]) -> inspect.Signature:
    # Recorded defaults are only "has one": a placeholder keeps inspect's ordering rule satisfied.
    return inspect.Signature(
        [
            inspect.Parameter(
                name, getattr(inspect.Parameter, kind), default=0 if has_default else inspect._empty
            )
            for name, kind, has_default in params
        ]
    )


def _call_problem(use: Use, entry: Mapping[str, Any]) -> str:
    params = entry.get("params")
    if entry["kind"] not in ("function", "class", "method", "callable"):
        return f"called, but ComfyUI's {use.name} is a {entry['kind']} (not callable)"
    if params is None:
        return ""  # a builtin without an introspectable signature: presence is all that is known
    if use.via_instance and entry.get("method"):
        params = params[1:]
    try:
        _signature(params).bind(*range(use.positional), **dict.fromkeys(use.keywords))
    except TypeError as err:
        shown = ", ".join(p[0] + ("=..." if p[2] else "") for p in params)
        return f"the call ({use.positional} positional, keywords {list(use.keywords)}) does not bind: {err}; ComfyUI's signature is ({shown})"
    return ""


def _override_problem(use: Use, entry: Mapping[str, Any]) -> str:
    upstream = entry.get("params")
    if upstream is None:
        return ""
    upstream = upstream[1:] if entry.get("method") else upstream
    mine = {p[0]: p[1] for p in use.params}
    takes_any_keyword = "VAR_KEYWORD" in mine.values()
    takes_any_positional = "VAR_POSITIONAL" in mine.values()
    dropped = [
        name
        for name, kind, _ in upstream
        if kind not in ("VAR_POSITIONAL", "VAR_KEYWORD")
        and name not in mine
        and not (takes_any_keyword or (kind == "POSITIONAL_ONLY" and takes_any_positional))
    ]
    if dropped:
        return f"the pack's override lacks parameter(s) {', '.join(dropped)} that ComfyUI's own method has"
    return ""


def problem(use: Use, names: Mapping[str, Any]) -> str:
    """What is wrong with `use` in one version's recorded names ('' when nothing)."""
    entry = names.get(use.name)
    if entry is None:
        return "not recorded for this version: run tests/tools/dump_comfy_api.py with this ComfyUI"
    if entry["kind"] == "missing":
        if use.kind == "override" or use.guarded:
            return ""  # an override for newer ComfyUI versions, or a guarded shim: absence is handled
        return "missing in this ComfyUI"
    if use.kind == "call":
        return _call_problem(use, entry)
    if use.kind == "subclass" and entry["kind"] != "class":
        return f"subclassed, but ComfyUI's {use.name} is a {entry['kind']}"
    if use.kind == "override":
        return _override_problem(use, entry)
    return ""


def check(uses: Iterable[Use], versions: Mapping[str, Mapping[str, Any]]) -> list[Finding]:
    uses = list(uses)
    out = []
    for version, record in versions.items():
        names = record["names"]
        for use in uses:
            text = problem(use, names)
            absent = names.get(use.name, {}).get("kind") == "missing"
            nowhere = all(r["names"].get(use.name, {}).get("kind") == "missing" for r in versions.values())
            if absent and use.guarded and nowhere:  # a shim for no version at all: a typo or dead code
                text = f"missing in every recorded version ({', '.join(versions)}), though guarded"
            out.append(Finding(version, use, text, absent and not text))
    return out


def report(findings: list[Finding], versions: Mapping[str, Mapping[str, Any]]) -> str:
    failed = [f for f in findings if f.problem]
    head = [
        f"ComfyUI names the pack uses, checked against {len(versions)} recorded version(s): "
        + ", ".join(f"{v} ({r.get('commit', '?')[:8]}, {r.get('date', '?')})" for v, r in versions.items()),
        f"{len({f.use for f in findings})} use(s), {len(findings) - len(failed)} ok, {len(failed)} failed",
        "",
    ]
    return (
        "\n".join(
            head
            + [f.line() for f in failed]
            + ([""] if failed else [])
            + [f.line() for f in findings if not f.problem]
        )
        + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", type=Path, help="write the full report here (CI keeps it as an artifact)")
    parser.add_argument("--data", type=Path, default=DATA, help=f"the folder of the {RECORD_GLOB} records")
    args = parser.parse_args(argv)
    versions = records(args.data)
    if not versions:
        print(f"no {RECORD_GLOB} in {args.data}", file=sys.stderr)
        return 1
    findings = check(scan(), versions)
    text = report(findings, versions)
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(text)
    failed = [f for f in findings if f.problem]
    print("\n".join(text.splitlines()[: 3 + len(failed)]))
    print(f"imports: {len(findings) - len(failed)} passed, {len(failed)} failed")  # CI's plain closing line
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
