"""A training entry that counts evaluations: the real ``launcher.entry`` plus one callback.

    python -m tests.support.eval_count_entry RUN_DIR

Every evaluation the Trainer runs (``on_evaluate``, called at the end of each eval loop) appends its global
step to ``RUN_DIR/evaluations.jsonl``, the final one after training included: LLaMA-Factory's own
``trainer_log.jsonl`` stops at the end of training, so it cannot show that one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from transformers import TrainerCallback

from launcher.rank import entry


class CountEvaluations(TrainerCallback):
    def __init__(self, path: Path):
        self.path = path

    def on_evaluate(self, args, state, control, **kwargs):
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": state.global_step}) + "\n")
        return control


def main() -> int:
    run_dir = Path(sys.argv[1]).resolve()
    return entry.main(sys.argv[1:], callbacks=(CountEvaluations(run_dir / "evaluations.jsonl"),))


if __name__ == "__main__":
    sys.exit(main())
