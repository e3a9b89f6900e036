"""The package layout is the architecture: each layer imports only itself and the layers below it, no
module imports itself back through others, and no module reaches into another package's private names
(docs/architecture.md draws the layers).

Covers the three top-level packages: ``launcher/``, ``patches/`` (the runtime patches, loaded inside the
training processes; they use only the launcher's base) and ``benchmarks/`` (measuring scripts, above
everything). Read from the source with ``ast`` (nothing is imported): every ``import`` counts, also those
inside functions, relative ones and those under ``if TYPE_CHECKING:`` (a type hint names a module as much as
an import that runs: a rule that names a higher layer's type depends on it).
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

from tests.support.common import REPO

ROOTS = ("launcher", "patches", "benchmarks")
PACKAGE = REPO / "launcher"
# lowest first; a module may import its own layer and the layers below
LAYERS: dict[str, int] = {
    "launcher": 0,
    "launcher.errors": 0,
    "launcher.files": 0,
    "launcher.state": 1,
    "launcher.config": 1,  # the run config's schema, loading and load rules: below checks/ and run/
    "patches": 1,  # beside state/: imports only the base (launcher.files); imported by entry, checks, run
    "launcher.data": 2,
    "launcher.results": 2,
    "launcher.checks": 3,
    "launcher.monitor": 4,  # status, list, logs: ask each run's placement (run/placement/)
    "launcher.rank": 3,  # inside the training and evaluation processes
    "launcher.entry": 3,  # the stable alias of launcher.rank.entry (python -m launcher.entry)
    "launcher.run": 4,
    "launcher.cli": 5,
    "launcher.__main__": 5,
    "benchmarks": 6,  # scripts that drive everything, the cli included
}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    best = max((name for name in LAYERS if module == name or module.startswith(name + ".")), key=len)
    return LAYERS[best]


@functools.cache
def project() -> tuple[dict[str, ast.Module], frozenset[str]]:
    """Every module of the three packages parsed, and which of them are packages (an ``__init__.py``)."""
    paths = [p for root in ROOTS for p in sorted((REPO / root).rglob("*.py"))]
    trees = {module_name(p): ast.parse(p.read_text(), filename=str(p)) for p in paths}
    return trees, frozenset(module_name(p) for p in paths if p.name == "__init__.py")


def package_of(module: str, packages: frozenset[str]) -> str:
    return module if module in packages else module.rpartition(".")[0]


def source_of(node: ast.ImportFrom, module: str, packages: frozenset[str]) -> str:
    """The absolute module a ``from ... import`` reads (a relative one resolved against ``module``'s package)."""
    if not node.level:
        return node.module or ""
    base = package_of(module, packages).split(".")
    return ".".join([*base[: len(base) - node.level + 1], *([node.module] if node.module else [])])


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports_of(module: str, tree: ast.Module, packages: frozenset[str], *, type_checking: bool = True) -> set[str]:
    """The project modules ``module`` imports (a ``from pkg import sub`` names the submodule)."""
    modules = project()[0].keys()
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking_only(child) and not type_checking:
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name.split(".")[0] in ROOTS)
            elif isinstance(child, ast.ImportFrom):
                source = source_of(child, module, packages)
                if source.split(".")[0] in ROOTS:
                    subs = {f"{source}.{a.name}" for a in child.names} & modules
                    found.update(subs or {source})
            visit(child)

    visit(tree)
    return found


def import_graph(*, type_checking: bool = True) -> dict[str, set[str]]:
    trees, packages = project()
    return {m: imports_of(m, tree, packages, type_checking=type_checking) - {m} for m, tree in trees.items()}


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
        for module, targets in graph.items()
        for target in sorted(targets)
        if layer_of(target) > layer_of(module)
    ]


