"""The engine is generic: families live in their folders, nothing else names one, specs flow down.

A family is its folder plus one line (`BUILTIN` in backend/family.py). These tests read the source of every
generic module (backend/ outside the family folders, nodes/, the package's entry points) and assert:

* no family's name, title or FLUX-only field appears in code (identifiers and strings; comments and
  docstrings may cite a family as an example), and nothing branches on `family ==`;
* no generic module imports a family folder, at module level or inside a function;
* the modules import each other without a cycle (lazy imports counted, TYPE_CHECKING imports not).
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

from rocm_parallel.backend.family import BUILTIN

ROOT = Path(__file__).resolve().parent.parent
# The family folders, as the registry names them (`BUILTIN`: ".flux.family", ...): a new family is checked too.
FAMILY_FOLDERS = tuple(module.split(".")[1] for module in BUILTIN)
# A text encoder kind's folder registers the ComfyUI CLIP types (graphs) it serves, as a family's folder does.
ENCODER_FOLDERS = ("t5", "llama")
# The model engine's plans (one module per ComfyUI model family) name their models, as family folders do.
PLAN_FOLDER = ("models", "plans")
# Family names, titles and the FLUX fields the generic engine used to read (issue 35's review), as they would
# appear in code: identifiers and string literals.
FORBIDDEN = re.compile(
    r"\b(flux1|flux2|qwen_image|wan|FluxDims|WanDims|ParallelFlux|flux_forward|flux_for|flux_call|qwen_call|"
    r"wan_call|double_blocks|single_blocks|pooled_dim|guidance_embed)\b|FLUX\.1|FLUX\.2|Qwen-Image|FLUX dev|"
    r"Wan 2\.\d"
)
# The one place a family is named outside its folder: its registration. And the socket type saved in users'
# workflows since the first release, which renaming would break (nodes/inputs.py HANDLE_TYPE).
ALLOWED = {
    (
        "backend/family.py",
        'BUILTIN: tuple[str, ...] = (".flux.family", ".flux2.family", ".qwen_image.family", ".wan.family")',
    ),
    ("nodes/inputs.py", 'HANDLE_TYPE = "PARALLEL_FLUX"'),
    # the API class's name before it was generic: users' scripts import it
    ("backend/diffusion/api.py", '"ParallelFlux",'),
    ("backend/diffusion/api.py", "ParallelFlux = ParallelModel"),
    # ... and where users' scripts import it from
    ("backend/api.py", "ParallelFlux,"),
    ("backend/api.py", '"ParallelFlux",'),
}


def generic_modules() -> list[Path]:
    files = [ROOT / "__init__.py", ROOT / "__main__.py"]
    files += sorted((ROOT / "nodes").rglob("*.py"))
    for path in sorted((ROOT / "backend").rglob("*.py")):
        parts = path.relative_to(ROOT / "backend").parts
        if len(parts) > 1 and parts[0] in FAMILY_FOLDERS:
            continue
        if len(parts) > 2 and parts[0] == "encoders" and parts[1] in ENCODER_FOLDERS:
            continue
        if len(parts) > 2 and parts[:2] == PLAN_FOLDER and parts[2] != "__init__.py":
            continue
        files.append(path)
    return files


def _docstring_lines(tree: ast.AST) -> set[int]:
    """Lines of every docstring (module, class, function)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                if isinstance(body[0].value.value, str):
                    lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def code_tokens(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every identifier and string literal that is not a docstring."""
    source = path.read_text()
    docstrings = _docstring_lines(ast.parse(source))
    kinds = {tokenize.NAME, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    return [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type in kinds and tok.start[0] not in docstrings
    ]


def test_no_generic_module_names_a_family_or_a_flux_field() -> None:
    found = []
    for path in generic_modules():
        rel = str(path.relative_to(ROOT))
        lines = path.read_text().splitlines()
        for line, text in code_tokens(path):
            if FORBIDDEN.search(text) and (rel, lines[line - 1].strip()) not in ALLOWED:
                found.append(f"{rel}:{line}: {lines[line - 1].strip()}")
    assert not found, "family names or FLUX fields in generic code:\n" + "\n".join(found)


def test_nothing_generic_branches_on_a_family() -> None:
    pattern = re.compile(r"\b(family|family\.name|\w+\.family)\s*(==|!=)\s*['\"]")
    found = []
    for path in generic_modules():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if pattern.search(code):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["rocm_parallel", *parts])


def _imports(path: Path) -> set[str]:
    """Modules of the package `path` imports (relative imports resolved), TYPE_CHECKING blocks excluded."""
    tree = ast.parse(path.read_text())
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for child in node.body for n in ast.walk(child))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped or not isinstance(node, ast.ImportFrom) or not node.level:
            continue
        base = package.split(".")
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
        if node.module is None:
            found.update(f"{target}.{alias.name}" for alias in node.names)
        else:
            found.add(target)
    return found


def _existing(name: str, modules: dict[str, Path]) -> str | None:
    """`name` if it is a module, else its package (a `from .x import y` of a package attribute)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def test_no_generic_module_imports_a_family_folder() -> None:
    found = []
    for path in generic_modules():
        for target in _imports(path):
            parts = target.split(".")
            if len(parts) > 2 and parts[1] == "backend" and parts[2] in FAMILY_FOLDERS:
                found.append(f"{path.relative_to(ROOT)} imports {target}")
    assert not found, "\n".join(found)


def test_the_package_imports_without_a_cycle() -> None:
    paths = [*generic_modules()]
    for folder in FAMILY_FOLDERS:
        paths += sorted((ROOT / "backend" / folder).rglob("*.py"))
    modules = {_module_name(p): p for p in paths}
    graph = {
        name: {m for t in _imports(path) if (m := _existing(t, modules)) and m != name}
        for name, path in modules.items()
    }
    # a package's __init__ importing its own submodules is how packages re-export: not an arrow back up
    for name in graph:
        graph[name] = {
            m for m in graph[name] if not (m != name and name.startswith(m + ".") and m in modules)
        }
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize(
    ("source", "wanted"),
    [
        ("from .flux.sampling import euler\n", "a generic module importing a family folder"),
        ("def f():\n    from .qwen_image import keys\n", "a lazy import of a family folder"),
    ],
)
def test_the_import_check_catches_a_family_import(tmp_path: Path, source: str, wanted: str) -> None:
    """The checks above read real files: a module written like this would fail them."""
    module = ROOT / "backend" / "_probe_structure.py"
    module.write_text(source)
    try:
        with pytest.raises(AssertionError, match=r"imports rocm_parallel\.backend"):
            test_no_generic_module_imports_a_family_folder()
    finally:
        module.unlink()
    assert wanted


def test_the_name_check_catches_a_family_name() -> None:
    module = ROOT / "backend" / "_probe_structure.py"
    module.write_text('if info.variant == "dev":\n    family = get_family("flux1")\n')
    try:
        with pytest.raises(AssertionError, match=r"_probe_structure\.py:2"):
            test_no_generic_module_names_a_family_or_a_flux_field()
    finally:
        module.unlink()


# ------------------------------------------------------------------------------------------------ the rooms
# The runtime (backend/runtime/: the worker group) imports no model code: only itself and the backend's base
# modules below, which import no model code either. The models import the runtime, never the other way round.
RUNTIME = ROOT / "backend" / "runtime"
BASE_MODULES = ("config", "dtypes", "echo", "platforms", "text", "torch_range")
COMFYUI_MODULES = ("comfy", "comfy_extras", "comfy_api", "folder_paths", "server", "execution", "nodes")


def _all_imports(path: Path) -> set[str]:
    """Every module `path` imports: relative ones resolved, absolute ones as written, TYPE_CHECKING included."""
    tree = ast.parse(path.read_text())
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[: len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def _runtime_side_files() -> list[Path]:
    return sorted(RUNTIME.rglob("*.py")) + [ROOT / "backend" / f"{name}.py" for name in BASE_MODULES]


def test_the_runtime_imports_no_model_code() -> None:
    allowed = ("rocm_parallel.backend.runtime", *(f"rocm_parallel.backend.{m}" for m in BASE_MODULES))
    found = []
    for path in _runtime_side_files():
        for target in sorted(_all_imports(path)):
            ours = target.startswith("rocm_parallel.") or target.split(".")[0] in COMFYUI_MODULES
            if ours and not any(target == a or target.startswith(a + ".") for a in allowed):
                found.append(f"{path.relative_to(ROOT)} imports {target}")
    assert not found, "the runtime imports model code (or ComfyUI):\n" + "\n".join(found)


def test_a_worker_process_imports_no_model_code_until_it_loads_its_methods() -> None:
    """What the static check above cannot see (an import by name): every runtime module imported the way a
    worker imports the package (launch.py's bootstrap: the pack's ComfyUI entry point not run) leaves no
    model module in sys.modules."""
    names = [_module_name(p) for p in sorted(RUNTIME.rglob("*.py"))]
    code = (
        "import importlib, sys, types\n"
        f"pkg = types.ModuleType('rocm_parallel'); pkg.__path__ = [{str(ROOT)!r}]\n"
        "sys.modules['rocm_parallel'] = pkg\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "allowed = ('rocm_parallel.backend.runtime', "
        + "".join(f"'rocm_parallel.backend.{m}', " for m in BASE_MODULES)
        + ")\n"
        "print(sorted(m for m in sys.modules if m.startswith('rocm_parallel.backend.') and not "
        "any(m == a or m.startswith(a + '.') for a in allowed)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "[]", done.stdout[-2000:]


@pytest.mark.parametrize(
    "source", ["from ..plan import estimate\n", "def f():\n    from ..checkpoint import info\n"]
)
def test_the_runtime_check_catches_a_model_import(source: str) -> None:
    module = RUNTIME / "_probe_structure.py"
    module.write_text(source)
    try:
        with pytest.raises(
            AssertionError, match=r"_probe_structure\.py imports rocm_parallel\.backend\.(plan|checkpoint)"
        ):
            test_the_runtime_imports_no_model_code()
    finally:
        module.unlink()


def test_the_backend_keeps_at_most_twelve_modules_flat() -> None:
    """backend/ is rooms (issue 50): a new module goes into the room whose job it does."""
    flat = sorted(p.name for p in (ROOT / "backend").glob("*.py"))
    assert len(flat) <= 12, flat


# Identifiers in generic code that still say FLUX (issue 50: names left from when FLUX was the only family).
# Kept: the node inputs saved workflows and API prompts use, and the API class's old name users import.
FLUX_NAME = re.compile(r"flux", re.IGNORECASE)
KEPT_FLUX_NAMES = {"parallel_flux", "ParallelFlux", "HANDLE_TYPE"}


def test_no_generic_identifier_says_flux() -> None:
    found = []
    for path in generic_modules():
        source = path.read_text()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if (
                tok.type == tokenize.NAME
                and FLUX_NAME.search(tok.string)
                and tok.string not in KEPT_FLUX_NAMES
            ):
                found.append(f"{path.relative_to(ROOT)}:{tok.start[0]}: {tok.string}")
    assert not found, "FLUX-only names in generic code:\n" + "\n".join(found)


def test_the_pack_describes_itself_without_a_family() -> None:
    """The package's docstrings and pyproject's description speak of the pack, not of its first family."""
    import tomllib

    texts = {
        "__init__.py": ast.get_docstring(ast.parse((ROOT / "__init__.py").read_text())) or "",
        "backend/__init__.py": ast.get_docstring(ast.parse((ROOT / "backend" / "__init__.py").read_text()))
        or "",
        "pyproject.toml": tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["description"],
    }
    said = {where: text for where, text in texts.items() if re.search(r"flux", text, re.IGNORECASE)}
    assert not said, said


def test_the_flux_name_check_catches_one() -> None:
    module = ROOT / "backend" / "_probe_structure.py"
    module.write_text("def group(registry):\n    return registry._flux\n")
    try:
        with pytest.raises(AssertionError, match=r"_probe_structure\.py:2: _flux"):
            test_no_generic_identifier_says_flux()
    finally:
        module.unlink()


def test_the_public_import_path_stays() -> None:
    """Users' scripts import the API from `rocm_parallel.backend.api` (the README): the same classes as the
    diffusion model's room holds, nothing else there."""
    from rocm_parallel.backend import api
    from rocm_parallel.backend.diffusion import api as diffusion_api

    assert api.ParallelModel is diffusion_api.ParallelModel is api.ParallelFlux
    assert {name: getattr(api, name) for name in api.__all__} == {
        name: getattr(diffusion_api, name) for name in diffusion_api.__all__
    }


# What runs on the workers (the runtime's worker side and every model's jobs): the nodes never import it; they
# reach the workers through the models' APIs (and take the runtime's caller-side helpers: devices, paths).
WORKER_SIDE = re.compile(
    r"^rocm_parallel\.backend\.(runtime\.(worker|heartbeat|probe|cancel_points)|\w+\.(jobs|serve))(\.|$)"
)


def test_the_nodes_import_nothing_that_runs_on_the_workers() -> None:
    found = [
        f"{path.relative_to(ROOT)} imports {target}"
        for path in sorted((ROOT / "nodes").rglob("*.py"))
        for target in sorted(_all_imports(path))
        if WORKER_SIDE.match(target)
    ]
    assert not found, "\n".join(found)
