"""The session fixtures every wing shares: the tiny demo model and data, built once; the real Docker engine and
the cpu image (tests/support/engine.py). Helpers: tests/support/."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.engine import cpu_image, engine  # noqa: F401  (session fixtures, registered here)


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory) -> dict[str, Path]:
    """The tiny random Qwen3.5 model and demo dataset, built from scratch once per test session."""
    from launcher.data.demo import build_demo_assets

    return build_demo_assets(tmp_path_factory.mktemp("demo"))
