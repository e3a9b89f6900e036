"""The lab log apart from the product (docs/lab/): one dated file per question under a stable name, each in the
index, and no "N-th invocation" left anywhere in the tree for code or docs to cite by ordinal."""

from __future__ import annotations

import re
import subprocess

from tests.support.common import REPO

LAB = REPO / "docs" / "lab"
NAME = re.compile(r"^\d{4}-\d{2}-\d{2}-[a-z0-9]+(-[a-z0-9]+)*\.md$")
ORDINALS = (
    "first",
    "second",
    "third",
    "fourth",
    "fifth",
    "sixth",
    "seventh",
    "eighth",
    "ninth",
    "tenth",
    "eleventh",
    "twelfth",
    "thirteenth",
    "fourteenth",
    "fifteenth",
    "sixteenth",
    "seventeenth",
    "eighteenth",
    "nineteenth",
    "twentieth",
)
WORD = "invo" + "cation"  # spelled apart, so that this file cites nothing itself
ORDINAL_INVOCATION = re.compile(
    rf"\b(?:(?:twenty|thirty)-)?(?:{'|'.join(ORDINALS)}|\d+(?:st|nd|rd|th))\b[\s\"'*]+(?:\w+\s+){{0,2}}invocations?\b",
    re.IGNORECASE,
)


def ordinal_citations(text: str) -> list[str]:
    """Every ordinal citation in ``text``: an ordinal (word or number), at most two words, then the word."""
    return [m.group(0) for m in ORDINAL_INVOCATION.finditer(text)]


def test_each_lab_entry_is_dated_named_and_indexed():
    index = (LAB / "README.md").read_text()
    entries = sorted(p for p in LAB.glob("*.md") if p.name != "README.md")
    assert len(entries) > 30
    for entry in entries:
        assert NAME.match(entry.name), f"{entry.name}: a lab entry is named <date>-<question>.md"
        assert f"]({entry.name})" in index, f"{entry.name} is not in docs/lab/README.md"
        assert entry.read_text().startswith("# "), f"{entry.name} opens with its question as a title"
    assert not (REPO / "docs" / "benchmarks.md").exists()  # the lab log that cited by ordinal is gone


def test_no_file_of_the_tree_cites_an_invocation_by_ordinal():
    tracked = subprocess.run(["git", "-C", str(REPO), "ls-files"], capture_output=True, text=True, check=True)
    found = {}
    for name in tracked.stdout.splitlines():
        path = REPO / name
        if path.suffix not in (".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".in", "") or not path.is_file():
            continue
        hits = ordinal_citations(path.read_text(errors="replace"))
        if hits:
            found[name] = hits
    assert found == {}


def test_the_ordinal_check_can_fail():
    for planted in (
        f'docs/benchmarks.md, "Twenty-first {WORD}"',
        f"the ninth {WORD} below",
        f"the eighth glue {WORD}",
        f"in the fourth and fifth {WORD}s",
        f"the 16th {WORD}",
    ):
        assert ordinal_citations(planted), planted
    assert ordinal_citations(f"in one {WORD}, an earlier {WORD}, the next {WORD}") == []
