"""Data tools: SoulChat-R1 conversion (``prepare``, ``soulchat``) and token statistics (``stats``).

``launcher data prepare`` needs no torch; ``launcher data stats`` and ``short_stats`` load the training
stack when called. Nothing here prints conversation text unless asked (``--show-samples``).
"""

from __future__ import annotations

from typing import Any

from .prepare import PrepareError, prepare
from .soulchat import REJECT_KINDS, Options, Rejected


def short_stats(config: Any, sample: int = 500, warn_share: float | None = None) -> dict[str, Any]:
    """Token statistics of at most ``sample`` samples per split (see ``launcher.data.stats.short_stats``)."""
    from .stats import short_stats as _short_stats

    return _short_stats(config, sample=sample, warn_share=warn_share)


__all__ = ["REJECT_KINDS", "Options", "PrepareError", "Rejected", "prepare", "short_stats"]
