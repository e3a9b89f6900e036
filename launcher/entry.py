"""The training entry point: one of these runs per rank, under torchrun or accelerate launch.

    python -m launcher.entry RUN_DIR

It reads ``RUN_DIR/launch.json`` (written by ``launcher run``/``start``), applies the enabled
runtime patches in the registry's order, and only then hands the exact LLaMA-Factory YAML of the
run to LLaMA-Factory's own training entry (``llamafactory.train.tuner.run_exp``). Patches must be
in place before the model is built, which is why they are applied here and not in a callback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

LAUNCH_FILE = "launch.json"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m launcher.entry RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(argv[0]).resolve()
    launch = json.loads((run_dir / LAUNCH_FILE).read_text())

    import patches

    patches.apply_enabled(launch["patches"], backend=launch["backend"], proof_dir=run_dir / "proof")

    from llamafactory.train.tuner import run_exp

    args = yaml.safe_load((run_dir / launch["llamafactory_yaml"]).read_text())
    run_exp(args=args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
