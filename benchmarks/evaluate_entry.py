"""Evaluation child of the evaluate benchmark: ``launcher.rank.evaluate`` with the base built on the device.

    python -m benchmarks.evaluate_entry REQUEST_JSON   (``benchmarks.evaluate_bench`` starts it through
                                                        ``launcher.run.evaluate.evaluate_run``)

``launcher.rank.evaluate.main`` reads the request and evaluates exactly as ``launcher evaluate`` does; before it loads
anything, this module's ``prepare``, in this process only:

1. on CUDA, lifts FLA's Hopper guard (``benchmarks.fla_guard``), as the benchmark's training entry does: the
   measuring H200 has Triton 3.6.0, and evaluation runs no backward;
2. makes ``from_pretrained`` of a folder marked ``random_init.json`` build the model with random weights directly on
   the device (``benchmarks.bench_entry.install_random_init``, the marker's seed, as in training), so the 27B shape
   needs no 51 GB of weights on disk. The figures therefore leave out reading the base from disk.

The child's record (device, guard, how the model was built) is ``bench/evaluate.json`` in the run directory, beside
the training rank's ``bench/rank0.json``; ``evaluate_bench`` copies it into its results.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from benchmarks.bench_entry import Recorder, install_random_init, rank_device
from launcher.rank import evaluate
from patches.core.proof import utc_now

RECORD = "evaluate.json"  # in the run directory's bench/, beside the training rank's record


def main(argv: list[str] | None = None) -> int:
    recorders: list[Recorder] = []

    def prepare(request: dict[str, Any]) -> None:
        backend = request["backend"]
        recorder = Recorder(Path(request["run_dir"]))
        recorder.path = recorder.path.with_name(RECORD)
        recorder.data["entry"] = "benchmarks.evaluate_entry"
        recorders.append(recorder)
        guard = None
        if backend == "cuda":
            from benchmarks.fla_guard import lift_hopper_guard

            guard = lift_hopper_guard()
        device = rank_device(backend)
        recorder.update(backend=backend, device=device, fla_guard=guard)
        install_random_init(device, recorder)

    try:
        return evaluate.main(argv, prepare=prepare)
    finally:
        for recorder in recorders:
            recorder.update(ended_at=utc_now())


if __name__ == "__main__":
    sys.exit(main())
