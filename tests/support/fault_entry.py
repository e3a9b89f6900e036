"""A training entry for the fault tests: the real ``launcher.entry`` plus a fault injected by a callback.

    FAULT_SPEC='{"kill_at_step": 4, "attempt": 1, "rank": 0, "signal": 9}' python -m tests.support.fault_entry RUN_DIR
    FAULT_SPEC='{"hold_after": [3, 5], "hold_dir": "/some/folder"}' python -m tests.support.fault_entry RUN_DIR

A run config selects it with ``launcher.entry: tests.support.fault_entry``. The rank named by ``rank`` sends itself
``signal`` at the end of optimizer step ``kill_at_step`` during attempt ``attempt`` (RUN_DIR/launch.json),
as the kernel's OOM killer or a node failure would end it; every other rank and attempt trains normally.

``hold_after``: once each step named is done (logged, saved and evaluated: at the next step's begin), the
rank writes ``hold_dir/held-N`` (its pid) and waits until ``hold_dir/go-N`` exists, so that a test can change the
world (fill the disk) between two steps and see that training went on through the change.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from transformers import TrainerCallback

from launcher.rank import entry

SPEC_ENV = "FAULT_SPEC"


class FaultAtStep(TrainerCallback):
    def __init__(self, spec: dict):
        self.spec = spec

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step in self.spec.get("hold_after", ()):
            folder = Path(self.spec["hold_dir"])
            (folder / f"held-{state.global_step}").write_text(str(os.getpid()))
            while not (folder / f"go-{state.global_step}").exists():
                time.sleep(0.1)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.spec.get("kill_at_step"):
            os.kill(os.getpid(), int(self.spec.get("signal", 9)))
        return control


def main() -> int:
    run_dir = Path(sys.argv[1]).resolve()
    spec = json.loads(os.environ.get(SPEC_ENV) or "{}")
    attempt = json.loads((run_dir / "launch.json").read_text()).get("attempt", 1)
    chosen = attempt == int(spec.get("attempt", 1)) and os.environ.get("RANK", "0") == str(spec.get("rank", 0))
    return entry.main(sys.argv[1:], callbacks=(FaultAtStep(spec),) if chosen and spec else ())


if __name__ == "__main__":
    sys.exit(main())
