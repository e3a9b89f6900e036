"""The supervisor: one per run, owning the lock, the job's process tree and the run record.

``launcher run`` is the supervisor in the foreground (what a container's main process runs);
``launcher start`` detaches the same supervisor into its own session and returns once it has taken
the lock, validated the config and created the run directory. In order, the supervisor:

1. takes the run lock without waiting (a live run is named and refused), refuses while an earlier
   run's training processes are still alive, and marks runs of an earlier boot ``NODE_LOST``;
2. validates the config (``setup.prepare``: devices, LLaMA-Factory's parser) — nothing is on disk yet;
3. creates the run directory, or reopens it for a resumed attempt, and records ``PENDING``;
4. starts the job in its own session and watches it: every process of the tree is recorded (pid,
   start time), the trainer log is followed (``FINISHING`` after the last optimizer step, ``STALLED``
   when it stops advancing), a heartbeat is kept;
5. on SIGTERM/SIGINT/SIGHUP (or ``launcher stop``), stops every process group of the job, waits the
   grace period, kills what is left;
6. records the end (exit code or signal, root cause, terminal state from ``states.end_state``) through
   the run's ``RunStore``, runs the acceptance checks when the job exited 0, and only then releases
   the lock.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.backend import child_env
from launcher.errors import ExitCode, LauncherError
from launcher.files import read_json_object, share_readable, write_json_atomic
from launcher.procs import boot_id, container_identity, find_live, identity, self_identity, terminate, tree
from launcher.run.config import RunConfig, llamafactory_args
from launcher.run.job import Job, NodeSpec, job_command
from launcher.run.lock import RunLock
from launcher.run.rootcause import describe_rank_failure, looks_like_oom, rank_failure, root_cause
from launcher.run.rundir import RunDir, make_run_dir, write_run_files
from launcher.run.setup import Prepared, check_earlier_runs, prepare
from launcher.state.reconcile import reconcile
from launcher.state.record import RunStore, now_iso
from launcher.state.states import RunState, end_state
from launcher.state.trainer_log import TrainerLogFollower

if TYPE_CHECKING:
    from launcher.run.resume import ResumePlan

STOP_REQUEST = "stop_request.json"


def request_stop(run_dir: Path, grace_s: float | None, by: str) -> None:
    """Leave a stop request for the run's supervisor (read when it receives SIGTERM)."""
    write_json_atomic(run_dir / STOP_REQUEST, {"time": now_iso(), "grace_s": grace_s, "by": by})


def _read_stop_request(run_dir: Path) -> dict[str, Any] | None:
    request = read_json_object(run_dir / STOP_REQUEST)
    return request if isinstance(request, dict) else None


