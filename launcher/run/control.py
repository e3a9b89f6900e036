"""``launcher start``, ``stop`` and ``resume``: each asks the run's placement (``run/placement``).

``start`` detaches a supervisor on this machine (``LocalPlacement.start``); ``stop`` reconciles the run where it
lives and stops it there (the one grace rule in ``Placement.stop``); ``resume`` plans from the record and
checkpoints (``resume.py``) and the placement carries the plan out: in the foreground, detached, in a new
container, or refused for a Slurm job (which resumes through Slurm).
"""

from __future__ import annotations

import os
from pathlib import Path

from launcher.config.run_config import RunConfig
from launcher.errors import ExitCode
from launcher.run.placement import placement_of
from launcher.run.placement.local import LocalPlacement
from launcher.run.resume import plan_resume
from launcher.run.supervisor import supervise
from launcher.state.record import RunStore, read_record


def start_detached(config: RunConfig) -> int:
    """``launcher start``: the supervisor detached on this machine; returns once the run directory exists."""
    return LocalPlacement.start(config)


def stop_run(run_dir: Path, grace_s: float | None, wait_s: float | None = None, now: bool = False) -> int:
    """Stop a live run where it lives (its placement): a save on stop first unless ``now``."""
    store = RunStore.open(run_dir)
    record = store.record
    placement = placement_of(record)
    seen = placement.reconcile(run_dir)
    if record.terminal and not seen.live:
        print(f"run {record.run_id} already ended: {record.state.value}")
        return ExitCode.OK
    by = f"launcher stop (pid {os.getpid()}, uid {os.getuid()})"
    return placement.stop(run_dir, store, seen, grace_s, now, by, wait_s)


def resume_run(run_dir: Path, adapter_only: bool = False, foreground: bool = False) -> int:
    """``launcher resume``: plan, then the run's placement carries out the new attempt (detached unless
    ``foreground``)."""
    placement = placement_of(read_record(run_dir))
    plan = plan_resume(run_dir, placement.reconcile(run_dir), adapter_only)
    return placement.resume(run_dir, plan, adapter_only, supervise if foreground else None)
