"""Record what a REAL ComfyUI has of every name the pack uses (tests/comfy_uses.py's scan) to
tests/data/comfy_api-<version>.json: for each dotted name its kind (module, class, function, method,
attribute, or missing) and, for callables, the parameter list. CI checks the pack's uses against every
version's record (tests/test_comfy_api.py); the comfy tier checks the record against its live ComfyUI
(tests/comfy/test_comfy_api_record.py). Run it with each ComfyUI version the tier runs, after a change that
uses a new ComfyUI name:

    COMFYUI_PATH=/path/to/ComfyUI PYTHONPATH=<pack parent>:<comfy deps> python tests/tools/dump_comfy_api.py \\
        --commit <sha> --date <YYYY-MM-DD>

It imports ComfyUI in this process the way the tier does (`main.py --cpu` argument parsing), never starts it.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS), str(TESTS / "tools")]

from comfy_uses import DATA, scan  # noqa: E402


def _params(obj: Any) -> list[list[Any]] | None:
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin without a signature
        return None
    return [
        [p.name, p.kind.name, p.default is not inspect.Parameter.empty] for p in signature.parameters.values()
    ]


def _assigned_at_run_time(cls: type, name: str) -> bool:
    """`cls.name = ...` / `self.name = ...` in the class's own source (PromptServer.instance): an attribute
    that exists once the class is used, not at import."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return False
    owners = {cls.__name__, "self", "cls"}
    return any(
        isinstance(t, ast.Attribute)
        and t.attr == name
        and isinstance(t.value, ast.Name)
        and t.value.id in owners
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign | ast.AnnAssign)
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
    )


def _describe(obj: Any, owner: Any, name: str) -> dict[str, Any]:
    if inspect.ismodule(obj):
        return {"kind": "module"}
    if inspect.isclass(obj):
        return {"kind": "class", "params": _params(obj)}
    if inspect.isclass(owner):
        static = inspect.getattr_static(owner, name)
        if isinstance(static, staticmethod):
            return {"kind": "function", "params": _params(obj)}
        if isinstance(static, classmethod):
            return {"kind": "method", "params": _params(obj), "method": False}  # bound to the class already
        if inspect.isfunction(static):
            return {"kind": "method", "params": _params(static), "method": True}
    if inspect.isfunction(obj) or inspect.isbuiltin(obj):
        return {"kind": "function", "params": _params(obj)}
    if callable(obj) and not isinstance(obj, str | int | float):
        return {"kind": "callable", "params": _params(obj)}
    return {"kind": "attribute", "type": type(obj).__name__}


def describe(dotted: str) -> dict[str, Any]:
    """What this process's ComfyUI has under `dotted`."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name is not None and module != err.name and not module.startswith(err.name + "."):
                raise  # the module exists and one of its own imports failed: not a missing name
            continue
        owner = None
        for part in parts[i:]:
            if not hasattr(obj, part):
                if inspect.isclass(obj) and _assigned_at_run_time(obj, part):
                    return {"kind": "attribute", "type": "set at run time"}
                return {"kind": "missing"}
            owner, obj = obj, getattr(obj, part)
        return _describe(obj, owner, parts[-1])
    return {"kind": "missing"}


def import_comfyui(path: str) -> str:
    """Import ComfyUI from a checkout as the tier does; its version."""
    from make_comfy_references import import_comfy

    sys.path.insert(0, path)
    argv, sys.argv = sys.argv, [sys.argv[0], "--cpu"]
    try:
        import comfy.options

        comfy.options.enable_args_parsing()
        # main.py's order: its utils/ package first (nodes.py puts comfy/ on sys.path, whose utils.py would
        # shadow it for `server`), then `server`.
        if Path(path, "utils", "__init__.py").exists():
            importlib.import_module("utils")
        importlib.import_module("server")
    finally:
        sys.argv = argv
    import_comfy(path)
    return importlib.import_module("comfyui_version").__version__


def record(path: str, commit: str, date: str) -> dict[str, Any]:
    version = import_comfyui(path)
    names = sorted({u.name for u in scan()})
    return {
        "version": version,
        "commit": commit,
        "date": date,
        "written_by": "tests/tools/dump_comfy_api.py from that ComfyUI, imported in-process",
        "names": {name: describe(name) for name in names},
    }


def as_json(out: dict[str, Any]) -> str:
    """The record with one line per name (reviewable diffs between versions)."""
    head = {k: v for k, v in out.items() if k != "names"}
    lines = [f"  {json.dumps(n)}: {json.dumps(e, sort_keys=True)}" for n, e in sorted(out["names"].items())]
    text = json.dumps(head, indent=1, sort_keys=True)[:-2]
    return text + ',\n "names": {\n' + ",\n".join(lines) + "\n }\n}\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commit", default="", help="the checkout's commit (default: its .rev file)")
    parser.add_argument("--date", default="", help="that commit's date, YYYY-MM-DD")
    args = parser.parse_args()
    path = os.environ["COMFYUI_PATH"]
    rev = Path(path, ".rev")
    commit = args.commit or (rev.read_text().strip() if rev.exists() else "")
    out = record(path, commit, args.date)
    target = DATA / f"comfy_api-{out['version']}.json"
    target.write_text(as_json(out))
    missing = [n for n, e in out["names"].items() if e["kind"] == "missing"]
    print(f"wrote {target} ({len(out['names'])} names; missing in {out['version']}: {missing or 'none'})")


if __name__ == "__main__":
    main()
