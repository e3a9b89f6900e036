"""The session fixture every wing shares: the tiny demo model and data, built once (helpers: tests/support/)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory) -> dict[str, Path]:
    """The tiny random Qwen3.5 model and demo dataset, built from scratch once per test session."""
    from launcher.demo import build_demo_assets

    return build_demo_assets(tmp_path_factory.mktemp("demo"))
