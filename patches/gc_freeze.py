"""Python's garbage collector without the model: the objects alive after the first training step are frozen.

Upstream behaviour (CPython 3.11, ``Modules/gcmodule.c``; the images run 3.11): the cyclic collector runs a
young collection every 700 net allocations of container objects and, once enough objects have survived into
the oldest generation (more than a quarter of those already there), a full collection, which walks every
tracked object of the process. After the model, the optimizer, the datasets and the compiled kernels are built,
a training rank holds of the order of 800,000 of them (773,613 at the first step of the 27B shape on one H100):
on that H100 each full collection took 0.38 to 0.44 s, inside one step in every 17 or so (docs/benchmarks.md,
"Sixteenth invocation"), about 2 % of the step time that the step medians leave out and throughput does not. With
several ranks, each collects at its own moment and the others wait for it at the next collective.

What this patch does: after the first training step of this process (``trainer_hook``; the optimizer's state
exists by then), one full collection (``gc.collect()``) and then ``gc.freeze()``, which moves every object still
alive to a permanent generation that later collections skip (Python's ``gc`` documentation). Later full
collections walk only what was made since. Objects frozen stay in memory while a reference holds them, as
before; a reference cycle among them that becomes garbage later is not collected (host memory, not device
memory). Training is otherwise unchanged: no tensor, no number. Proof per rank: the objects frozen, the seconds
of that full collection, and of one more full collection right after the freeze (what a full collection costs
from then on).

Versions: any CPython with ``gc.freeze`` (3.7 and later); the hook needs transformers' ``Trainer.training_step``
(``SUPPORTED``). Delete this patch when the collector no longer walks the whole heap in a full collection.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from packaging.specifiers import SpecifierSet
from pydantic import BaseModel, ConfigDict

from . import trainer_hook
from .errors import PatchError
from .proof import ProofFile, utc_now
from .versions import require_symbols

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


def _full_collection_s() -> float:
    started = time.perf_counter()
    gc.collect()
    return round(time.perf_counter() - started, 5)


def _freeze(trainer, model) -> None:
    """After the first training step: collect, freeze what is left, and time one full collection after it."""
    before = _full_collection_s()
    gc.freeze()
    frozen = gc.get_freeze_count()
    after = _full_collection_s()
    _state["frozen"] = True
    _state["proof"].update(frozen_objects=frozen, full_collection_s=before,
                           full_collection_after_freeze_s=after, at="after the first training step",
                           frozen_at=utc_now())  # fmt: skip


def apply(options: dict[str, Any], *, backend: str, proof: ProofFile, facts: dict[str, Any]) -> dict[str, Any]:
    """Register the freeze after this process's first training step."""
    _state.clear()
    _state["proof"] = proof
    trainer_hook.on_first_training_step(NAME, after=_freeze)
    return {"hooked": "transformers.Trainer.training_step (after the first)"}


def observe(*, backend: str, proof: ProofFile) -> None:
    """Disabled: the collector's thresholds, as upstream leaves them."""
    restore()
    proof.update(upstream={"thresholds": list(gc.get_threshold()), "frozen_objects": gc.get_freeze_count()})


def restore() -> None:
    """Unfreeze what this process froze (tests leave no trace)."""
    if _state.get("frozen"):
        gc.unfreeze()
    _state.clear()
