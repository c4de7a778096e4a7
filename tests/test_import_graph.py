"""The source tree's shape, read with ``ast`` (nothing is imported):

* no import circle between the modules of one package, counting imports inside functions and
  under ``TYPE_CHECKING`` (a circle there is still two modules that need each other);
* packages depend one way: spec, data, hf (Hugging Face files), cost, schedule, sim, plan (the
  plan file and layout), lowering (a plan to the simulator's input), search (the planner),
  runtime, then launch, dryrun, profile, fidelity, elastic and cli on top, the scenarios of
  medley.testing above all; inside search its stages depend one way too;
* no module uses another module's private names (``from medley.x import _name`` or
  ``obj._name`` where ``_name`` is defined only in other medley modules).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Lower layers first; a package may import only from packages before it (and from the top-level
# modules medley.errors and medley.fileio, which everything uses).
LAYERS = ("spec", "data", "hf", "cost", "schedule", "sim", "plan", "lowering", "search", "runtime", "launch",
          "dryrun", "profile", "fidelity", "elastic", "cli", "testing")
# Inside medley.search, the stages of a search, lower first: the space's vocabulary, the estimates,
# the rules that build candidates, the ranking, the entry point, the reports beside its result.
SEARCH_STAGES = ("space", "estimate", "rules", "rank", "planner", "report")


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / "medley").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), filename=str(path)) for name, path in MODULES.items()}


def _package(module: str) -> str:
    return module if MODULES[module].name == "__init__.py" else module.rsplit(".", 1)[0]


def _imported(module: str, node: ast.Import | ast.ImportFrom) -> list[tuple[str, str | None]]:
    """(medley module, imported name or None) for each name an import statement binds."""
    if isinstance(node, ast.Import):
        return [(a.name, None) for a in node.names if a.name in MODULES]
    if node.level:
        base = _package(module).split(".")[: len(_package(module).split(".")) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    out: list[tuple[str, str | None]] = []
    for alias in node.names:
        full = f"{source}.{alias.name}"
        if full in MODULES:
            out.append((full, None))
        elif source in MODULES:
            out.append((source, alias.name))
    return out


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges[name] |= {target for target, _ in _imported(name, node) if target != name}
    return edges


def _circles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components (more than one module) of the same-package import graph."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if _package(w) != _package(v):
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(frozenset(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else None


def test_no_import_circle_inside_a_package() -> None:
    circles = [sorted(c) for c in _circles(_edges())]
    assert circles == []


def test_packages_depend_one_way() -> None:
    wrong = []
    for module, targets in _edges().items():
        here = _layer(module)
        for target in targets:
            there = _layer(target)
            if here and there and here != there and LAYERS.index(there) > LAYERS.index(here):
                wrong.append(f"{module} imports {target}")
    assert sorted(wrong) == []


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_private_names(tree: ast.Module) -> set[str]:
    """Private names a module defines: functions, classes, assigned names and attributes."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
    return {name for name in out if _private(name)}


def test_no_module_uses_another_modules_private_names() -> None:
    defined = {name: _defined_private_names(tree) for name, tree in TREES.items()}
    everywhere: dict[str, set[str]] = {}
    for module, names in defined.items():
        for name in names:
            everywhere.setdefault(name, set()).add(module)
    wrong = []
    for module, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for source, name in _imported(module, node):
                    if name is not None and _private(name):
                        wrong.append(f"{module} imports {source}.{name}")
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                owners = everywhere.get(node.attr, set())
                if owners and module not in owners:
                    wrong.append(f"{module}:{node.lineno} uses .{node.attr} of {sorted(owners)}")
    assert sorted(set(wrong)) == []


def test_no_two_modules_share_a_name() -> None:
    # A name says one thing: `compile.py` in two packages sent readers to the wrong one.
    names: dict[str, list[str]] = {}
    for module, path in MODULES.items():
        if path.name != "__init__.py":
            names.setdefault(path.stem, []).append(module)
    assert {name: found for name, found in names.items() if len(found) > 1} == {}


def _search_stage(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "search" else None


def test_search_stages_depend_one_way() -> None:
    stages = {_search_stage(m) for m in MODULES} - {None}
    assert stages == set(SEARCH_STAGES), "a module or subpackage of medley.search is not a stage"
    wrong = []
    for module, targets in _edges().items():
        here = _search_stage(module)
        for target in targets:
            there = _search_stage(target)
            if here and there and SEARCH_STAGES.index(there) > SEARCH_STAGES.index(here):
                wrong.append(f"{module} imports {target}")
    assert sorted(wrong) == []
