"""One map of the run folder: ``launcher/state/runs.py`` names every file and subfolder of a run directory,
once; the README's run-directory table lists exactly those names; no other module spells one itself.

Read from the source with ``ast`` and ``tokenize`` (nothing is imported). The map is every public upper-case
string constant of ``runs.py`` but ``ROOT_ENV``. Patterns compare without their variable parts: the map's
``rank{rank}.json``, the README's ``rank<N>.json`` and a glob's ``rank*.json`` are all ``rank.json``.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from tests.support.common import REPO

RUNS = REPO / "launcher" / "state" / "runs.py"
README = REPO / "README.md"
README_SECTION = "### Run directories"
NOT_NAMES = {"ROOT_ENV"}  # runs.py's string constant that names no file: the environment variable of the runs root
SCANNED = ("launcher", "patches")
# the same spelling for another folder's file: (module, name) -> why it is not the run folder's
ELSEWHERE = {
    ("launcher/checks/model.py", "model.safetensors"): "the base model's single weights file, in the model's folder",
}
# where a bare word (output, proof, errors...) is a path: the operand of `/` or the argument of these calls
PATH_CALLS = {"Path", "PurePath", "joinpath", "join", "glob", "rglob", "with_name", "mkdtemp", "mkstemp"}


def map_names(source: str | None = None) -> dict[str, str]:
    """The map: constant -> name, every public upper-case string constant at the top of ``runs.py``."""
    names = {}
    for node in ast.parse(RUNS.read_text() if source is None else source).body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            constant = node.targets[0].id
            if constant.isupper() and not constant.startswith("_") and constant not in NOT_NAMES:
                names[constant] = node.value.value
    return names


def bare(name: str) -> str:
    """A name without its variable parts: ``rank{rank}.json``, ``rank<N>.json``, ``rank*.json`` -> ``rank.json``."""
    return re.sub(r"\{[\w.]*\}|<\w+>|\*", "", name)


def bare_names(names: dict[str, str]) -> set[str]:
    return {bare(part) for name in names.values() for part in name.split("/") if part}


def readme_names(text: str) -> set[str]:
    """Every name in the first column of the README's run-directory table, path parts split apart."""
    section = text.split(README_SECTION, 1)[1]
    rows = []
    for line in section.splitlines():
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            break  # the table's end
    assert len(rows) > 3, "the README's run-directory table was not found"
    found = set()
    for row in rows[2:]:  # after the header and its rule
        first = row.split("|")[1]
        for token in re.findall(r"`([^`]+)`", first):
            found.update(bare(part) for part in token.split("/") if part)
    return found


def check_readme(text: str, names: dict[str, str]) -> None:
    listed, mapped = readme_names(text), bare_names(names)
    assert listed == mapped, (
        f"README's run-directory table lists what runs.py does not name: {sorted(listed - mapped)}; "
        f"runs.py names what the table does not list: {sorted(mapped - listed)}"
    )


def test_the_map_names_the_run_folder():
    names = map_names()
    expected = (
        "OUTPUT_SUBDIR",
        "STATUS_FILE",
        "EVENTS_FILE",
        "STOP_REQUEST",
        "SAVE_REQUEST",
        "SAVE_READY",
        "SAVE_DONE",
        "SUPERVISOR_LOG",
        "JOB_LOG",
        "PREFLIGHT_FILE",
        "TRAINER_LOG",
        "ERRORS_DIR",
    )
    assert not [c for c in expected if c not in names]
    import launcher.state.runs as runs

    assert {c: getattr(runs, c) for c in names} == names  # what ast read is what the module holds


def test_every_name_in_the_map_says_who_writes_it_and_what_it_holds():
    names = map_names()
    commented: set[str] = set()
    tokens = list(tokenize.generate_tokens(io.StringIO(RUNS.read_text()).readline))
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.NAME and tok.string in names and tok.start[1] == 0:
            line = tok.start[0]
            if any(t.type == tokenize.COMMENT and t.start[0] == line for t in tokens[i : i + 8]):
                commented.add(tok.string)
    assert commented == set(names), sorted(set(names) - commented)


def test_the_readme_table_lists_exactly_the_names_of_the_map():
    check_readme(README.read_text(), map_names())


@pytest.mark.parametrize("wrong", ["readme-misses-one", "map-gains-one", "readme-gains-one"])
def test_the_readme_check_catches_a_planted_difference(wrong):
    text, names = README.read_text(), map_names()
    if wrong == "readme-misses-one":
        text = "\n".join(line for line in text.splitlines() if "`stop_saved.json`" not in line)
    elif wrong == "map-gains-one":
        names = {**names, "NEW_FILE": "new_record.json"}
    else:
        text = text.replace("| `verify.json`", "| `verify.json`, `verify.old.json`", 1)
    assert text != README.read_text() or names != map_names()
    with pytest.raises(AssertionError):
        check_readme(text, names)


