"""Setup checks before a run exists: the config against the devices, LLaMA-Factory's arguments and the
output root (``launcher check`` runs them off the server too), and earlier runs under the same output
root (made while holding the run lock).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from launcher import backend as backends
from launcher.checks.config_check import ERROR, OK, SKIPPED, WARN, Finding, Findings, check_llamafactory
from launcher.checks.data import check_output
from launcher.checks.patch_check import patch_problems
from launcher.errors import ExitCode, LauncherError
from launcher.run.config import ConfigError, RunConfig, llamafactory_args
from launcher.state.reconcile import reconcile
from launcher.state.record import RecordUnreadable, RunStore
from launcher.state.runs import OUTPUT_SUBDIR, list_runs
from launcher.state.states import RunState


@dataclass
class Prepared:
    """A validated config and the backend it resolved to."""

    config: RunConfig
    backend: backends.Backend


def check_run_config(config: RunConfig, *, problems: list[str] | None = None, model: bool = True,
                     devices: bool = True, output: bool = True, elsewhere: bool = False) -> Findings:  # fmt: skip
    """Every check of a run config that needs no run: the launcher section (``problems`` from
    ``read_run_config``), the devices, the LLaMA-Factory part (``checks.config_check``), the output root.

    Args:
        model: read the model's config.json (``launcher check --no-model`` does not).
        devices: count the backend's devices (``launcher check`` runs off the server and does not).
        output: check the output root's space (a run leaves that to preflight's ``output`` row, which
            ``LAUNCHER_PREFLIGHT_SKIP`` can skip; an unusable folder still stops the run when it is made).
        elsewhere: the config is meant for another machine (``launcher check --for-another-machine``): a
            path it names that is not here is a check not made (``SKIPPED``), not an error; what is here is
            checked as usual.
    """
    out = Findings()
    for problem in problems or []:
        out.add(problem.split(":", 1)[0], ERROR, problem)
    launcher = config.launcher
    if devices:
        try:
            backend = backends.resolve(launcher.backend)
        except ValueError as err:
            out.add("launcher.backend", ERROR, f"launcher.backend: {err}")
            backend = backends.BACKENDS["cpu"]
        if backend.name != "cpu":
            found = backends.device_count(backend.name)
            if found < launcher.nproc_per_node:
                out.add("launcher.nproc_per_node", ERROR, (
                    f"launcher.nproc_per_node: {launcher.nproc_per_node} processes but {found} {backend.name} "
                    f"device(s) visible (check {backend.visible_devices_env}, or lower launcher.nproc_per_node)"
                ))  # fmt: skip
        name = backend.name
    else:
        name = launcher.backend if launcher.backend != "auto" else "cpu"
        out.add("devices", SKIPPED, f"devices: not counted here; `launcher preflight` checks the {launcher.backend} "
                f"backend's devices where the run will train")  # fmt: skip
    placeholder = Path(launcher.output_root).resolve() / "validate" / OUTPUT_SUBDIR
    args = llamafactory_args(config, name, placeholder)
    for key, problem in patch_problems(config.patches, args, backend=name):
        out.add(key, ERROR, problem)
    out.items.extend(check_llamafactory(args, model=model, devices=devices, elsewhere=elsewhere).items)
    if not output:
        return out
    root = Path(launcher.output_root)
    if elsewhere and not root.exists():  # this machine's disk says nothing of the run machine's
        out.not_here("launcher.output_root", f"{root} is not on this machine", "", elsewhere)
        return out
    _, status, detail = check_output(root, launcher.smoke)
    out.add("launcher.output_root", ERROR if status == "fail" else OK, f"launcher.output_root: {detail}")
    return out


def memory_finding(config: RunConfig, device_gib: float | None) -> Finding:
    """The memory forecast as a ``launcher check`` finding (``launcher.checks.memory``): an error when the run
    will not fit, a warning when it is tight or cannot be forecast."""
    from launcher.checks.memory import check_memory

    # `auto` names no device to read here (preflight resolves it on the server): the forecast without a verdict,
    # unless --device-memory gives one
    status, detail = check_memory(config, config.llamafactory, config.launcher.backend, device_gib)
    return Finding("memory", {"fail": ERROR, "warn": WARN}.get(status, OK), f"memory: {detail}")


def prepare(config: RunConfig) -> Prepared:
    """Validate everything about ``config`` that can be checked before a run exists.

    Raises:
        ConfigError: with every problem found (backend, devices, the LLaMA-Factory part, output root).
    """
    found = check_run_config(config, output=False)
    if found.errors:
        raise ConfigError(str(config.source), [f.message for f in found.errors])
    for note in [*config.notes, *(f.message for f in found.items if f.level == WARN)]:
        print(f"note: {note}", file=sys.stderr)
    return Prepared(config, backends.resolve(config.launcher.backend))


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
