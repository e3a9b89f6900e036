"""The training entry point: one of these runs per rank, under torchrun or accelerate launch.

    python -m launcher.entry RUN_DIR

It reads ``RUN_DIR/launch.json`` (written by ``launcher run``/``start``), applies the enabled
runtime patches in the registry's order, and only then hands the exact LLaMA-Factory YAML of the
run to LLaMA-Factory's own training entry (``llamafactory.train.tuner.run_exp``). Patches must be
in place before the model is built, which is why they are applied here and not in a callback.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import yaml

from launcher.files import write_json_atomic
from launcher.state.runs import ERRORS_DIR, LAUNCH_FILE


def write_error_file(run_dir: Path, exc: BaseException) -> Path:
    """Record this rank's failure as ``errors/rank<N>.json`` (the root cause the supervisor reports)."""
    rank = os.environ.get("RANK", "0")
    folder = run_dir / ERRORS_DIR
    folder.mkdir(exist_ok=True)
    path = folder / f"rank{rank}.json"
    record = {
        "rank": int(rank),
        "time": time.time(),
        "pid": os.getpid(),
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
    }
    write_json_atomic(path, record)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m launcher.entry RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(argv[0]).resolve()
    try:
        return _train(run_dir)
    except BaseException as exc:
        if not isinstance(exc, (KeyboardInterrupt, SystemExit)):
            write_error_file(run_dir, exc)
        raise


def _train(run_dir: Path) -> int:
    launch = json.loads((run_dir / LAUNCH_FILE).read_text())

    import patches

    patches.apply_enabled(launch["patches"], backend=launch["backend"], proof_dir=run_dir / "proof")

    from launcher.data.privacy import log_examples_wanted, protect_training_log

    if not log_examples_wanted(run_dir):  # no training text in the log unless the config asks for it
        protect_training_log()

    from llamafactory.train.tuner import run_exp

    args = yaml.safe_load((run_dir / launch["llamafactory_yaml"]).read_text())
    run_exp(args=args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
