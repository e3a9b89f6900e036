"""The package layout is the architecture: each layer imports only itself and the layers below it, and no
module imports itself back through others (docs/architecture.md draws the layers).

Read from the source with ``ast`` (nothing is imported): every ``import`` counts, also those inside
functions. The layers leave out the ones under ``if TYPE_CHECKING:`` (type hints only, never run); the loop
check counts them too: an import put inside a function or under ``TYPE_CHECKING`` dodges a loop only at run
time, the modules still depend on each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGE = REPO / "launcher"
# lowest first; a module may import its own layer and the layers below
LAYERS: dict[str, int] = {
    "launcher": 0,
    "launcher.errors": 0,
    "launcher.files": 0,
    "launcher.procs": 0,
    "launcher.backend": 0,
    "launcher.state": 1,
    "launcher.data": 2,
    "launcher.results": 2,
    "launcher.demo": 2,
    "launcher.checks": 3,
    "launcher.monitor": 3,
    "launcher.entry": 3,
    "launcher.stopsave": 3,
    "launcher.oomtrack": 3,
    "launcher.profiling": 3,
    "launcher.evaluate_entry": 3,
    "launcher.evaluate_decode": 3,
    "launcher.run": 4,
    "launcher.cli": 5,
    "launcher.__main__": 5,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    best = max((name for name in LAYERS if module == name or module.startswith(name + ".")), key=len)
    return LAYERS[best]


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports_of(path: Path, modules: set[str], type_hints: bool = False) -> set[str]:
    """The launcher modules ``path`` imports (a ``from pkg import sub`` names the submodule); those under
    ``if TYPE_CHECKING:`` only with ``type_hints``."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking_only(child) and not type_hints:
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name.split(".")[0] == "launcher")
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and (child.module or "").startswith("launcher"):
                subs = {f"{child.module}.{a.name}" for a in child.names} & modules
                found.update(subs or {child.module})
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def import_graph(type_hints: bool = False) -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, modules, type_hints) - {module_name(p)} for p in paths}


def test_every_module_has_a_layer():
    graph = import_graph()
    assert "launcher.state.record" in graph and "launcher.cli.run_verbs" in graph  # the walk found the tree
    for module in graph:
        layer_of(module)  # raises ValueError (max of nothing) for a module outside every layer


def test_no_layer_imports_a_higher_one():
    wrong = [
        f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
        for module, targets in import_graph().items()
        for target in sorted(targets)
        if layer_of(target) > layer_of(module)
    ]
    assert not wrong, "\n".join(wrong)


def test_state_and_base_modules_import_nothing_above_them():
    above = ("launcher.run", "launcher.checks", "launcher.results", "launcher.cli", "launcher.monitor")
    for module, targets in import_graph().items():
        if layer_of(module) <= 1:
            assert not [t for t in targets if t.startswith(above)], module


def test_there_are_no_import_loops():
    """Not even through type hints or an import inside a function (e.g. run/: the supervisor, stop and resume)."""
    graph = import_graph(type_hints=True)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    loops: list[list[str]] = []

    def strongconnect(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in graph:
                continue
            if target not in index:
                strongconnect(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    for node in graph:
        if node not in index:
            strongconnect(node)
    assert not loops, loops


@pytest.mark.parametrize("wrong", ["state-imports-run", "loop"])
def test_the_checks_catch_a_planted_violation(monkeypatch, wrong):
    """The layer and loop checks fail on a tree that breaks them (so they can fail at all)."""
    graph = import_graph()
    if wrong == "state-imports-run":
        graph["launcher.state.record"] = graph["launcher.state.record"] | {"launcher.run.supervisor"}
        monkeypatch.setitem(globals(), "import_graph", lambda **_: graph)
        with pytest.raises(AssertionError):
            test_no_layer_imports_a_higher_one()
    else:
        graph["launcher.files"] = graph["launcher.files"] | {"launcher.state.record"}
        monkeypatch.setitem(globals(), "import_graph", lambda **_: graph)
        with pytest.raises(AssertionError):
            test_there_are_no_import_loops()


def test_every_package_says_what_lives_there_and_what_it_may_import():
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "import" in doc and len(doc.splitlines()) >= 2, init