def import_loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    loops: list[list[str]] = []

    def strongconnect(node: str) -> None:
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
    return loops


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(module: str, tree: ast.Module, packages: frozenset[str]) -> set[tuple[str, str]]:
    """``(source module, name)`` for each private name ``module`` takes from a project module: imported by name
    (``from m import _x``) or read off an imported module (``import m; m._x``, ``from pkg import m; m._x``)."""
    modules = project()[0].keys()
    aliases: dict[str, str] = {}  # local name -> the module it is bound to
    uses: set[tuple[str, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound = alias.name if alias.asname else alias.name.split(".")[0]  # import a.b binds a
                aliases[alias.asname or bound] = bound
        elif isinstance(node, ast.ImportFrom):
            source = source_of(node, module, packages)
            for alias in node.names:
                if f"{source}.{alias.name}" in modules:
                    aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
                if _private(alias.name) and source in modules:
                    uses.add((source, alias.name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            head, _, rest = ast.unparse(node.value).partition(".")
            source = ".".join(filter(None, [aliases.get(head, ""), rest]))
            if head in aliases and source in modules:
                uses.add((source, node.attr))
    return uses


def private_crossings(trees: dict[str, ast.Module], packages: frozenset[str]) -> list[str]:
    """Private names taken from a module of another package (``launcher.run`` and ``launcher.state`` are two)."""
    return [
        f"{module} uses {source}.{name}"
        for module, tree in trees.items()
        for source, name in sorted(private_uses(module, tree, packages))
        if package_of(source, packages) != package_of(module, packages)
    ]


def test_every_module_has_a_layer():
    graph = import_graph()
    for found in ("launcher.state.record", "launcher.cli.run_verbs", "patches.registry", "benchmarks.patch_bench"):
        assert found in graph  # the walk found the tree
    for module in graph:
        layer_of(module)  # raises ValueError (max of nothing) for a module outside every layer


def test_relative_imports_count():
    graph = import_graph()
    assert {"patches.core.errors", "patches.core.proof", "patches.registry"} <= graph["patches"]
    assert "launcher.files" in graph["patches.core.proof"]


def test_no_layer_imports_a_higher_one():
    wrong = layer_violations(import_graph())
    assert not wrong, "\n".join(wrong)


def test_state_and_base_modules_import_nothing_above_them():
    above = ("launcher.run", "launcher.checks", "launcher.results", "launcher.cli", "launcher.monitor", "benchmarks")
    for module, targets in import_graph().items():
        if layer_of(module) <= 1:
            assert not [t for t in targets if t.startswith(above)], module


# what the patches, loaded inside every rank, may take from the launcher: its base layer and the run-folder map
PATCHES_MAY_IMPORT = ("launcher.state.runs",)


def test_patches_use_only_the_launchers_base():
    for module, targets in import_graph().items():
        if module.split(".")[0] == "patches":
            wrong = [
                t for t in targets if t.split(".")[0] != "patches" and layer_of(t) > 0 and t not in PATCHES_MAY_IMPORT
            ]
            assert not wrong, (module, wrong)


# what each support package of patches/ may import from patches/: the patches sit at the top, their machinery below
PATCH_SUPPORT_MAY_IMPORT = {
    "patches.core": ("patches.core",),
    "patches.kernels": ("patches.core", "patches.kernels"),
    "patches.planning": ("patches.core", "patches.planning"),
    "patches.packing": ("patches.core", "patches.kernels", "patches.packing"),
}


def test_patch_support_imports_no_patch():
    """``patches/core``, ``kernels``, ``planning`` and ``packing`` hold what the patches use; none imports a patch."""
    for module, targets in import_graph().items():
        support = module.split(".")[:2]
        allowed = PATCH_SUPPORT_MAY_IMPORT.get(".".join(support))
        if allowed is None:
            continue
        wrong = [t for t in targets if t.split(".")[0] == "patches" and not t.startswith(allowed)]
        assert not wrong, (module, wrong)


def test_the_run_folder_map_imports_only_the_base():
    """The map stays importable from the patches: it takes nothing from the rest of ``state/``."""
    assert all(layer_of(t) == 0 for t in import_graph()["launcher.state.runs"])


def test_there_are_no_import_loops():
    """Not even through type hints or an import inside a function (once: run/'s supervisor, stop and resume)."""
    loops = import_loops(import_graph())
    assert not loops, loops


def test_no_private_name_crosses_a_package():
    wrong = private_crossings(*project())
    assert not wrong, "\n".join(wrong)


PLANTED_PRIVATE = """
from launcher.run.supervisor import _say
from launcher.run import rundir
import launcher.files as files
import launcher.state.states
from launcher.state.checkpoints import _same_package_is_fine

def use():
    return rundir._layout, files._tmp, launcher.state.states._order
"""


@pytest.mark.parametrize(
    "wrong", ["state-imports-run", "patches-import-benchmarks", "loop", "private-name", "type-hint-up"]
)
def test_the_checks_catch_a_planted_violation(wrong):
    """The layer, loop and private-name checks fail on a tree that breaks them (so they can fail at all)."""
    graph = import_graph()
    if wrong == "state-imports-run":
        graph["launcher.state.record"] = graph["launcher.state.record"] | {"launcher.run.supervisor"}
        assert "launcher.state.record (layer 1) imports launcher.run.supervisor (layer 4)" in layer_violations(graph)
    elif wrong == "patches-import-benchmarks":
        packages = project()[1]
        planted = ast.parse("def measure():\n    from benchmarks import patch_bench\n    import benchmarks.fla_guard")
        graph["patches.core.proof"] = imports_of("patches.core.proof", planted, packages)
        assert graph["patches.core.proof"] == {"benchmarks.fla_guard", "benchmarks.patch_bench"}
        assert "patches.core.proof (layer 1) imports benchmarks.patch_bench (layer 6)" in layer_violations(graph)
    elif wrong == "type-hint-up":  # a hint under TYPE_CHECKING counts as an import (the exemption is gone)
        packages = project()[1]
        planted = ast.parse(
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from launcher.run.config import X"
        )
        graph["launcher.config.rules"] = imports_of("launcher.config.rules", planted, packages)
        assert "launcher.config.rules (layer 1) imports launcher.run.config (layer 4)" in layer_violations(graph)
    elif wrong == "loop":
        graph["launcher.files"] = graph["launcher.files"] | {"launcher.state.record"}
        assert any({"launcher.files", "launcher.state.record"} <= set(loop) for loop in import_loops(graph))
    else:
        planted = {
            "launcher.state.record": ast.parse(PLANTED_PRIVATE),
            "patches.core.proof": ast.parse("from . import _x"),
        }
        assert private_crossings(planted, project()[1]) == [
            "launcher.state.record uses launcher.files._tmp",
            "launcher.state.record uses launcher.run.rundir._layout",
            "launcher.state.record uses launcher.run.supervisor._say",
        ]  # the same package's private names (state.states, state.checkpoints; patches' own) are allowed


def test_every_package_says_what_lives_there_and_what_it_may_import():
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "import" in doc and len(doc.splitlines()) >= 2, init


def test_the_entry_alias_keeps_the_names_wrappers_use():
    """``launcher.entry`` moved to ``launcher.rank.entry``; configs and rank wrappers still find it as before."""
    from launcher import entry
    from launcher.rank import entry as rank_entry

    assert (entry.main, entry.write_error_file, entry.LAUNCH_FILE) == (
        rank_entry.main,
        rank_entry.write_error_file,
        rank_entry.LAUNCH_FILE,
    )


def test_the_engine_tests_live_where_the_engine_pass_collects_them():
    """``scripts/test.sh``'s second pass (markers docker, docker_npu, slurm) collects only its ``engine_paths``: the
    whole suite again took about 50 s on a busy 2-core machine only to skip everything but them."""
    script = (REPO / "scripts" / "test.sh").read_text()
    (line,) = [line for line in script.splitlines() if line.startswith("engine_paths=(")]
    paths = line.removeprefix("engine_paths=(").removesuffix(")").split()
    marked = {
        p.relative_to(REPO).as_posix()
        for p in (REPO / "tests").rglob("test_*.py")
        if re.search(r"pytest\.mark\.(docker|docker_npu|slurm)\b", p.read_text())
    }
    assert marked and all(any(m.startswith(p + "/") for p in paths) for m in marked), (paths, marked)
