"""``launcher resume``: continue a stopped or failed run from its last complete checkpoint.

The new attempt runs in the same run directory with the run's own ``config.yaml`` and LLaMA-Factory's
``resume_from_checkpoint``. That is exact when the checkpoint holds optimizer and scheduler state.
With ``save_only_model: true`` it holds only the adapter and the trainer state: the HF Trainer then
reloads the adapter and the step count, while the optimizer (Adam moments) and the learning-rate
schedule start afresh. The launcher says so and proceeds only with ``--adapter-only``.

Here: the plan (``plan_resume``, a ``ResumePlan``), from the run's record and checkpoints only. The verb that
carries it out is ``resume_run`` in ``control.py``: the run's placement (``run/placement``) resumes it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from launcher.errors import LauncherError
from launcher.state.checkpoints import last_complete_checkpoint
from launcher.state.reconcile import Reconciled
from launcher.state.record import read_record
from launcher.state.runs import CONFIG_COPY, OUTPUT_SUBDIR
from launcher.state.states import RESUMABLE


@dataclass(frozen=True)
class ResumePlan:
    """Where and how a run resumes; passed to a detached supervisor as JSON."""

    run_dir: Path
    checkpoint: Path
    mode: Literal["exact", "adapter-only"]
    step: int
    skipped: tuple[str, ...] = ()  # newer checkpoints passed over, each "checkpoint-N (why)"; never deleted

    def to_json(self) -> str:
        return json.dumps(
            {
                "run_dir": str(self.run_dir),
                "checkpoint": str(self.checkpoint),
                "mode": self.mode,
                "step": self.step,
                "skipped": list(self.skipped),
            }
        )

    @classmethod
    def from_json(cls, text: str) -> ResumePlan:
        data = json.loads(text)
        return cls(
            Path(data["run_dir"]),
            Path(data["checkpoint"]),
            data["mode"],
            int(data["step"]),
            tuple(data.get("skipped", ())),
        )


def plan_resume(run_dir: Path, seen: Reconciled, adapter_only: bool) -> ResumePlan:
    """Where and how a run would resume; ``seen``: its record held against the live system by its placement
    (``run/placement``).

    Raises:
        LauncherError: the run cannot be resumed; the message says why and what to do.
    """
    run_id = read_record(run_dir).run_id
    if seen.live or not seen.state.terminal:
        raise LauncherError(
            f"run {run_id} is {seen.state.value} with live processes {seen.live_pids}; "
            f"stop it first: `launcher stop {run_id}`"
        )
    if seen.state not in RESUMABLE:
        raise LauncherError(
            f"run {run_id} ended {seen.state.value}; only stopped or failed runs are resumed "
            f"({', '.join(sorted(s.value for s in RESUMABLE))})"
        )
    output = run_dir / OUTPUT_SUBDIR
    skipped: list[str] = []
    checkpoint = last_complete_checkpoint(output, need_optimizer=not adapter_only, skipped=skipped)
    if checkpoint is None:
        usable = None if adapter_only else last_complete_checkpoint(output)
        if usable is not None:  # only checkpoints without optimizer state hold
            raise LauncherError(
                f"checkpoint {usable.path} holds only the adapter (save_only_model: true): resuming reloads "
                "the adapter and the step count, but the optimizer and the learning-rate schedule restart from "
                "scratch. Pass --adapter-only to accept that."
            )
        passed = f" (passed over, kept on disk: {'; '.join(skipped)})" if skipped else ""
        raise LauncherError(
            f"run {run_id} has no complete checkpoint in {output}{passed}; start it "
            f"again with `launcher start {run_dir / CONFIG_COPY}`"
        )
    mode = "exact" if checkpoint.optimizer_state else "adapter-only"
    return ResumePlan(run_dir, checkpoint.path, mode, checkpoint.step, tuple(skipped))
