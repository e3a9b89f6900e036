"""A training entry that makes one rank's data loading slow: the real ``launcher.entry`` plus a planted sleep.

    SLOW_DATA='{"rank": 1, "seconds": 0.4}' python -m tests.slow_rank_entry RUN_DIR

On the rank named (every rank when ``rank`` is absent), LLaMA-Factory's collator sleeps ``seconds`` before
each batch: inside the DataLoader's ``__next__``, where `launcher profile` must find it as data loading, and
unequal work across ranks, which it must show as a spread.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

from launcher import entry


def main() -> int:
    spec = json.loads(os.environ.get("SLOW_DATA") or "{}")
    if spec and str(spec.get("rank", os.environ.get("RANK", "0"))) == os.environ.get("RANK", "0"):
        from llamafactory.data import collator

        original = collator.MultiModalDataCollatorForSeq2Seq.__call__

        @functools.wraps(original)
        def slow(self, features):
            time.sleep(float(spec["seconds"]))
            return original(self, features)

        slow.__deltanet_launcher_original__ = original  # patches/wrapping.py: the patches check the upstream code
        collator.MultiModalDataCollatorForSeq2Seq.__call__ = slow
    return entry.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
