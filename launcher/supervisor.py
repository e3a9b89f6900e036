"""The supervisor: one per run, owning the lock, the job's process tree and the run record.

``launcher run`` is the supervisor in the foreground (what a container's main process runs);
``launcher start`` detaches the same supervisor into its own session and returns once it has taken
the lock, validated the config and created the run directory. In order, the supervisor:

1. takes the run lock without waiting (a live run is named and refused), refuses while an earlier
   run's training processes are still alive, and marks runs of an earlier boot ``NODE_LOST``;
2. validates the config (launcher section, LLaMA-Factory's parser) — nothing is on disk yet;
3. creates the run directory, or reopens it for a resumed attempt, and records ``PENDING``;
4. starts the job in its own session and watches it: every process of the tree is recorded (pid,
   start time), the trainer log is followed (``FINISHING`` after the last optimizer step, ``STALLED``
   when it stops advancing), a heartbeat is kept;
5. on SIGTERM/SIGINT/SIGHUP (or ``launcher stop``), stops every process group of the job, waits the
   grace period, kills what is left;
6. records the end (exit code or signal, root cause, terminal state) durably, runs the acceptance
   checks when the job exited 0, and only then releases the lock.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import backend as backends
from .config import ConfigError, RunConfig, load_run_config, validate_llamafactory_args
from .follow import TrainerLogFollower
from .job import Job, NodeSpec, job_command, job_env
from .lock import LockBusy, RunLock
from .procs import boot_id, find_live, identity, self_identity, terminate, tree
from .records import TERMINAL, RunState, StatusRecord, append_event, now_iso, read_status, write_json_atomic
from .rootcause import describe_rank_failure, looks_like_oom, rank_failure, root_cause
from .rundir import RunDir, llamafactory_args, make_run_dir, write_run_files

STOP_REQUEST = "stop_request.json"
EXIT_REFUSED = 3  # another run is live, or its processes are


class SetupRefused(Exception):
    """The run cannot start; ``message`` says why and how to fix it; ``code`` is the exit code."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


@dataclass
class Prepared:
    config: RunConfig
    backend: backends.Backend


def _print_err(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)


def prepare(config_path: Path) -> Prepared:
    """Validate everything that can be checked before a run exists.

    Raises:
        SetupRefused: with every problem found.
    """
    try:
        config = load_run_config(config_path)
        backend = backends.resolve(config.launcher.backend)
    except (ConfigError, ValueError) as err:
        raise SetupRefused(str(err)) from None
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
        raise SetupRefused(str(ConfigError(str(config_path), problems)))
    for note in config.notes:
        print(f"note: {note}", file=sys.stderr)
    return Prepared(config, backend)


# --- checks made while holding the lock -------------------------------------------------------------


def _runs(root: Path) -> list[Path]:
    try:
        return sorted(p for p in root.iterdir() if p.is_dir() and (p / "status.json").exists())
    except OSError:
        return []


def check_earlier_runs(root: Path) -> list[str]:
    """Refuse while an earlier run's processes live; mark runs of an earlier boot NODE_LOST.

    Returns:
        Warnings to show (runs marked NODE_LOST).

    Raises:
        SetupRefused: an earlier run still has live training processes.
    """
    warnings = []
    current_boot = boot_id()
    for run_dir in _runs(root):
        try:
            status = read_status(run_dir)
        except ValueError:
            continue
        if RunState(status.get("state", "PENDING")) in TERMINAL:
            continue
        if status.get("boot_id") and current_boot and status["boot_id"] != current_boot:
            record = StatusRecord.reopen(run_dir, status)
            record.update(state=RunState.NODE_LOST, ended=now_iso(),
                          reason="the host rebooted while the run was live (boot id changed)")  # fmt: skip
            append_event(run_dir, "ended", state=RunState.NODE_LOST.value, reason="boot id changed")
            warnings.append(f"run {status.get('run_id')} was live when the host rebooted; marked NODE_LOST")
            continue
        alive = [p.pid for p in _live_job_processes(status, run_dir)]
        if alive:
            raise SetupRefused(
                f"run {status.get('run_id')} still has live training processes {alive} (its supervisor is "
                f"gone); stop them first: `launcher stop {status.get('run_id')}`",
                code=EXIT_REFUSED,
            )
    return warnings


def _live_job_processes(status: dict[str, Any], run_dir: Path) -> list:
    return [p for p in (find_live(r, str(run_dir)) for r in status.get("processes", [])) if p is not None]


