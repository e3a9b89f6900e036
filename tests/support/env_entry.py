"""A training entry that records the rank's environment levers, then runs the real ``launcher.entry``.

    python -m tests.support.env_entry RUN_DIR

Writes ``RUN_DIR/env.rank<RANK>.json`` with the variables ``launcher.tuning`` may set, as the rank sees them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from launcher.rank import entry

LEVERS = (
    "TASK_QUEUE_ENABLE",
    "CPU_AFFINITY_CONF",
    "PYTORCH_NPU_ALLOC_CONF",
    "TRITON_CACHE_DIR",
    "TRITON_CACHE_AUTOTUNING",
)


def main() -> int:
    run_dir = Path(sys.argv[1]).resolve()
    seen = {name: os.environ[name] for name in LEVERS if name in os.environ}
    (run_dir / f"env.rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(seen))
    return entry.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
