"""The lint and format the repository holds itself to: ``ruff check`` with the rules in pyproject.toml
([tool.ruff]) and ``ruff format --check``, at the version the lock files pin, over everything in the tree; run by
the test command so that CI enforces both."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.common import REPO


@pytest.mark.parametrize("command", [["check", "--output-format", "concise"], ["format", "--check"]])
def test_ruff_finds_nothing(command):
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "--no-cache", "."],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


MARKER = "# fmt: " + "skip"  # spelled in two parts, so that this file holds no marker itself


def test_the_formatter_owns_the_layout():
    """At most 20 lines keep their hand layout, each saying why on the line (``# fmt: skip  (why)``)."""
    found = []
    for path in sorted(
        p for root in ("launcher", "patches", "benchmarks", "tests") for p in (REPO / root).rglob("*.py")
    ):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if MARKER in line:
                found.append((f"{path.relative_to(REPO)}:{number}", line.split(MARKER, 1)[1].strip()))
    assert len(found) <= 20, f"{len(found)} lines keep their own layout: {found[:5]} ..."
    assert all(why.startswith("(") and len(why) > 4 for _, why in found), [f for f in found if not f[1]]
