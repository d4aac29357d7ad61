"""The package's layers: imports run one way and no two modules import each
other, directly or round a longer loop.

Every import counts, whether at the top of a module, inside a function or
under ``TYPE_CHECKING``: a function-level import is still a dependency, only
a later one. The order is the one ``ckptool/__init__.py``'s docstring gives.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ckptool"

# layer of each subpackage; a module may import its own layer and those below
LAYERS = {"": 0, "read": 1, "write": 2, "check": 3, "tui": 4, "cli": 5}
# the public API (``import ckptool``, ``python -m ckptool``) may reach every
# layer, lazily; only the CLI stands as high
PUBLIC = {"ckptool", "ckptool.__main__"}
MAX_TOP_LEVEL = 12
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str) -> set[str]:
    """The ckptool modules ``name`` imports (a package counts as its __init__)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base]) if base else ".".join(up)
            # "from pkg import mod" imports the module; "from mod import name" the module
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target.startswith("ckptool") and target != name:
                found.add(target)
            # importing a.b.c runs a.b's __init__ first: from outside the
            # package a.b, that is a dependency too (a package's own modules
            # are its __init__'s to import)
            parent = target.rpartition(".")[0]
            while parent.count(".") >= 1 and not name.startswith(parent + "."):
                if parent != name and parent in MODULES:
                    found.add(parent)
                parent = parent.rpartition(".")[0]
    return found


GRAPH = {name: imports_of(name) for name in MODULES}


def layer(name: str) -> int:
    if name in PUBLIC:
        return LAYERS["cli"]
    parts = name.split(".")
    return LAYERS[parts[1]] if len(parts) > 2 or (
        len(parts) == 2 and parts[1] in LAYERS) else LAYERS[""]


def test_every_subpackage_has_a_layer() -> None:
    subpackages = {p.parent.relative_to(PACKAGE).parts[0] for p in PACKAGE.rglob("*.py")
                   if p.parent != PACKAGE}
    assert subpackages <= set(LAYERS)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_follow_the_layers(name: str) -> None:
    upward = sorted(t for t in GRAPH[name] if layer(t) > layer(name))
    assert not upward, f"{name} (layer {layer(name)}) imports a higher layer: {upward}"


def test_no_import_cycles() -> None:
    """Tarjan's strongly connected components: any component of more than
    one module is a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
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
                cycles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles


def test_the_graph_sees_function_level_imports() -> None:
    """The walk is not only over module tops (the CLI imports lazily)."""
    assert "ckptool.read.reader" in GRAPH["ckptool.cli"] | set().union(
        *(GRAPH[n] for n in MODULES if n.startswith("ckptool.cli.")))


def test_a_package_init_counts_for_its_modules() -> None:
    """``from ckptool.read.formats import torch_zip`` runs ``formats/__init__``:
    the walk sees it, so a package whose ``__init__`` imports a module that
    imports one of the package's modules is a cycle."""
    assert "ckptool.read.formats" in GRAPH["ckptool.read.layouts.names"]
    assert "ckptool.read.layouts.names" not in GRAPH["ckptool.read.formats"]


def test_few_modules_at_the_top() -> None:
    top = [p.name for p in PACKAGE.glob("*.py")]
    assert len(top) <= MAX_TOP_LEVEL, top


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_stay_small(name: str) -> None:
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines"


@pytest.mark.parametrize("name", sorted(n for n, p in MODULES.items() if p.name == "__init__.py"))
def test_each_package_says_what_it_owns(name: str) -> None:
    doc = ast.get_docstring(ast.parse(MODULES[name].read_text()))
    assert doc and len(doc.splitlines()) >= 3, f"{name} needs a docstring saying what it owns"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_each_module_opens_with_a_docstring(name: str) -> None:
    assert ast.get_docstring(ast.parse(MODULES[name].read_text())), name
