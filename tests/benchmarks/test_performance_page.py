"""docs/performance.md quotes only results files: every figure of a table row is one of the ``figures`` of the
results file the row names (of the row's variant, at the precision the page shows), the row's date is the file's,
and the command of every file named is on the page. A wrong figure planted in a copy of the page fails."""

from __future__ import annotations

import re

import pytest

from benchmarks.results_schema import Results
from tests.support.common import REPO

PAGE = REPO / "docs" / "performance.md"
RESULTS = REPO / "benchmarks" / "results"
# columns that hold no figure: what the row is, how it was set, and where it comes from
WORDS = {"what", "option set", "variant", "date", "results file"}
NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?")


def table_rows(text: str) -> list[dict[str, str]]:
    """Each row of each table whose header has a ``results file`` column, as header -> cell."""
    rows, header = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif not all(set(cell) <= set("-: ") for cell in cells) and "results file" in header:
            rows.append(dict(zip(header, cells, strict=True)))
    return rows


def matches(shown: str, value: float) -> bool:
    """``value`` rounded to the decimals ``shown`` has is the number shown."""
    decimals = len(shown.split(".")[1]) if "." in shown else 0
    return round(value, decimals) == float(shown.replace(",", ""))


def page_problems(text: str) -> list[str]:
    """Every figure of the page not found in the results file its row names, and every row or file that does not
    hold (a missing file, another date, a command not on the page)."""
    problems, named = [], set()
    rows = table_rows(text)
    if not rows:
        return ["no table with a 'results file' column"]
    for row in rows:
        name = row["results file"].strip("`")
        path = RESULTS / name
        if not path.is_file():
            problems.append(f"{name}: no such results file in benchmarks/results/")
            continue
        results, variant = Results.read(path), row.get("variant", "").strip("`")
        named.add(name)
        if row.get("date") and row["date"] != results.date.isoformat():
            problems.append(f"{name}: the page says {row['date']}, the file {results.date}")
        own = {k: v for k, v in results.figures.items() if not variant or k == variant or k.startswith(variant + ".")}
        for column, cell in row.items():
            if column in WORDS:
                continue
            for shown in NUMBER.findall(cell):
                if not any(matches(shown, value) for value in own.values()):
                    problems.append(f"{name}: {column} {shown} of {variant or 'the file'} is not among its figures")
    for name in sorted(named):
        command = Results.read(RESULTS / name).command
        if command and command not in text:
            problems.append(f"{name}: its command is not on the page: {command}")
    return problems


def test_every_figure_of_the_page_is_in_the_results_file_it_names():
    assert page_problems(PAGE.read_text()) == []


@pytest.mark.parametrize(
    "plant, found",
    [
        (("| 3,535.5 |", "| 3,536.5 |"), "tokens/s 3,536.5 of on is not among its figures"),
        (("| 55.141 |", "| 55.094 |"), "peak GiB 55.094 of spread-packed is not among its figures"),
        (("| 161.9 |", "| 160.9 |"), "seconds 160.9 of evaluation-1"),
        (("| 2026-12-05 | `glue-budget-pair-h200.json`", "| 2026-12-06 | `glue-budget-pair-h200.json`"), "2026-12-06"),
        (("`glue-h200.json` |", "`glue-h300.json` |"), "glue-h300.json: no such results file"),
        (("--variants ctx32k,ctx64k --steps 3", "--variants ctx32k --steps 3"), "perf-h200-run3.json: its command"),
    ],
)
def test_a_wrong_figure_planted_in_a_copy_of_the_page_fails(tmp_path, plant, found):
    text = PAGE.read_text()
    old, new = plant
    assert old in text, f"the page no longer holds {old!r}: plant another figure"
    copy = tmp_path / "performance.md"
    copy.write_text(text.replace(old, new, 1))
    problems = page_problems(copy.read_text())
    assert any(found in problem for problem in problems), problems


def test_the_page_is_short_and_names_each_device():
    text = PAGE.read_text()
    assert len(text.splitlines()) <= 300
    for heading in (
        "## One H100",
        "## One H200",
        "## 8 x Ascend 910B",
        "## CPU",
        "## Not measured",
        "## How a performance target is decided",
    ):
        assert heading in text
