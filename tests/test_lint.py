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
    done = subprocess.run([sys.executable, "-m", "ruff", *command, "--no-cache", "."],
                          cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
