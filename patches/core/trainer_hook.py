"""Callbacks around the first (or the N-th) ``transformers.Trainer.training_step`` of this process.

Some facts only exist once training runs: the Trainer re-enables gradient checkpointing from its own
arguments in ``_inner_training_loop`` just before the loop, and the model it hands to ``training_step`` is
already wrapped (PEFT, DDP, FSDP). So patches that must act "at the first real training step" register a
``before`` and an ``after`` callback here (``on_first_training_step``; ``on_training_step`` for a later
step, such as the second step of a layer plan decided at the end of the first). The wrapper is installed
once on the ``Trainer`` class (a marker attribute makes it idempotent); after the last step anyone asked
for it costs one comparison per call.

``before`` callbacks may raise (an enabled patch that finds its work undone fails the run there, before the
first forward). ``after`` callbacks only record; their errors are logged, never raised, so they cannot mask
an error of the step itself.

Subclasses that override ``training_step`` without calling ``super()`` bypass the wrapper; the proof records
then lack ``first_training_step``, which the launcher should treat as missing proof.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

_MARKER = "__deltanet_launcher_first_step__"
StepCallback = Callable[[Any, Any], None]  # (trainer, model)

_callbacks: dict[tuple[int, str], tuple[StepCallback | None, StepCallback | None]] = {}
_state = {"steps": 0}


def on_training_step(
    key: str, step: int, *, before: StepCallback | None = None, after: StepCallback | None = None
) -> None:
    """Register (or replace) the callbacks of ``key`` around this process's ``step``-th training step
    (1-based); make sure the wrapper is installed."""
    install()
    _callbacks[(step, key)] = (before, after)


def on_first_training_step(key: str, *, before: StepCallback | None = None, after: StepCallback | None = None):
    """Register (or replace) the callbacks stored under ``key`` and make sure the wrapper is installed."""
    on_training_step(key, 1, before=before, after=after)


def clear() -> None:
    """Forget every callback and count steps from zero again (a fresh ``apply_enabled`` starts here)."""
    _callbacks.clear()
    _state["steps"] = 0


def is_installed() -> bool:
    from transformers import Trainer

    return bool(getattr(Trainer.training_step, _MARKER, False))


def install() -> None:
    """Wrap ``transformers.Trainer.training_step`` once per process."""
    from transformers import Trainer

    if is_installed():
        return
    original = Trainer.training_step

    @functools.wraps(original)
    def training_step(self, *args, **kwargs):
        if not _callbacks or _state["steps"] >= max(step for step, _ in _callbacks):
            return original(self, *args, **kwargs)
        _state["steps"] += 1
        model = args[0] if args else kwargs["model"]
        callbacks = [(key, pair) for (step, key), pair in list(_callbacks.items()) if step == _state["steps"]]
        for _, (before, _after) in callbacks:
            if before is not None:
                before(self, model)
        try:
            return original(self, *args, **kwargs)
        finally:
            for key, (_before, after) in callbacks:
                if after is None:
                    continue
                try:
                    after(self, model)
                except Exception:
                    logger.exception("the callback of %s after training step %d failed", key, _state["steps"])

    setattr(training_step, _MARKER, True)
    training_step.__deltanet_launcher_original__ = original
    Trainer.training_step = training_step


def uninstall() -> None:
    """Put the original ``training_step`` back (tests use this to leave no trace)."""
    from transformers import Trainer

    current = Trainer.training_step
    if getattr(current, _MARKER, False):
        Trainer.training_step = current.__deltanet_launcher_original__
    clear()
