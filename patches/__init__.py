"""Runtime patches for upstream problems, one module per problem (filled in by the patches issue).

Contract used by the launcher (the host side imports this package without torch):

- ``PATCH_NAMES``: the registry's names, in the fixed order they are applied.
- ``normalize_settings(raw)``: the ``launcher.patches`` section of a run config (name -> bool, or
  name -> mapping with ``enabled`` and patch options) turned into name -> {"enabled": bool, ...} for
  every registered patch, defaults filled in; raises ``ValueError`` listing every problem at once.
- ``apply_enabled(settings, *, backend, proof_dir)``: inside a training process, before the model is
  built, apply every enabled patch in order and write proof records into ``proof_dir``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

PATCH_NAMES: tuple[str, ...] = ()


def normalize_settings(raw: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    raw = dict(raw or {})
    unknown = sorted(set(raw) - set(PATCH_NAMES))
    if unknown:
        raise ValueError(f"unknown patch names {unknown}; known patches: {list(PATCH_NAMES)}")
    return {name: {"enabled": True} for name in PATCH_NAMES}


def apply_enabled(settings: Mapping[str, Any], *, backend: str, proof_dir: Path) -> list[str]:
    """Apply the enabled patches in registry order; return the names applied."""
    return []
