"""``launcher resume``: continue a stopped or failed run from its last complete checkpoint.

The new attempt runs in the same run directory with the run's own ``config.yaml`` and LLaMA-Factory's
``resume_from_checkpoint``. That is exact when the checkpoint holds optimizer and scheduler state.
With ``save_only_model: true`` it holds only the adapter and the trainer state: the HF Trainer then
reloads the adapter and the step count, while the optimizer (Adam moments) and the learning-rate
schedule start afresh. The launcher says so and proceeds only with ``--adapter-only``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .records import TERMINAL, RunState, read_status
from .status import _reconcile, last_complete_checkpoint

RESUMABLE = {
    RunState.FAILED,
    RunState.CANCELLED,
    RunState.TERMINATED,
    RunState.OUT_OF_MEMORY,
    RunState.SUPERVISOR_LOST,
    RunState.NODE_LOST,
}


def plan_resume(run_dir: Path, adapter_only: bool) -> dict:
    """Where and how a run would resume.

    Raises:
        ValueError: the run cannot be resumed; the message says why and what to do.
    """
    status = read_status(run_dir)
    state, live, _ = _reconcile(status, run_dir)
    run_id = status.get("run_id", run_dir.name)
    if live or RunState(state) not in TERMINAL | {RunState.SUPERVISOR_LOST}:
        raise ValueError(f"run {run_id} is {state} with live processes {[r['pid'] for r in live]}; "
                         f"stop it first: `launcher stop {run_id}`")  # fmt: skip
    if RunState(state) not in RESUMABLE:
        raise ValueError(f"run {run_id} ended {state}; only stopped or failed runs are resumed "
                         f"({', '.join(sorted(s.value for s in RESUMABLE))})")  # fmt: skip
    checkpoint = last_complete_checkpoint(run_dir / "output")
    if checkpoint is None:
        raise ValueError(f"run {run_id} has no complete checkpoint in {run_dir / 'output'}; start it again "
                         f"with `launcher start {run_dir / 'config.yaml'}`")  # fmt: skip
    if not checkpoint["optimizer_state"] and not adapter_only:
        raise ValueError(
            f"checkpoint {checkpoint['path']} holds only the adapter (save_only_model: true): resuming reloads "
            "the adapter and the step count, but the optimizer and the learning-rate schedule restart from "
            "scratch. Pass --adapter-only to accept that."
        )
    mode = "exact" if checkpoint["optimizer_state"] else "adapter-only"
    return {"run_dir": run_dir, "checkpoint": Path(checkpoint["path"]), "mode": mode, "step": checkpoint["step"]}


def resume_run(run_dir: Path, adapter_only: bool = False, foreground: bool = False) -> int:
    try:
        plan = plan_resume(run_dir, adapter_only)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"resuming from {plan['checkpoint']} (step {plan['step']}, {plan['mode']})")
    if plan["mode"] == "adapter-only":
        print("note: optimizer and learning-rate schedule restart; only the adapter and step count are reloaded")
    config = run_dir / "config.yaml"
    if foreground:
        from .supervisor import supervise

        return supervise(config, resume=plan)
    from .control import start_detached

    return start_detached(config, resume=plan)