@dataclass
class Supervisor:
    prepared: Prepared
    run_dir: RunDir
    store: RunStore
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
        launcher = self.prepared.config.launcher
        node = NodeSpec.from_env(launcher.nnodes, launcher.node_rank, launcher.master_addr, launcher.master_port)
        cmd = job_command(launcher.distribution, launcher.nproc_per_node, self.run_dir.path, node,
                          entry=launcher.entry)  # fmt: skip
        self.node_rank = node.node_rank
        handled = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        previous = {s: signal.signal(s, self._on_signal) for s in handled}
        try:
            self._job_since = time.time()
            self._log_start = self.run_dir.log.stat().st_size if self.run_dir.log.exists() else 0
            job = Job(cmd, child_env(self.prepared.backend), self.run_dir.log, echo=self.echo)
            self._remember(job.pid)
            self.store.transition(RunState.RUNNING, event=None, job_pid=job.pid, command=cmd, started=now_iso(),
                                  node={"nnodes": node.nnodes, "node_rank": node.node_rank,
                                        "master_addr": node.master_addr},
                                  processes=list(self._known.values()))  # fmt: skip
            self.store.event("started", pid=job.pid, command=cmd, attempt=self.attempt)
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
            state = self.store.state
            new_state = state
            if follower.summary.get("training_done"):
                new_state = RunState.FINISHING
            elif time.monotonic() - last_progress > stall_s:
                new_state = RunState.STALLED
            elif state is RunState.STALLED:
                new_state = RunState.RUNNING
            if changed or new_state is not state or time.monotonic() - last_beat > 10:
                share_readable(self.run_dir.output)  # checkpoints a host user can read (see files.share_readable)
                self.store.transition(new_state, heartbeat=now_iso(), progress=dict(follower.summary),
                                      processes=list(self._known.values()))  # fmt: skip
                last_beat = time.monotonic()
            time.sleep(self.poll_s)
        follower.poll()
        follower.close()
        share_readable(self.run_dir.output)
        self.store.record.progress = dict(follower.summary)
        return code, stopped_by

    def _stop_job(self, job: Job) -> None:
        grace = self.prepared.config.launcher.stop_grace_s
        request = _read_stop_request(self.run_dir.path)
        if request and request.get("grace_s") is not None:
            grace = float(request["grace_s"])
        self.store.event("stopping", signal=self._stop_signal, grace_s=grace,
                         requested_by=request.get("by") if request else None)  # fmt: skip
        procs = self._remember(job.pid)
        procs += [p for p in (find_live(r) for r in self._known.values()) if p is not None and p not in procs]
        killed = terminate(procs, grace_s=grace)
        # psutil reaped the job's root (our child) while waiting for it; Popen would then read ECHILD as exit 0
        root = next((p for p in procs if p.pid == job.pid), None)
        if getattr(root, "returncode", None) is not None:
            job.proc.returncode = int(root.returncode)
        if killed:
            self.store.event("killed_after_grace", pids=killed, grace_s=grace)

    def _record_end(self, code: int, stopped_by: int | None) -> int:
        # Ranks run in their own sessions: if torchrun died first they may linger. None may survive.
        leftovers = [p for p in (find_live(r) for r in self._known.values()) if p is not None]
        leftover_pids = [p.pid for p in leftovers]
        if leftovers:
            terminate(leftovers, grace_s=10)
        exit_code, sig = (None, -code) if code < 0 else (code, None)
        fields: dict[str, Any] = {"exit_code": exit_code, "signal": sig, "attempt": self.attempt,
                                  "leftover_pids_stopped": leftover_pids}  # fmt: skip
        request = _read_stop_request(self.run_dir.path) if stopped_by is not None else None
        accepted: bool | None = None
        cause = None
        if stopped_by is not None:
            fields["stop_signal"] = stopped_by
            fields["reason"] = (
                f"stopped by `launcher stop` ({request.get('by')})"
                if request
                else f"received {signal.Signals(stopped_by).name}; the job was stopped gracefully"
            )
        elif code == 0 and self.node_rank > 0:  # node 0 saves the adapter and runs the acceptance checks
            fields["acceptance"] = {"checked": False, "reason": f"node {self.node_rank}: acceptance runs on node 0"}
        elif code == 0:
            accepted, fields["acceptance"] = self._accept()
            if not accepted:  # one cause and one fix, for `launcher status`
                fields["reason"] = fields["acceptance"].get("advice") or "the acceptance checklist failed"
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
            fields["reason"] = f"{what}\n{cause}" if cause else what
        stop = None if stopped_by is None else ("user" if request else "external")
        state = end_state(exit_code=exit_code, signal=sig, stop=stop, accepted=accepted,
                          out_of_memory=looks_like_oom(cause))  # fmt: skip
        self.store.record_end(state, **fields, processes=[])
        print(f"run {self.run_dir.run_id} ended {state.value} "
              f"({'exit code ' + str(exit_code) if sig is None else 'signal ' + str(sig)})\n"
              f"  adapter:     {self.run_dir.output}\n  trainer log: {self.run_dir.trainer_log}",
              flush=True)  # fmt: skip
        if stopped_by is not None:  # stopped from outside: never exit 0 whatever torchrun said (128+N, as a shell)
            return 128 + stopped_by
        return 128 + sig if sig is not None else int(exit_code)

    def _accept(self) -> tuple[bool, dict[str, Any]]:
        """Run the acceptance checklist on a job that exited 0."""
        from launcher.results.verify import advice, verify_run

        try:
            report = verify_run(self.run_dir.path, exit_code=0)  # the record is not written yet
        except OSError as err:  # e.g. verify.json could not be written: the checklist did not complete
            return False, {"checked": False, "error": str(err)}
        failed = [c.name for c in report.failed]
        return report.passed, {"checked": True, "passed": report.passed, "failed": failed, "advice": advice(report)}


# --- entry points -----------------------------------------------------------------------------------


