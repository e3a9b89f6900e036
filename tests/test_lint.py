"""The lint the repository holds itself to: ``ruff check`` with the rules in pyproject.toml ([tool.ruff]), at the
version the lock files pin, over everything in the tree; run by the test command so that CI enforces it."""

from __future__ import annotations

import subprocess
import sys

from tests.support.common import REPO


def test_ruff_finds_nothing():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                          cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