# --- the supervisor ---------------------------------------------------------------------------------


@dataclass
class Supervisor:
    prepared: Prepared
    run_dir: RunDir
    status: StatusRecord
    lock: RunLock
    echo: bool = True
    poll_s: float = 1.0
    attempt: int = 1
    node_rank: int = 0
    _stop_signal: int | None = None
    # where this attempt's job began: its log output and error files only (a resumed run shares them)
    _job_since: float = 0.0
    _log_start: int = 0
    _known: dict[tuple[int, float], dict[str, Any]] = field(default_factory=dict)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self._stop_signal is None:
            self._stop_signal = signum

    def run(self) -> int:
        config = self.prepared.config
        node = NodeSpec.from_env(config.launcher.nnodes, config.launcher.node_rank,
                                 config.launcher.master_addr, config.launcher.master_port)  # fmt: skip
        cmd = job_command(config.launcher.distribution, config.launcher.nproc_per_node, self.run_dir.path,
                          node, entry=config.launcher.entry)  # fmt: skip
        self.node_rank = node.node_rank
        handled = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        previous = {s: signal.signal(s, self._on_signal) for s in handled}
        try:
            self._job_since = time.time()
            self._log_start = self.run_dir.log.stat().st_size if self.run_dir.log.exists() else 0
            job = Job(cmd, job_env(self.prepared.backend), self.run_dir.log, echo=self.echo)
            self._remember(job.pid)
            self.status.update(state=RunState.RUNNING, job_pid=job.pid, command=cmd, started=now_iso(),
                               node={"nnodes": node.nnodes, "node_rank": node.node_rank,
                                     "master_addr": node.master_addr},
                               processes=list(self._known.values()))  # fmt: skip
            append_event(self.run_dir.path, "started", pid=job.pid, command=cmd, attempt=self.attempt)
            code, stopped_by = self._watch(job)
            job.finish()
            return self._record_end(code, stopped_by)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _remember(self, root_pid: int) -> list:
        live = tree(root_pid)
        for proc in live:
            try:
                ident = identity(proc)
            except Exception:  # the process ended while we looked
                continue
            self._known.setdefault((ident["pid"], ident["create_time"]), ident)
        return live

    def _watch(self, job: Job) -> tuple[int, int | None]:
        follower = TrainerLogFollower(self.run_dir.trainer_log)
        stall_s = self.prepared.config.launcher.stall_minutes * 60
        last_progress = time.monotonic()
        last_beat = 0.0
        state = RunState.RUNNING
        stopped_by = None
        while (code := job.poll()) is None:
            if self._stop_signal is not None and stopped_by is None:
                stopped_by = self._stop_signal
                self._stop_job(job)
                continue
            before = len(self._known)
            self._remember(job.pid)
            changed = len(self._known) != before
            if follower.poll():
                last_progress = time.monotonic()
                changed = True
            new_state = state
            if follower.summary.get("training_done"):
                new_state = RunState.FINISHING
            elif time.monotonic() - last_progress > stall_s:
                new_state = RunState.STALLED
            elif state is RunState.STALLED:
                new_state = RunState.RUNNING
            if new_state is not state:
                append_event(self.run_dir.path, "state", state=new_state.value, previous=state.value)
                state, changed = new_state, True
            if changed or time.monotonic() - last_beat > 10:
                self.status.update(state=state, heartbeat=now_iso(), progress=follower.summary,
                                   processes=list(self._known.values()))  # fmt: skip
                last_beat = time.monotonic()
            time.sleep(self.poll_s)
        follower.poll()
        follower.close()
        self.status.data["progress"] = follower.summary
        return code, stopped_by

    def _stop_job(self, job: Job) -> None:
        grace = self.prepared.config.launcher.stop_grace_s
        request = _read_stop_request(self.run_dir.path)
        if request and request.get("grace_s") is not None:
            grace = float(request["grace_s"])
        append_event(self.run_dir.path, "stopping", signal=self._stop_signal, grace_s=grace,
                     requested_by=request.get("by") if request else None)  # fmt: skip
        procs = self._remember(job.pid)
        procs += [p for p in (find_live(r) for r in self._known.values()) if p is not None and p not in procs]
        killed = terminate(procs, grace_s=grace)
        # psutil reaped the job's root (our child) while waiting for it; Popen would then read ECHILD as exit 0
        root = next((p for p in procs if p.pid == job.pid), None)
        if getattr(root, "returncode", None) is not None:
            job.proc.returncode = int(root.returncode)
        if killed:
            append_event(self.run_dir.path, "killed_after_grace", pids=killed, grace_s=grace)

    def _record_end(self, code: int, stopped_by: int | None) -> int:
        # Ranks run in their own sessions: if torchrun died first they may linger. None may survive.
        leftovers = [p for p in (find_live(r) for r in self._known.values()) if p is not None]
        leftover_pids = [p.pid for p in leftovers]
        if leftovers:
            terminate(leftovers, grace_s=10)
        exit_code, sig = (None, -code) if code < 0 else (code, None)
        fields: dict[str, Any] = {"exit_code": exit_code, "signal": sig, "ended": now_iso(),
                                  "attempt": self.attempt, "leftover_pids_stopped": leftover_pids}  # fmt: skip
        if stopped_by is not None:
            request = _read_stop_request(self.run_dir.path)
            state = RunState.CANCELLED if request else RunState.TERMINATED
            fields["stop_signal"] = stopped_by
            fields["reason"] = (
                f"stopped by `launcher stop` ({request.get('by')})" if request
                else f"received {signal.Signals(stopped_by).name}; the job was stopped gracefully"
            )
        elif code == 0 and self.node_rank > 0:
            state = RunState.SUCCEEDED  # rank 0's node saves the adapter and runs the acceptance checks
            fields["acceptance"] = {"checked": False, "reason": f"node {self.node_rank}: acceptance runs on node 0"}
        elif code == 0:
            state, fields["acceptance"] = self._accept()
        else:
            cause = root_cause(self.run_dir, since=self._job_since, log_start=self._log_start)
            what = f"killed by signal {sig} ({signal.Signals(sig).name})" if sig else f"exit code {exit_code}"
            # torchrun/accelerate exit 1 whatever a rank died of; the rank's own code or signal is in the
            # failure summary they print (torch.distributed.elastic ChildFailedError).
            failed = rank_failure(self.run_dir.log, start=self._log_start) if sig is None else None
            if failed:
                fields["failed_rank"] = failed
                what += f"; first failure: {describe_rank_failure(failed)}"
            if leftover_pids:
                what += f"; {len(leftover_pids)} leftover process(es) {leftover_pids} were stopped"
            state = RunState.OUT_OF_MEMORY if looks_like_oom(cause) else RunState.FAILED
            fields["reason"] = f"{what}\n{cause}" if cause else what
        self.status.update(state=state, **fields, processes=[])
        append_event(self.run_dir.path, "ended", state=state.value,
                     **{k: v for k, v in fields.items() if k != "acceptance"})  # fmt: skip
        print(f"run {self.run_dir.run_id} ended {state.value} "
              f"({'exit code ' + str(exit_code) if sig is None else 'signal ' + str(sig)})\n"
              f"  adapter:     {self.run_dir.output}\n  trainer log: {self.run_dir.trainer_log}",
              flush=True)  # fmt: skip
        if stopped_by is not None:  # stopped from outside: never exit 0 whatever torchrun said (128+N, as a shell)
            return 128 + stopped_by
        return 128 + sig if sig is not None else int(exit_code)

    def _accept(self) -> tuple[RunState, dict[str, Any]]:
        """Run the acceptance checklist on a job that exited 0."""
        from .verify import verify_run

        try:
            report = verify_run(self.run_dir.path, exit_code=0)  # the record is not written yet
        except OSError as err:  # e.g. verify.json could not be written: the checklist did not complete
            return RunState.FAILED_ACCEPTANCE, {"checked": False, "error": str(err)}
        summary = {"checked": True, "passed": report.passed, "failed": [c.name for c in report.failed]}
        return (RunState.SUCCEEDED if report.passed else RunState.FAILED_ACCEPTANCE), summary