def _open_run(prepared: Prepared, lock: RunLock, resume: ResumePlan | None) -> tuple[RunDir, RunStore, int]:
    config, backend = prepared.config, prepared.backend
    if resume is None:
        run_dir = make_run_dir(config.launcher.output_root, config.run_name)
        store = RunStore.create(run_dir.path, run_dir.run_id)
        lf_args = llamafactory_args(config, backend.name, run_dir.output)
    else:
        run_dir = RunDir(resume.run_dir.name, resume.run_dir)
        store = RunStore.open(run_dir.path)
        if not store.record.terminal:  # e.g. RUNNING with its supervisor gone: record what it really is first
            seen = reconcile(store.record, run_dir.path)
            store.record_end(seen.state, reason=seen.note, processes=[])
        lf_args = llamafactory_args(config, backend.name, run_dir.output)
        lf_args["resume_from_checkpoint"] = str(resume.checkpoint)
        (run_dir.path / STOP_REQUEST).unlink(missing_ok=True)
    attempt = store.record.attempt + 1 if resume is not None else 1
    lock.describe(run_dir.run_id, run_dir.path)
    store.transition(
        RunState.PENDING, event=None, smoke=config.launcher.smoke, backend=backend.name, attempt=attempt,
        supervisor=self_identity(), boot_id=boot_id(), container=container_identity(), run_dir=str(run_dir.path),
        exit_code=None, signal=None, stop_signal=None, reason=None, ended=None, failed_rank=None,
        acceptance=None, leftover_pids_stopped=[],
        resumed_from=str(resume.checkpoint.relative_to(run_dir.path)) if resume else None,
        resume_mode=resume.mode if resume else None,
    )  # fmt: skip
    store.event("created" if resume is None else "resumed", config=str(config.source), attempt=attempt,
                checkpoint=str(resume.checkpoint) if resume else None)  # fmt: skip
    write_run_files(config, backend, run_dir, lf_args, attempt=attempt)
    return run_dir, store, attempt


def _preflight(prepared: Prepared, run_dir: Path, store: RunStore) -> bool:
    """Run preflight in the new run directory: the table, ``preflight.json`` (and ``data_stats.json``), a
    ``preflight`` event; a failed row ends the run FAILED_SETUP and returns False."""
    from launcher.checks.preflight import PREFLIGHT_FILE, run_preflight
    from launcher.data.statsview import write_json

    report = run_preflight(prepared)
    report.render()
    report.write(run_dir)
    if report.data_stats is not None:
        write_json(report.data_stats, run_dir)
    store.event("preflight", ok=report.ok, failed=report.failed)
    if report.ok:
        return True
    reason = f"preflight failed: {', '.join(report.failed)} (table in {run_dir / PREFLIGHT_FILE})"
    store.record_end(RunState.FAILED_SETUP, reason=reason)
    print(f"error: {reason}", file=sys.stderr, flush=True)
    return False


@dataclass
class Handshake:
    """The one line a detached supervisor sends ``launcher start``: the run exists, or why it was refused."""

    stream: Any = None  # a writable file, or None in the foreground

    def send(self, **fields: Any) -> None:
        if self.stream is not None:
            self.stream.write(json.dumps(fields) + "\n")
            self.stream.flush()
            self.stream.close()
            self.stream = None

    def refuse(self, err: LauncherError) -> None:
        self.send(ok=False, code=err.exit_code, error=str(err))


def supervise(config: RunConfig, *, echo: bool = True, handshake: Handshake | None = None,
              resume: ResumePlan | None = None) -> int:  # fmt: skip
    """Run one supervised run to its end and return its exit code.

    ``handshake`` gets its line once the run directory exists, or once the run was refused; ``launcher
    start`` waits for it.

    Raises:
        LauncherError: the run was refused before it existed (lock busy, live processes, bad config).
    """
    handshake = handshake or Handshake()
    lock = RunLock(config.launcher.output_root)
    try:
        lock.acquire()
        warnings = check_earlier_runs(config.launcher.output_root)
        for warning in warnings:
            print(f"warning: {warning}", file=sys.stderr)
        prepared = prepare(config)
        run_dir, store, attempt = _open_run(prepared, lock, resume)
    except LauncherError as err:
        lock.release()
        handshake.refuse(err)
        raise
    try:
        handshake.send(ok=True, run_id=run_dir.run_id, run_dir=str(run_dir.path), trainer_log=str(run_dir.trainer_log),
               log=str(run_dir.log), pid=os.getpid(), warnings=warnings)  # fmt: skip
        if echo:
            print(f"run {run_dir.run_id}\n  run dir:     {run_dir.path}\n  trainer log: {run_dir.trainer_log}"
                  f"\n  job log:     {run_dir.log}", flush=True)  # fmt: skip
        if not _preflight(prepared, run_dir.path, store):
            return ExitCode.USAGE
        return Supervisor(prepared, run_dir, store, echo=echo, attempt=attempt).run()
    except BaseException as err:  # record any supervisor failure before giving up the lock
        if not store.record.terminal:
            state = RunState.FAILED_SETUP if store.state is RunState.PENDING else RunState.FAILED
            store.record_end(state, reason=f"supervisor error: {type(err).__name__}: {err}")
        raise
    finally:
        lock.release()