def _template(node: ast.JoinedStr) -> str:
    """An f-string as a pattern: ``f"rank{rank}.json"`` -> ``rank{}.json``."""
    return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)


def _in_path(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Whether a string is used as a path: an operand of ``/`` or an argument of a path call."""
    parent = parents.get(node)
    if isinstance(parent, ast.keyword):
        parent = parents.get(parent)
    if isinstance(parent, ast.BinOp) and isinstance(parent.op, ast.Div):
        return True
    if isinstance(parent, ast.Call):
        func = parent.func
        called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        return called in PATH_CALLS
    return False


def spelled_names(source: str, names: dict[str, str]) -> list[tuple[int, str]]:
    """Where ``source`` spells a name of the map itself: ``(line, text)``.

    A name with a dot, dash or underscore (``status.json``, ``checkpoint-{step}``) counts wherever a string or
    f-string is exactly it; a plain word (``output``, ``proof``) only where the string is a path: an operand of
    ``/``, a path call's argument, or a string of path parts (``output/trainer_log.jsonl``). A name that is
    only an extension (``{patch}.json``) is never looked for.
    """
    wanted = {bare(n) for n in names.values()} - {""}
    wanted = {n for n in wanted if not re.fullmatch(r"\.\w+", n)}
    distinct = {n for n in wanted if re.search(r"[._-]", n)}
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if isinstance(parents.get(node), ast.JoinedStr):
                continue  # a piece of an f-string: the f-string is looked at whole
            text = node.value
        elif isinstance(node, ast.JoinedStr):
            text = _template(node)
        else:
            continue
        if not text or any(c.isspace() for c in text):
            continue
        parts = [bare(p) for p in text.split("/") if p]
        path = _in_path(node, parents) or len(parts) > 1
        if any(p in distinct or (path and p in wanted) for p in parts):
            found.append((node.lineno, text))
    return found


def test_no_other_module_spells_a_name_of_the_map():
    names = map_names()
    spelled = []
    for top in SCANNED:
        for path in sorted((REPO / top).rglob("*.py")):
            if path == RUNS:
                continue
            where = str(path.relative_to(REPO))
            for line, text in spelled_names(path.read_text(), names):
                if (where, text) not in ELSEWHERE:
                    spelled.append(f"{where}:{line}: {text!r}")
    assert not spelled, "take these names from launcher/state/runs.py:\n" + "\n".join(spelled)


@pytest.mark.parametrize(
    "line",
    [
        'STATUS = "status.json"',
        'path = run_dir / "output" / "trainer_log.jsonl"',
        'default = "output/trainer_log.jsonl"',
        'folder = output / f"checkpoint-{step}"',
        'found = (run_dir / "errors").glob("rank*.json")',
        'proof_dir = run_dir / "proof"',
        'profile = folder / f"rank{rank}.ascend"',
    ],
)
def test_the_spelling_check_catches_a_planted_name(line):
    assert spelled_names(line, map_names()), line


def test_the_spelling_check_leaves_words_that_are_no_path():
    source = 'key = record.get("output")\nverb = "profile"\nsuffix = f"{name}.json"\nmsg = "see status.json there"\n'
    assert spelled_names(source, map_names()) == []


def test_patches_take_their_names_from_the_map():
    """patches/ imports launcher (proof.py: launcher.files), so it takes its run-folder names from the map too."""
    import patches.core.proof as proof
    import patches.fsdp2_resume_adapter as resume
    from launcher.state import runs

    assert resume.ADAPTER_FILE == runs.ADAPTER_FILE
    record = proof.proof_path(Path("/run") / runs.PROOF_DIR, "fused_ops", 3)
    folder = Path("/run") / runs.PROOF_DIR / runs.PROOF_RANK.format(rank=3)
    assert record == folder / runs.PROOF_FILE.format(patch="fused_ops") == Path("/run/proof/rank3/fused_ops.json")


def test_the_run_dir_module_points_at_the_one_prose_map_instead_of_repeating_it():
    doc = ast.get_docstring(ast.parse((REPO / "launcher" / "run" / "rundir.py").read_text())) or ""
    assert "README" in doc and "launcher/state/runs.py" in doc
    assert README_SECTION.removeprefix("### ") in doc
    listed = [name for name in set(map_names().values()) if "." in name and name in doc]
    assert len(listed) <= 1, f"rundir.py's docstring lists the folder again: {sorted(listed)}"
