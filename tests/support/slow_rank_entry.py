"""A training entry with planted slowness: the real ``launcher.entry`` plus sleeps where `launcher profile` must
find them.

    SLOW_DATA='{"rank": 1, "seconds": 0.4}' \
    SLOW_COMPILE='[{"step": 1, "seconds": 0.6}, {"step": 2, "seconds": 0.3, "rank": 1}]' \
        python -m tests.support.slow_rank_entry RUN_DIR

``SLOW_DATA``: on the rank named (every rank when ``rank`` is absent), LLaMA-Factory's collator sleeps
``seconds`` before each batch: inside the DataLoader's ``__next__``, where `launcher profile` must find it as
data loading, and unequal work across ranks, which it must show as a spread.

``SLOW_COMPILE``: a stand-in Triton compile (``JITFunction._do_compile`` replaced by a sleep of ``seconds``)
runs at the start of the optimizer step named, on the rank named (every rank when absent). It is called through
the class attribute, so the profiler's wrapper (``launcher/rank/profiling.py``, installed at train begin) times it as
a real compile: in the first step, before the profiled window, and in a profiled step.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

from launcher.rank import entry


def _plant_compiles(plan: list[dict]) -> None:
    from transformers import Trainer
    from triton.runtime.jit import JITFunction

    rank = os.environ.get("RANK", "0")
    mine = {int(p["step"]): float(p["seconds"]) for p in plan if str(p.get("rank", rank)) == rank}

    def stand_in(self, seconds):  # what a cold compile costs the host: wall time, no device work
        time.sleep(seconds)

    JITFunction._do_compile = stand_in
    original = Trainer.training_step

    @functools.wraps(original)
    def training_step(self, model, inputs, *args, **kwargs):
        seconds = mine.pop(self.state.global_step + 1, None)  # the optimizer step under way
        if seconds:
            JITFunction._do_compile(None, seconds)
        return original(self, model, inputs, *args, **kwargs)

    Trainer.training_step = training_step


def main() -> int:
    if os.environ.get("SLOW_COMPILE"):
        _plant_compiles(json.loads(os.environ["SLOW_COMPILE"]))
    spec = json.loads(os.environ.get("SLOW_DATA") or "{}")
    if spec and str(spec.get("rank", os.environ.get("RANK", "0"))) == os.environ.get("RANK", "0"):
        from llamafactory.data import collator

        original = collator.MultiModalDataCollatorForSeq2Seq.__call__

        @functools.wraps(original)
        def slow(self, features):
            time.sleep(float(spec["seconds"]))
            return original(self, features)

        slow.__deltanet_launcher_original__ = original  # patches/core/wrapping.py: the patches check the upstream code
        collator.MultiModalDataCollatorForSeq2Seq.__call__ = slow
    return entry.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
