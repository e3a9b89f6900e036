"""Setup checks before a run exists: the config against the devices and LLaMA-Factory's own parser,
and earlier runs under the same output root (made while holding the run lock).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from launcher import backend as backends
from launcher.errors import ExitCode, LauncherError
from launcher.run.config import ConfigError, RunConfig, llamafactory_args, validate_llamafactory_args
from launcher.state.reconcile import reconcile
from launcher.state.record import RecordUnreadable, RunStore
from launcher.state.runs import list_runs
from launcher.state.states import RunState


@dataclass
class Prepared:
    """A validated config and the backend it resolved to."""

    config: RunConfig
    backend: backends.Backend


def prepare(config: RunConfig) -> Prepared:
    """Validate everything about ``config`` that can be checked before a run exists.

    Raises:
        ConfigError: with every problem found (backend, device count, LLaMA-Factory's parser).
    """
    try:
        backend = backends.resolve(config.launcher.backend)
    except ValueError as err:
        raise ConfigError(str(config.source), [f"launcher.backend: {err}"]) from None
    problems = []
    if backend.name != "cpu":
        found = backends.device_count(backend.name)
        if found < config.launcher.nproc_per_node:
            problems.append(
                f"launcher.nproc_per_node: {config.launcher.nproc_per_node} processes but {found} "
                f"{backend.name} device(s) visible (check {backend.visible_devices_env}, or lower "
                "launcher.nproc_per_node)"
            )
    placeholder = Path(config.launcher.output_root).resolve() / "validate" / "output"
    problems.extend(validate_llamafactory_args(llamafactory_args(config, backend.name, placeholder)))
    if problems:
        raise ConfigError(str(config.source), problems)
    for note in config.notes:
        print(f"note: {note}", file=sys.stderr)
    return Prepared(config, backend)


def check_earlier_runs(root: Path) -> list[str]:
    """Refuse while an earlier run's processes live; record runs whose host or container is gone.

    Called while holding the run lock of ``root``. An earlier run that is not terminal and whose
    processes cannot be seen from here (it ran in another container, which is now gone) cannot still
    be live: its supervisor would hold this lock. It is recorded NODE_LOST.

    Returns:
        Warnings to show (runs now recorded NODE_LOST).

    Raises:
        LauncherError (REFUSED): an earlier run still has live training processes.
    """
    warnings = []
    for run_dir in list_runs(root):
        try:
            store = RunStore.open(run_dir)
        except RecordUnreadable:
            continue
        if store.record.terminal:
            continue
        seen = reconcile(store.record, run_dir)
        run_id = store.record.run_id
        if seen.liveness == "unknown":
            where = (store.record.container or {}).get("name") or "another pid namespace"
            seen.state, seen.note = RunState.NODE_LOST, f"its supervisor ({where}) is gone: the run lock was free"
        if seen.state is RunState.NODE_LOST:
            store.record_end(RunState.NODE_LOST, reason=seen.note, processes=[])
            warnings.append(f"run {run_id}: {seen.note}; recorded NODE_LOST")
        elif seen.live:
            raise LauncherError(
                f"run {run_id} still has live training processes {seen.live_pids} (its supervisor is "
                f"gone); stop them first: `launcher stop {run_id}`",
                ExitCode.REFUSED,
            )
    return warnings