def _read_stop_request(run_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((run_dir / STOP_REQUEST).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


# --- entry points -----------------------------------------------------------------------------------


def _open_run(prepared: Prepared, lock: RunLock, resume: dict[str, Any] | None) -> tuple[RunDir, StatusRecord, int]:
    config, backend = prepared.config, prepared.backend
    if resume is None:
        run_dir = make_run_dir(config.launcher.output_root, config.run_name)
        status = StatusRecord(run_dir.path, run_dir.run_id)
        attempt = 1
        lf_args = llamafactory_args(config, backend, run_dir)
    else:
        run_dir = RunDir(resume["run_dir"].name, resume["run_dir"])
        status = StatusRecord.reopen(run_dir.path, read_status(run_dir.path))
        attempt = int(status.data.get("attempt", 1)) + 1
        lf_args = llamafactory_args(config, backend, run_dir)
        lf_args["resume_from_checkpoint"] = str(resume["checkpoint"])
        (run_dir.path / STOP_REQUEST).unlink(missing_ok=True)
    lock.describe(run_dir.run_id, run_dir.path)
    status.update(
        state=RunState.PENDING, smoke=config.launcher.smoke, backend=backend.name, attempt=attempt,
        supervisor=self_identity(), boot_id=boot_id(), trainer_log=str(run_dir.trainer_log),
        container=os.environ.get("LAUNCHER_CONTAINER"),
        run_dir=str(run_dir.path), exit_code=None, signal=None, reason=None, ended=None,
        resumed_from=str(resume["checkpoint"]) if resume else None,
        resume_mode=resume.get("mode") if resume else None,
    )  # fmt: skip
    append_event(run_dir.path, "created" if resume is None else "resumed", config=str(config.source),
                 attempt=attempt, checkpoint=str(resume["checkpoint"]) if resume else None)  # fmt: skip
    write_run_files(config, backend, run_dir, lf_args, attempt=attempt)
    return run_dir, status, attempt


def supervise(config_path: Path, *, echo: bool = True, handshake: Any = None,
              resume: dict[str, Any] | None = None) -> int:  # fmt: skip
    """Run one supervised run to its end. ``handshake`` (a writable file) gets one JSON line once
    the run directory exists, or once the run was refused; ``launcher start`` waits for it."""

    def _shake(**fields: Any) -> None:
        if handshake is not None:
            handshake.write(json.dumps(fields) + "\n")
            handshake.flush()
            handshake.close()

    lock: RunLock | None = None
    try:
        try:
            config = load_run_config(config_path)
        except ConfigError as err:
            raise SetupRefused(str(err)) from None
        lock = RunLock(config.launcher.output_root).acquire()
        warnings = check_earlier_runs(config.launcher.output_root)
        for warning in warnings:
            print(f"warning: {warning}", file=sys.stderr)
        prepared = prepare(config_path)
        run_dir, status, attempt = _open_run(prepared, lock, resume)
    except LockBusy as err:
        _print_err(str(err))
        _shake(ok=False, code=EXIT_REFUSED, error=str(err))
        return EXIT_REFUSED
    except SetupRefused as err:
        if lock is not None:
            lock.release()
        _print_err(str(err))
        _shake(ok=False, code=err.code, error=str(err))
        return err.code
    try:
        _shake(ok=True, run_id=run_dir.run_id, run_dir=str(run_dir.path), trainer_log=str(run_dir.trainer_log),
               log=str(run_dir.log), pid=os.getpid(), warnings=warnings)  # fmt: skip
        if echo:
            print(f"run {run_dir.run_id}\n  run dir:     {run_dir.path}\n  trainer log: {run_dir.trainer_log}"
                  f"\n  job log:     {run_dir.log}", flush=True)  # fmt: skip
        # --- preflight (launcher/preflight.py): writes preflight.json; a failed row ends FAILED_SETUP ---
        from .preflight import preflight_run_dir

        if not preflight_run_dir(prepared, run_dir.path, status):
            return 2
        # --- end preflight ---
        return Supervisor(prepared, run_dir, status, lock, echo=echo, attempt=attempt).run()
    except BaseException as err:  # record any supervisor failure before giving up the lock
        if status.data.get("state") not in {s.value for s in TERMINAL}:
            status.update(state=RunState.FAILED_SETUP if status.data.get("state") == "PENDING" else RunState.FAILED,
                          ended=now_iso(), reason=f"supervisor error: {type(err).__name__}: {err}")  # fmt: skip
            append_event(run_dir.path, "ended", state=status.data["state"], reason=status.data["reason"])
        raise
    finally:
        lock.release()


def run_foreground(config_path: Path, echo: bool = True) -> int:
    """``launcher run``: returns the job's exit code (2 when refused before a run exists)."""
    return supervise(config_path, echo=echo)


def request_stop(run_dir: Path, grace_s: float | None, by: str) -> None:
    """Leave a stop request for the run's supervisor (read when it receives SIGTERM)."""
    write_json_atomic(run_dir / STOP_REQUEST, {"time": now_iso(), "grace_s": grace_s, "by": by})
