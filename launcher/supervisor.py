"""The supervisor: validate, create the run directory, run the job, record how it ended.

``launcher run`` is this supervisor in the foreground (what a container's main process runs).
Nothing is created on disk until the whole config has been validated, so a refused config leaves no
half-made run directory; after that, every end, refused or not, is recorded in ``status.json`` and
``events.jsonl``.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import backend as backends
from .config import ConfigError, RunConfig, load_run_config, validate_llamafactory_args
from .entry import ERRORS_DIR
from .job import job_command, job_env, run_job
from .records import RunState, StatusRecord, append_event
from .rundir import RunDir, llamafactory_args, make_run_dir, write_run_files


@dataclass
class Prepared:
    config: RunConfig
    backend: backends.Backend


def _print_err(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)


def prepare(config_path: Path) -> Prepared | None:
    """Validate everything that can be checked before a run exists; print problems, return None."""
    try:
        config = load_run_config(config_path)
    except ConfigError as err:
        _print_err(str(err))
        return None
    try:
        backend = backends.resolve(config.launcher.backend)
    except ValueError as err:
        _print_err(str(err))
        return None
    problems = []
    if backend.name != "cpu":
        found = backends.device_count(backend.name)
        if found < config.launcher.nproc_per_node:
            problems.append(
                f"launcher.nproc_per_node: {config.launcher.nproc_per_node} processes but {found} "
                f"{backend.name} device(s) visible (check {backend.visible_devices_env}, or lower "
                "launcher.nproc_per_node)"
            )
    placeholder = RunDir("validate", Path(config.launcher.output_root).resolve() / "validate")
    problems.extend(validate_llamafactory_args(llamafactory_args(config, backend, placeholder)))
    if problems:
        _print_err(str(ConfigError(str(config_path), problems)))
        return None
    for note in config.notes:
        print(f"note: {note}", file=sys.stderr)
    return Prepared(config, backend)


_TRACEBACK = re.compile(rb"Traceback \(most recent call last\):")


def root_cause(run_dir: RunDir, max_lines: int = 30) -> str | None:
    """Why the job failed: the first failing rank's error file, else the log's last traceback."""
    records = []
    for path in (run_dir.path / ERRORS_DIR).glob("rank*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    if records:
        first = min(records, key=lambda r: r.get("time", 0))
        lines = str(first.get("traceback", "")).rstrip().splitlines()
        return f"rank {first.get('rank')}: " + "\n".join(lines[-max_lines:])
    return last_traceback(run_dir.log, max_lines=max_lines)


def last_traceback(log_path: Path, max_bytes: int = 256 << 10, max_lines: int = 30) -> str | None:
    """The last Python traceback in the job log (its final ``max_lines`` lines), if any."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - max_bytes))
            tail = f.read()
    except OSError:
        return None
    starts = [m.start() for m in _TRACEBACK.finditer(tail)]
    if not starts:
        return None
    lines = tail[starts[-1]:].decode(errors="replace").splitlines()
    # keep the traceback itself, up to the first line that is not indented after the header
    block = [lines[0]]
    for line in lines[1:]:
        block.append(line)
        if line and not line.startswith((" ", "\t")):
            break
    return "\n".join(block[-max_lines:])


def _end_state(exit_code: int | None, sig: int | None, stop_signal: int | None) -> RunState:
    if stop_signal is not None:
        return RunState.TERMINATED
    if exit_code == 0:
        return RunState.SUCCEEDED
    return RunState.FAILED


def run_foreground(config_path: Path, echo: bool = True) -> int:
    """``launcher run``: returns the job's exit code (2 when refused before a run exists)."""
    prepared = prepare(config_path)
    if prepared is None:
        return 2
    config, backend = prepared.config, prepared.backend
    run_dir = make_run_dir(config.launcher.output_root, config.run_name)
    status = StatusRecord(run_dir.path, run_dir.run_id)
    status.update(
        state=RunState.PENDING,
        smoke=config.launcher.smoke,
        backend=backend.name,
        supervisor_pid=os.getpid(),
        trainer_log=str(run_dir.trainer_log),
    )
    append_event(run_dir.path, "created", config=str(config_path))
    try:
        lf_args = llamafactory_args(config, backend, run_dir)
        write_run_files(config, backend, run_dir, lf_args)
        cmd = job_command(config, run_dir)
    except Exception as err:  # anything here is a setup failure; record it before giving up
        _finish(status, run_dir, RunState.FAILED_SETUP, reason=f"{type(err).__name__}: {err}")
        _print_err(f"setup failed: {err} (recorded in {run_dir.path})")
        return 2

    print(f"run {run_dir.run_id}\n  run dir:     {run_dir.path}\n  trainer log: {run_dir.trainer_log}"
          f"\n  job log:     {run_dir.log}", flush=True)  # fmt: skip

    def _started(pid: int) -> None:
        status.update(state=RunState.RUNNING, job_pid=pid, command=cmd, started=_now())
        append_event(run_dir.path, "started", pid=pid, command=cmd)

    result = run_job(cmd, job_env(backend), run_dir.log, echo=echo, on_start=_started)
    state = _end_state(result.exit_code, result.signal, result.stop_signal)
    reason = None
    if state is not RunState.SUCCEEDED:
        reason = root_cause(run_dir) or (
            f"killed by signal {result.signal}" if result.signal else f"exit code {result.exit_code}"
        )
    _finish(status, run_dir, state, exit_code=result.exit_code, signal=result.signal,
            stop_signal=result.stop_signal, reason=reason)  # fmt: skip
    print(f"run {run_dir.run_id} ended {state.value} (exit code {result.shell_code})\n"
          f"  adapter:     {run_dir.output}\n  trainer log: {run_dir.trainer_log}", flush=True)  # fmt: skip
    return result.shell_code


def _now() -> str:
    from .records import now_iso

    return now_iso()


def _finish(status: StatusRecord, run_dir: RunDir, state: RunState, **fields: Any) -> None:
    status.update(state=state, ended=_now(), **fields)
    append_event(run_dir.path, "ended", state=state.value, **fields)
