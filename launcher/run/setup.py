"""Setup before a run exists: the config's checks (``launcher.checks.config_rules.check_run_config``, which
``launcher check`` runs off the server too) made into a ``Prepared`` run, and earlier runs under the same
output root (checked while holding the run lock).
"""

from __future__ import annotations

import sys
from pathlib import Path

from launcher.checks.config_check import WARN
from launcher.checks.config_rules import check_run_config
from launcher.config import backend as backends
from launcher.config.run_config import ConfigError, Prepared, RunConfig
from launcher.errors import ExitCode, LauncherError
from launcher.run.placement import placement_of
from launcher.state.devices import DeviceError, run_devices
from launcher.state.lease import DeviceLease
from launcher.state.procs import find_live
from launcher.state.record import RecordUnreadable, RunStore
from launcher.state.runs import list_runs
from launcher.state.states import RunState


def prepare(config: RunConfig) -> Prepared:
    """Validate everything about ``config`` that can be checked before a run exists.

    Raises:
        ConfigError: with every problem ``launcher.checks.config_rules.check_run_config`` found (backend,
            devices, patch options, the LLaMA-Factory part).
    """
    found = check_run_config(config, output=False)
    if found.errors:
        raise ConfigError(str(config.source), [f.message for f in found.errors])
    for note in [*config.notes, *(f.message for f in found.items if f.level == WARN)]:
        print(f"note: {note}", file=sys.stderr)
    return Prepared(config, backends.resolve(config.launcher.backend))


def lease_devices(prepared: Prepared) -> DeviceLease:
    """Take the device leases of a run: exactly the accelerators its job will use (``state/devices.run_devices``
    from the job's environment), held until the end record is written. A CPU run uses none.

    Raises:
        LeaseBusy (REFUSED): a device is leased by another run, named with its runs folder, user and devices.
        LauncherError (USAGE): the selection names a device this host does not have, or the lease folder or a
            lease file cannot be used.
    """
    backend = prepared.backend
    if backend.name == "cpu":
        return DeviceLease([])
    try:
        devices = run_devices(backend.name, prepared.config.launcher.nproc_per_node, backends.child_env(backend))
    except DeviceError as err:
        raise LauncherError(str(err), ExitCode.USAGE) from None
    return DeviceLease(devices).acquire(Path(prepared.config.launcher.output_root))


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
        run_id = store.record.run_id
        if store.record.terminal:  # an end recorded by a supervisor that could not stop its job (supervise)
            if live := [p.pid for p in (find_live(r) for r in store.record.processes) if p is not None]:
                raise LauncherError(
                    f"run {run_id} ended {store.record.state.value}, but its training processes {live} are still "
                    f"alive; stop them first: `launcher stop {run_id}`",
                    ExitCode.REFUSED,
                )
            continue
        placement = placement_of(store.record)
        seen = placement.reconcile(run_dir)
        if seen.liveness == "unknown":
            seen.state, seen.note = (
                RunState.NODE_LOST,
                f"its supervisor ({placement.where()}) is gone: the run lock was free",
            )
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
