"""Python's garbage collector without the model: the objects alive after the first optimizer step are frozen.

Upstream behaviour (CPython 3.11, the images' Python, ``Modules/gcmodule.c``, ``gc_collect_generations``): the cyclic
collector runs a young collection when the net allocations of tracked objects pass 700, and a full collection,
which walks every tracked object of the process, when more than ten middle-generation collections have run and the
objects waiting to join the oldest generation are more than a quarter of those already in it. Once the model, the
datasets, the optimizer and the compiled kernels are built, a training rank tracks of the order of 800,000 objects
(773,613 at the first step of the 27B shape on one H100). There, one full collection took 0.38 to 0.44 s inside
the 16th step's period of every 20-step run (docs/lab/2026-12-06-row-costs-and-stall.md; the 40-step runs of
earlier invocations stalled there and again at the 33rd step), about 2 % of the step time, which the step medians
leave out and throughput does not. With several ranks, each collects at its own moment and the others wait for it
at the next collective.

What this patch does: before the first training step after the first optimizer step (``trainer_hook``; the call
``gradient_accumulation_steps + 1``, so the optimizer's state exists and no step is unwinding an error), one full
collection (``gc.collect()``) and then ``gc.freeze()``, which moves every object still alive to a permanent
generation that later collections skip (the ``gc`` module's documentation). Later full collections walk only what
was made since. Frozen objects stay in memory while a reference holds them, as before; a reference cycle among them
that becomes garbage later is not collected (host memory, not device memory). Training is otherwise unchanged: no
tensor, no number. A run of a single optimizer step freezes nothing. Proof per rank: the objects frozen, the
seconds of that full collection (what one cost before the freeze) and the training step it preceded.

Versions: any CPython with ``gc.freeze`` (3.7 and later); the hook needs transformers' ``Trainer.training_step``
(``SUPPORTED``). Delete this patch when the collector no longer walks the whole heap in a full collection.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from packaging.specifiers import SpecifierSet
from pydantic import BaseModel, ConfigDict

from .core import trainer_hook
from .core.errors import PatchError
from .core.proof import ProofFile, utc_now
from .core.versions import require_symbols

NAME = "gc_freeze"
SUPPORTED = {"transformers": SpecifierSet(">=5.6.0,<5.7")}


class Options(BaseModel):
    """``launcher.patches.gc_freeze``: no options besides ``enabled``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    enabled: bool = True


_state: dict[str, Any] = {}


def check_symbols() -> None:
    """The Trainer step the hook wraps, and the interpreter's freeze."""
    require_symbols(NAME, "transformers", ("Trainer",), "transformers")
    if not hasattr(gc, "freeze"):
        raise PatchError(NAME, "this Python has no gc.freeze", "run CPython 3.7 or later")


def _freeze(trainer, model) -> None:
    """Collect, then freeze what is left."""
    started = time.perf_counter()
    gc.collect()
    seconds = round(time.perf_counter() - started, 4)
    gc.freeze()
    _state["frozen"] = True
    _state["proof"].update(
        frozen_objects=gc.get_freeze_count(),
        full_collection_s=seconds,
        before_training_step=_state["at_step"],
        frozen_at=utc_now(),
    )


def _schedule(trainer, model) -> None:
    """At the first training step: the freeze goes before the call that follows the first optimizer step."""
    _state["at_step"] = int(getattr(trainer.args, "gradient_accumulation_steps", 1) or 1) + 1
    trainer_hook.on_training_step(NAME, _state["at_step"], before=_freeze)


def apply(options: dict[str, Any], *, backend: str, proof: ProofFile, facts: dict[str, Any]) -> dict[str, Any]:
    """Schedule the freeze at this process's first training step."""
    restore()
    _state["proof"] = proof
    trainer_hook.on_first_training_step(NAME, before=_schedule)
    return {"hooked": "transformers.Trainer.training_step (the one after the first optimizer step)"}


def observe(*, backend: str, proof: ProofFile) -> None:
    """Disabled: the collector's thresholds, as upstream leaves them."""
    restore()
    proof.update(upstream={"thresholds": list(gc.get_threshold())})


def restore() -> None:
    """Unfreeze what this process froze (tests leave no trace)."""
    if _state.get("frozen"):
        gc.unfreeze()
    _state.clear()
