"""Runtime patches for upstream problems, one module per problem (filled in by the patches issue).

Contract used by the launcher (host side imports this without torch):

- ``PATCH_NAMES``: the registry's names, in the fixed order they are applied.
- ``apply_enabled(settings, *, backend, proof_dir)``: inside a training process, before the model is
  built, apply every enabled patch in order and write proof records into ``proof_dir``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

PATCH_NAMES: tuple[str, ...] = ()


def apply_enabled(settings: Mapping[str, Any], *, backend: str, proof_dir: Path) -> list[str]:
    """Apply the enabled patches in registry order; return the names applied."""
    unknown = sorted(set(settings) - set(PATCH_NAMES))
    if unknown:
        raise ValueError(f"unknown patch names {unknown}; known: {list(PATCH_NAMES)}")
    return []
