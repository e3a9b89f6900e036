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
5. on SIGTERM/SIGINT/SIGHUP (or ``launcher stop``), asks the job to save a checkpoint at its next step
   and exit when it can (the stop protocol, state/stop.py), else stops every process group of the job,
   waits the grace period, kills what is left (during preflight, the checks are left at once and the run
   ends without a job); the signal is taken with its sender (run/signals.py), which the record names
   (``stopped_by``, ``stop_sender``);
6. records the end (exit code or signal, root cause, terminal state from ``states.end_state``) through
   the run's ``RunStore``, runs the acceptance checks when the job exited 0, and only then releases
   the lock.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from launcher.config.backend import child_env
from launcher.config.run_config import RunConfig
from launcher.config.tuning import tuning_env
from launcher.errors import ExitCode, LauncherError
from launcher.files import share_readable, shown
from launcher.rank.oomtrack import looks_like_oom
from launcher.run.job import Job, NodeSpec, job_command
from launcher.run.lock import RunLock
from launcher.run.placement import placement_of, reconcile
from launcher.run.restart import not_retried_why, retry_cause
from launcher.run.resume import ResumePlan
from launcher.run.rootcause import (
    describe_rank_failure,
    disk_state,
    out_of_memory,
    rank_failure,
    root_cause,
)
from launcher.run.rundir import RunDir, make_run_dir, write_run_files
from launcher.run.setup import Prepared, check_earlier_runs, lease_devices, prepare
from launcher.run.signals import Received, StopRequested, StopSignals, end_hold_guard
from launcher.state.checkpoints import last_complete_checkpoint
from launcher.state.lease import DeviceLease
from launcher.state.procs import boot_id, container_identity, find_live, identity, self_identity, terminate, tree
from launcher.state.record import RunStore, now_iso, parse_time
from launcher.state.runs import TRAINER_LOG
from launcher.state.states import RunState, end_state, run_exit_code
from launcher.state.stop import (
    SAVE_KILL_GRACE_S,
    SaveDone,
    StopRequest,
    ask_to_save,
    clear_save_files,
    clear_stop_request,
    job_can_save,
    read_saved,
    read_stop_request,
    saved_checkpoint,
    skips_save,
    stop_grace,
)
from launcher.state.trainer_log import TrainerLogFollower

MAX_SKIP_NOTES = 20  # trainer-log lines skipped with a warning each; more are counted


def _say(text: str, err: bool = False) -> None:
    """Print for the person watching; a closed terminal or pipe (EIO, EPIPE) never ends the supervisor.
    A stream that failed is pointed at /dev/null, so that the interpreter's last flush cannot fail again."""
    stream = sys.stderr if err else sys.stdout
    try:
        print(text, file=stream, flush=True)
    except (OSError, ValueError):
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stream.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass


def _sender(received: Received, request: StopRequest | None) -> str:
    """Who sent the stop signal: ``launcher stop`` names itself in its request; else what the kernel said
    about the signal's sender (run/signals.py)."""
    if request:
        return request.by or "launcher stop"
    return received.describe()


@dataclass
class Ending:
    """How one attempt's job ended, before anything is recorded."""

    code: int
    stopped_by: int | None  # the stop signal the supervisor received
    why: str | None = None  # the supervisor stopped the job itself: "stall" or "record"
    saved: SaveDone | None = None  # what the job recorded saving on the stop (stop_saved.json)


@dataclass
class Supervisor:
    prepared: Prepared
    run_dir: RunDir
    store: RunStore
    echo: bool = True
    poll_s: float = 1.0
    attempt: int = 1
    node_rank: int = 0
    watch_stop_request: bool = False  # a Slurm run: the stop request file alone stops the run (run/slurm_node.py)
    _signals: StopSignals = field(default_factory=StopSignals)
    # where this attempt's job began: its log output and error files only (a resumed run shares them)
    _job_since: float = 0.0
    _log_start: int = 0
    _known: dict[tuple[int, float], dict[str, Any]] = field(default_factory=dict)
    _restarts: int = 0
    _last_step: int | None = None
    _skipped_lines: int = 0
    _moved: str | None = None  # what became of the run folder, when it was moved or deleted mid-run

    @property
    def _stop_signal(self) -> int | None:
        """The first stop signal received (SIGTERM, SIGINT, SIGHUP), or None."""
        return self._signals.first.signum if self._signals.first else None

    @property
    def _launcher(self):
        return self.prepared.config.launcher

    def run(self) -> int:
        """Preflight, then the job's attempts, to the recorded end; a stop signal at any point ends the run with
        its end recorded (during preflight too: the checks are left at once, see run/signals.py)."""
        with self._signals:  # stop signals are taken with their sender (run/signals.py)
            try:
                with self._signals.interrupting():
                    if not _preflight(self.prepared, self.run_dir.path, self.store):
                        return ExitCode.USAGE
            except StopRequested:
                if self.store.record.terminal:  # preflight had already recorded its failure: that is the end
                    return ExitCode.USAGE
                return self._record_stop_while_pending("during preflight")
            while True:
                ending = self._run_attempt()
                state, fields, cause = self._conclude(ending)
                if self._lost_node(state, fields):  # the whole job is gone with the node: no restart here
                    state, cause = RunState.NODE_LOST, None
                policy = self._launcher.restart
                if cause and policy is not None and self._restarts < policy.max_restarts:
                    if self._restart(state, fields, cause, policy.backoff_s):
                        continue
                    return self._record_stop_while_pending("while waiting to restart")
                if cause and policy is not None:
                    fields["reason"] += (
                        f"\nnot restarted: {self._restarts} restart(s) done, "
                        f"launcher.restart.max_restarts is {policy.max_restarts}"
                    )
                elif policy is not None and state is not RunState.SUCCEEDED:
                    stopped = ending.stopped_by is not None
                    self.store.event(
                        "not_restarted", attempt=self.attempt, state=state.value, why=not_retried_why(state, stopped)
                    )
                return self._record_end(state, fields)

    def _run_attempt(self) -> Ending:
        launcher = self._launcher
        node = NodeSpec.from_env(launcher.nnodes, launcher.node_rank, launcher.master_addr, launcher.master_port)
        cmd = job_command(launcher.distribution, launcher.nproc_per_node, self.run_dir.path, node, entry=launcher.entry)
        self.node_rank = node.node_rank
        clear_save_files(self.run_dir.path)  # left by an earlier attempt
        self._known = {}
        self._job_since = time.time()
        self._log_start = self.run_dir.log.stat().st_size if self.run_dir.log.exists() else 0
        env = child_env(self.prepared.backend)
        env.update(tuning_env(launcher.tuning, self.prepared.backend.name, launcher.output_root, os.environ)[0])
        job = Job(cmd, env, self.run_dir.log, echo=self.echo, spawning=self._signals.unblocked())
        self._remember(job.pid)
        self.store.transition(
            RunState.RUNNING,
            event=None,
            job_pid=job.pid,
            command=cmd,
            started=now_iso(),
            stop_grace_s=launcher.stop_grace_s,
            node={"nnodes": node.nnodes, "node_rank": node.node_rank, "master_addr": node.master_addr},
            processes=list(self._known.values()),
        )
        self.store.event("started", pid=job.pid, command=cmd, attempt=self.attempt)
        ending = self._watch(job)
        job.finish()
        return ending

    def _remember(self, root_pid: int) -> list:
        live = tree(root_pid)
        for proc in live:
            try:
                ident = identity(proc)
            except Exception:  # the process ended while we looked
                continue
            self._known.setdefault((ident["pid"], ident["create_time"]), ident)
        return live

    def _watch(self, job: Job) -> Ending:
        launcher = self._launcher
        follower = TrainerLogFollower(self.run_dir.trainer_log)
        follower.poll()  # what earlier attempts logged: this attempt's pace (ETA) starts at its own first step
        for key in ("first_step", "training_done"):
            follower.summary.pop(key, None)
        stall_s = launcher.stall_minutes * 60
        last_progress = time.monotonic()
        last_beat = 0.0
        stopped_by, why = None, None
        save_deadline: float | None = None
        asked_self = False
        home = FolderWatch(self.run_dir.path)
        while (code := job.poll()) is None:
            if why is None and stopped_by is None and (moved := home.moved()) is not None:
                why, self._moved = "moved", moved
                self._follow_folder(home)
                self._kill_job(job, launcher.stop_grace_s)  # its output folder is gone: a save has nowhere to go
                continue
            if (
                self.watch_stop_request
                and not asked_self
                and self._stop_signal is None
                and read_stop_request(self.run_dir.path) is not None
            ):
                asked_self = True  # taken as a SIGTERM with the request's sender, as `launcher stop` sends it
                os.kill(os.getpid(), signal.SIGTERM)
                self._signals.wait(0.1)
            if stopped_by is None and self._stop_signal is not None:
                stopped_by = self._stop_signal
                save_deadline = self._begin_stop(job, f"received {signal.Signals(stopped_by).name}")
            elif stopped_by is None and why is None and self._record_failing_too_long():
                why = "record"
                save_deadline = self._begin_stop(job, "the run record cannot be written", save=False)
            if save_deadline is not None and time.monotonic() > save_deadline:
                save_deadline = None
                self.store.event("save_timeout", attempt=self.attempt)
                self._kill_job(job, SAVE_KILL_GRACE_S)
            before = len(self._known)
            self._remember(job.pid)
            changed = len(self._known) != before
            if follower.poll():
                last_progress = time.monotonic()
                changed = True
            self._note_skipped(follower)
            state = self.store.state
            new_state = state
            if follower.summary.get("training_done"):
                new_state = RunState.FINISHING
            # the watchdog counts from this attempt's first logged step: loading a 27B model (and its
            # restarts) takes minutes and is no hang
            elif follower.summary.get("first_step") is not None and time.monotonic() - last_progress > stall_s:
                new_state = RunState.STALLED
            elif state is RunState.STALLED:
                new_state = RunState.RUNNING
            if (
                new_state is RunState.STALLED
                and state is not RunState.STALLED
                and launcher.stall_action != "warn"
                and stopped_by is None
                and why is None
            ):
                why = "stall"
                self.store.event(
                    "stall_action",
                    action=launcher.stall_action,
                    minutes=launcher.stall_minutes,
                    step=follower.summary.get("step"),
                )
                save_deadline = self._begin_stop(job, f"no progress for {launcher.stall_minutes:g} min")
            if changed or new_state is not state or time.monotonic() - last_beat > 10:
                share_readable(self.run_dir.output)  # checkpoints a host user can read (see files.share_readable)
                self.store.transition(
                    new_state,
                    heartbeat=now_iso(),
                    progress=dict(follower.summary),
                    processes=list(self._known.values()),
                )
                last_beat = time.monotonic()
            self._signals.wait(self.poll_s)
        if why is None and (moved := home.moved()) is not None:  # moved as the job ended
            why, self._moved = "moved", moved
            self._follow_folder(home)
        home.close()
        follower.poll()
        self._note_skipped(follower)
        follower.close()
        share_readable(self.run_dir.output)
        self.store.record.progress = dict(follower.summary)
        self._last_step = follower.summary.get("step")
        return Ending(code, stopped_by, why, read_saved(self.run_dir.path))

    def _follow_folder(self, home: FolderWatch) -> None:
        """The run folder was moved or deleted: the record follows it to where it went (the kernel knows the moved
        folder's path), or is written where the run began (made again) when the folder is gone."""
        where = home.now_at() or self.run_dir.path
        where.mkdir(parents=True, exist_ok=True)
        self.run_dir = RunDir(self.run_dir.run_id, where)
        self.store.run_dir = where
        self.store.record.run_dir = str(where)
        _say(f"error: {self._moved}; stopping the job", err=True)
        self.store.event("run_folder_moved", what=self._moved, now=str(where))

    def _note_skipped(self, follower: TrainerLogFollower) -> None:
        """One warning (and one event) for each trainer-log line the supervisor could not use; the run goes on.
        Past ``MAX_SKIP_NOTES`` lines of a run they are counted, not each noted."""
        for why in follower.take_skipped():
            self._skipped_lines += 1
            if self._skipped_lines > MAX_SKIP_NOTES:
                continue
            _say(
                f"warning: {self.run_dir.trainer_log} {why}; line skipped, the run goes on"
                + (" (further skipped lines are counted, not shown)" if self._skipped_lines == MAX_SKIP_NOTES else ""),
                err=True,
            )
            self.store.event("trainer_log_line_skipped", file=TRAINER_LOG, why=why)
        if self._skipped_lines > MAX_SKIP_NOTES and self.store.record.progress is not None:
            self.store.record.progress["lines_skipped"] = self._skipped_lines

    def _record_failing_too_long(self) -> bool:
        failing = self.store.failing
        if failing is None:
            return False
        try:
            since = parse_time(failing["since"])
        except (KeyError, ValueError):
            return False
        return (datetime.now(UTC) - since).total_seconds() > self._launcher.record_write_stop_s

    def _begin_stop(self, job: Job, what: str, save: bool = True) -> float | None:
        """Stop the job: ask it to save a checkpoint and exit (when it can), else SIGTERM and SIGKILL.
        Returns the time by which a save must have ended the job, or None when it was stopped at once."""
        request = read_stop_request(self.run_dir.path) if self._stop_signal is not None else None
        grace = stop_grace(request.grace_s if request else None, self._launcher.stop_grace_s)
        save = save and not skips_save(request) and self._job_can_save(job)
        if save:
            try:
                ask_to_save(self.run_dir.path, what)
            except OSError as err:
                _say(f"warning: cannot ask the job to save ({err}); stopping it without a save", err=True)
                save = False
        self.store.event(
            "stopping",
            signal=self._stop_signal,
            grace_s=grace,
            why=what,
            save=save,
            requested_by=request.by if request else None,
        )
        if save:
            _say(f"stopping: the job saves a checkpoint at the next step and exits (up to {grace:g} s)", err=True)
            return time.monotonic() + grace
        self._kill_job(job, grace)
        return None

    def _live(self, job: Job) -> list:
        """The job's processes alive now: its tree, and any recorded one that has left it."""
        procs = self._remember(job.pid)
        return procs + [p for p in (find_live(r) for r in self._known.values()) if p is not None and p not in procs]

    def _job_can_save(self, job: Job) -> bool:
        """The one rule (``state/stop.py``), held against this attempt's live processes."""
        return job_can_save(self.run_dir.path, self.store.state, (p.pid for p in self._live(job)))

    def _kill_job(self, job: Job, grace: float) -> None:
        procs = self._live(job)
        killed = terminate(procs, grace_s=grace)
        # psutil reaped the job's root (our child) while waiting for it; Popen would then read ECHILD as exit 0
        root = next((p for p in procs if p.pid == job.pid), None)
        if getattr(root, "returncode", None) is not None:
            job.proc.returncode = int(root.returncode)
        if killed:
            self.store.event("killed_after_grace", pids=killed, grace_s=grace)

    def _conclude(self, ending: Ending) -> tuple[RunState, dict[str, Any], str | None]:
        """The attempt's end state and record fields, and the retryable cause if there is one."""
        code, stopped_by = ending.code, ending.stopped_by
        # Ranks run in their own sessions: if torchrun died first they may linger. None may survive.
        leftovers = [p for p in (find_live(r) for r in self._known.values()) if p is not None]
        leftover_pids = [p.pid for p in leftovers]
        if leftovers:
            terminate(leftovers, grace_s=10)
        exit_code, sig = (None, -code) if code < 0 else (code, None)
        fields: dict[str, Any] = {
            "exit_code": exit_code,
            "signal": sig,
            "attempt": self.attempt,
            "leftover_pids_stopped": leftover_pids,
            "stopped_by": None,
            "stop_sender": None,
            "saved_checkpoint": None,
        }
        request = read_stop_request(self.run_dir.path) if stopped_by is not None else None
        accepted: bool | None = None
        cause = None
        saved = saved_checkpoint(self.run_dir.path, ending.saved)
        if saved:
            fields["saved_checkpoint"] = saved
        if stopped_by is not None:
            fields["stop_signal"] = stopped_by
            fields["stopped_by"] = _sender(self._signals.first or Received(stopped_by), request)
            fields["stop_sender"] = (self._signals.first or Received(stopped_by)).to_dict()
            fields["reason"] = (
                f"stopped by `launcher stop` ({request.by})"
                if request
                else f"received {signal.Signals(stopped_by).name} ({fields['stopped_by']}); the job was stopped"
            )
            fields["reason"] += (
                f"; checkpoint {saved['path']} saved at step {saved['step']}"
                if saved
                else "; no checkpoint saved on the stop"
            )
        elif code == 0 and self.node_rank > 0:  # node 0 saves the adapter and runs the acceptance checks
            fields["acceptance"] = {"checked": False, "reason": f"node {self.node_rank}: acceptance runs on node 0"}
        elif code == 0 and ending.why is None:
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
            if (disk := disk_state(self.run_dir.path)) is not None:
                what = f"{disk}; {what}"
            if ending.why == "stall":
                what = (
                    f"hang watchdog: no progress for {self._launcher.stall_minutes:g} min with live processes "
                    f"(stall_action: {self._launcher.stall_action}); the job was stopped: {what}"
                )
                what += f"; checkpoint {saved['path']} saved at step {saved['step']}" if saved else ""
            elif ending.why == "moved":
                what = f"{self._moved}; the job was stopped (no save: its output folder is gone): {what}"
            elif ending.why == "record":
                failing = self.store.failing or {}
                what = (
                    f"the run record could not be written for {self._launcher.record_write_stop_s:g} s "
                    f"({failing.get('error')}); the job was stopped (free space under {self.run_dir.path} "
                    f"and `launcher resume {self.run_dir.run_id}`): {what}"
                )
            if (oom := out_of_memory(self.run_dir, since=self._job_since)) is not None:
                fields["out_of_memory"] = oom  # the phase, step, layer and fix: `launcher status` shows them
            fields["reason"] = failure_reason(what, cause, failed)
        stop = None if stopped_by is None else ("user" if request else "external")
        state = end_state(
            exit_code=exit_code,
            signal=sig,
            stop=stop,
            accepted=accepted,
            out_of_memory=looks_like_oom(cause) or "out_of_memory" in fields,
        )
        if ending.why is not None and state is RunState.SUCCEEDED:  # stopped by the watchdog, yet exited 0
            state = RunState.FAILED
        retry = retry_cause(
            state,
            signal=sig,
            failed_rank=fields.get("failed_rank"),
            reason=fields.get("reason"),
            stopped=stopped_by is not None or ending.why in ("record", "moved"),
            stalled=ending.why == "stall" and self._launcher.stall_action == "restart",
        )
        fields["run_exit_code"] = run_exit_code(state, exit_code=exit_code, signal=sig, stop_signal=stopped_by)
        return state, fields, retry

    def _lost_node(self, state: RunState, fields: dict[str, Any]) -> bool:
        """A run whose job did not succeed and was not stopped by ``launcher stop``, on its first node: when its
        placement says the run lost a node (Slurm: ``NODE_FAIL``, a node down or not responding; asked for up to
        ``NODE_LOST_WAIT_S``), the end is ``NODE_LOST`` with the node named, what node 0 saw kept after it."""
        if state in (RunState.SUCCEEDED, RunState.CANCELLED, RunState.FAILED_ACCEPTANCE):
            return False
        placement = placement_of(self.store.record)
        said = placement.lost_node(self.node_rank)
        if said is None:
            return False
        fields["reason"] = f"a node of the run was lost: {said}; node 0 saw: {state.value}, {fields.get('reason')}"
        fields["run_exit_code"] = run_exit_code(RunState.NODE_LOST)
        self.store.event("node_lost", where=placement.where(), said=said, seen=state.value)
        return True

    def _restart(self, state: RunState, fields: dict[str, Any], cause: str, backoff_s: float) -> bool:
        """Record this attempt's failure and start over from the last complete checkpoint as the next attempt,
        after ``backoff_s``; False when a stop arrived meanwhile (the run is then PENDING)."""
        config, backend = self.prepared.config, self.prepared.backend
        checkpoint = last_complete_checkpoint(self.run_dir.output)
        resumed_step = checkpoint.step if checkpoint else 0
        lost = max(0, (self._last_step or 0) - resumed_step)
        entry = {
            "attempt": self.attempt,
            "state": state.value,
            "cause": cause,
            "exit_code": fields["exit_code"],
            "signal": fields["signal"],
            "failed_rank": fields.get("failed_rank"),
            "ended": now_iso(),
            "last_step": self._last_step,
            "resumed_step": resumed_step,
            "steps_lost": lost,
            "reason": fields.get("reason"),
        }
        self._restarts += 1
        self.attempt += 1
        lf_args = config.llamafactory_args(backend.name, self.run_dir.output)
        if checkpoint is not None:
            lf_args["resume_from_checkpoint"] = str(checkpoint.path)
        self.store.transition(
            RunState.PENDING,
            event=None,
            attempt=self.attempt,
            attempts=[*self.store.record.attempts, entry],
            exit_code=None,
            signal=None,
            stop_signal=None,
            reason=None,
            failed_rank=None,
            out_of_memory=None,
            processes=[],
            job_pid=None,
            leftover_pids_stopped=[],
            saved_checkpoint=None,
            stopped_by=None,
            stop_sender=None,
            run_exit_code=None,
            resumed_from=checkpoint.relative_to(self.run_dir.path) if checkpoint else None,
            resume_mode=None if checkpoint is None else ("exact" if checkpoint.optimizer_state else "adapter-only"),
        )
        self.store.event(
            "restarting",
            **entry,
            next_attempt=self.attempt,
            backoff_s=backoff_s,
            checkpoint=checkpoint.relative_to(self.run_dir.path) if checkpoint else None,
        )
        _say(
            f"attempt {self.attempt - 1} failed ({cause}); restarting as attempt {self.attempt} from "
            f"{'step ' + str(resumed_step) if checkpoint else 'the start'} in {backoff_s:g} s "
            f"({lost} step(s) lost)",
            err=True,
        )
        write_run_files(config, backend, self.run_dir, lf_args, attempt=self.attempt)
        deadline = time.monotonic() + backoff_s
        while time.monotonic() < deadline and self._stop_signal is None:
            self._signals.wait(min(self.poll_s, max(0.0, deadline - time.monotonic())))
        return self._stop_signal is None

    def _record_stop_while_pending(self, when: str) -> int:
        """The end of a run stopped while PENDING (``when``: during preflight, while waiting to restart)."""
        sig = self._stop_signal or signal.SIGTERM
        request = read_stop_request(self.run_dir.path)
        state = RunState.CANCELLED if request else RunState.TERMINATED
        received = self._signals.first or Received(sig)
        by = _sender(received, request)
        fields = {
            "stop_signal": sig,
            "stopped_by": by,
            "stop_sender": received.to_dict(),
            "attempt": self.attempt,
            "reason": f"stopped by {by} {when}; no job was running",
            "run_exit_code": run_exit_code(state, stop_signal=sig),
        }
        return self._record_end(state, fields)

    def _record_end(self, state: RunState, fields: dict[str, Any]) -> int:
        if not self.store.record_end(state, **fields, processes=[]):
            _say(
                f"warning: the end of run {self.run_dir.run_id} ({state.value}) is not on disk yet "
                f"({(self.store.failing or {}).get('error')}); retrying until it is, the lock stays held",
                err=True,
            )
            self.store.land()
        exit_code, sig = fields.get("exit_code"), fields.get("signal")
        job = (
            "no job"
            if exit_code is None and sig is None
            else (f"job exit code {exit_code}" if sig is None else f"job killed by signal {sig}")
        )
        _say(
            f"run {self.run_dir.run_id} ended {state.value} ({job}; `launcher run` exits {fields['run_exit_code']})\n"
            f"  adapter:     {self.run_dir.output}\n  trainer log: {self.run_dir.trainer_log}"
        )
        return int(fields["run_exit_code"])

    def _accept(self) -> tuple[bool, dict[str, Any]]:
        """Run the acceptance checklist on a job that exited 0."""
        from launcher.results.verify import advice, verify_run

        try:
            report = verify_run(self.run_dir.path, exit_code=0)  # the record is not written yet
        except OSError as err:  # e.g. verify.json could not be written: the checklist did not complete
            return False, {"checked": False, "error": str(err)}
        failed = [c.name for c in report.failed]
        return report.passed, {"checked": True, "passed": report.passed, "failed": failed, "advice": advice(report)}


def failure_reason(what: str, cause: str | None, failed: dict[str, Any] | None) -> str:
    """The reason of a failed attempt: what ended it (``what``: the exit, the first failing rank) and the root cause
    (``cause``: a rank's traceback). ``launcher status`` shows the reason's last line. When the first rank died of a
    signal it left no traceback, and the one found is another rank's consequence (a broken connection): the
    first failure then goes last, so that the line shown names the rank that died first, not its victim."""
    if cause and failed and failed.get("signal") and not cause.startswith(f"rank {failed.get('rank')}:"):
        return f"after it, {cause}\n{what}"
    return f"{what}\n{cause}" if cause else what


class FolderWatch:
    """The run folder by its identity, not its path: an open descriptor of the folder (the kernel keeps its path
    current when it is renamed) and its device and inode. ``moved`` says when the path no longer leads to it."""

    def __init__(self, path: Path):
        self.path = path
        self._fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        st = os.fstat(self._fd)
        self._id = (st.st_dev, st.st_ino)

    def moved(self) -> str | None:
        """None while the path leads to the folder; else what became of it, as one sentence."""
        try:
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self._id:
                return None
        except (FileNotFoundError, NotADirectoryError):
            pass
        except OSError:  # the storage answers badly for a moment (ESTALE, EIO, EACCES): no verdict from that
            return None
        now = self.now_at()
        if now == self.path:  # the kernel still knows it here: a glitch, not a move
            return None
        if now is None:
            return f"the run folder {self.path} was deleted while the run was going on"
        return f"the run folder {self.path} was moved to {now} while the run was going on"

    def now_at(self) -> Path | None:
        """Where the folder is now (``/proc/self/fd``), or None when it was deleted."""
        try:
            target = os.readlink(f"/proc/self/fd/{self._fd}")
        except OSError:
            return None
        return None if target.endswith(" (deleted)") or not Path(target).is_dir() else Path(target)

    def close(self) -> None:
        os.close(self._fd)


# --- entry points -----------------------------------------------------------------------------------


def _stop_the_job(store: RunStore, grace_s: float) -> str | None:
    """A supervisor that fails with its job alive stops the job's processes before it gives up the lock (the lock
    is what refuses a second run on the root). Whatever cannot be stopped stays in the record's ``processes``,
    which the next ``start`` checks (``setup.check_earlier_runs``). Returns what was done, for the reason."""
    known = {(p.get("pid"), p.get("create_time")): p for p in store.record.processes}
    if store.record.job_pid is not None:  # what the job started since the last heartbeat
        for proc in tree(store.record.job_pid):
            try:
                ident = identity(proc)
            except Exception:  # ended while we looked
                continue
            known.setdefault((ident["pid"], ident["create_time"]), ident)
    live = [p for p in (find_live(r) for r in known.values()) if p is not None]
    if not live:
        return None
    try:
        terminate(live, grace_s=grace_s)
    except Exception:  # stopping is best effort here: what is left is recorded and refused below
        pass
    left = [r for r in known.values() if find_live(r) is not None]
    store.record.processes = left
    if left:
        return f"{len(left)} job process(es) could not be stopped: {[r['pid'] for r in left]}"
    return f"the job's {len(live)} live process(es) were stopped"


def _adopt(prepared: Prepared, path: Path) -> tuple[RunDir, RunStore, dict[str, Any], Any]:
    """Node 0 of a submitted run (run/slurm_node.py) supervises in the folder ``launcher submit`` made. A job Slurm
    requeued finds an earlier attempt there: recorded ``NODE_LOST`` unless it recorded an end, and continued
    from the last complete checkpoint (the checkpoint, or None)."""
    run_dir = RunDir(path.name, path)
    store = RunStore.open(path)
    lf_args = prepared.config.llamafactory_args(prepared.backend.name, run_dir.output)
    if store.record.started is None:  # the first attempt
        return run_dir, store, lf_args, None
    if not store.record.terminal:
        store.record_end(
            RunState.NODE_LOST,
            processes=[],
            reason="Slurm requeued the job before this attempt recorded an end (a node was lost)",
        )
    checkpoint = last_complete_checkpoint(run_dir.output)
    if checkpoint is not None:
        lf_args["resume_from_checkpoint"] = str(checkpoint.path)
    clear_stop_request(path)
    return run_dir, store, lf_args, checkpoint


def _open_run(
    prepared: Prepared, lock: RunLock, resume: ResumePlan | None, adopt: Path | None = None
) -> tuple[RunDir, RunStore, int]:
    config, backend = prepared.config, prepared.backend
    resumed_from, resume_mode = None, None
    if resume is not None:
        resumed_from, resume_mode = str(resume.checkpoint.relative_to(resume.run_dir)), resume.mode
    if adopt is not None:
        run_dir, store, lf_args, checkpoint = _adopt(prepared, adopt)
        if checkpoint is not None:
            resumed_from = checkpoint.relative_to(run_dir.path)
            resume_mode = "exact" if checkpoint.optimizer_state else "adapter-only"
        attempt = store.record.attempt + 1 if store.record.started is not None else 1
    elif resume is None:
        run_dir = make_run_dir(config.launcher.output_root, config.run_name)
        store = RunStore.create(run_dir.path, run_dir.run_id)
        lf_args = config.llamafactory_args(backend.name, run_dir.output)
    else:
        run_dir = RunDir(resume.run_dir.name, resume.run_dir)
        store = RunStore.open(run_dir.path)
        if not store.record.terminal:  # e.g. RUNNING with its supervisor gone: record what it really is first
            seen = reconcile(store.record, run_dir.path)
            store.record_end(seen.state, reason=seen.note, processes=[])
        lf_args = config.llamafactory_args(backend.name, run_dir.output)
        lf_args["resume_from_checkpoint"] = str(resume.checkpoint)
        clear_stop_request(run_dir.path)
    if adopt is None:
        attempt = store.record.attempt + 1 if resume is not None else 1
    lock.describe(run_dir.run_id, run_dir.path)
    store.transition(
        RunState.PENDING,
        event=None,
        smoke=config.launcher.smoke,
        backend=backend.name,
        attempt=attempt,
        supervisor=self_identity(),
        boot_id=boot_id(),
        container=container_identity(),
        run_dir=str(run_dir.path),
        exit_code=None,
        signal=None,
        stop_signal=None,
        reason=None,
        ended=None,
        failed_rank=None,
        acceptance=None,
        leftover_pids_stopped=[],
        stopped_by=None,
        stop_sender=None,
        run_exit_code=None,
        saved_checkpoint=None,
        resumed_from=resumed_from,
        resume_mode=resume_mode,
        hostname=socket.gethostname(),
    )
    store.event(
        "created" if resume is None and attempt == 1 else "resumed",
        config=str(config.source),
        attempt=attempt,
        checkpoint=resumed_from,
        **({"skipped": list(resume.skipped)} if resume is not None and resume.skipped else {}),
    )
    write_run_files(config, backend, run_dir, lf_args, attempt=attempt)
    store.reserve()  # room for the end record should the disk fill up during the run
    return run_dir, store, attempt


def _preflight(prepared: Prepared, run_dir: Path, store: RunStore) -> bool:
    """Run preflight in the new run directory: the table, ``preflight.json`` (and ``data_stats.json``), a
    ``preflight`` event; a failed row ends the run FAILED_SETUP and returns False."""
    from launcher.checks.preflight import run_preflight
    from launcher.data.statsview import write_json
    from launcher.state.runs import PREFLIGHT_FILE

    report = run_preflight(prepared)
    report.render()
    report.write(run_dir)
    if report.data_stats is not None:
        write_json(report.data_stats, run_dir)
    store.event("preflight", ok=report.ok, failed=report.failed)
    if report.ok:
        return True
    reason = f"preflight failed: {', '.join(report.failed)} (table in {run_dir / PREFLIGHT_FILE})"
    if not store.record_end(RunState.FAILED_SETUP, reason=reason, run_exit_code=run_exit_code(RunState.FAILED_SETUP)):
        store.land()
    _say(f"error: {reason}", err=True)
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


def supervise(
    config: RunConfig,
    *,
    echo: bool = True,
    handshake: Handshake | None = None,
    resume: ResumePlan | None = None,
    adopt: Path | None = None,
    watch_stop_request: bool = False,
) -> int:
    """Run one supervised run to its end and return its exit code.

    ``handshake`` gets its line once the run directory exists (``launcher start`` waits for it); a refusal is
    its caller's to send (``_supervise``: whatever ended it before the run existed).
    ``adopt``: supervise in this existing run folder (node 0 of a run ``launcher submit`` made);
    ``watch_stop_request``: a stop request written into the run folder stops the run without a signal (each
    node of a Slurm run: ``launcher stop`` runs on another host, run/slurm_node.py). Node 0 records ``NODE_LOST``
    when the run's placement says it lost a node (``Placement.lost_node``).

    Raises:
        LauncherError: the run was refused before it existed (lock busy, live processes, bad config).
    """
    handshake = handshake or Handshake()
    lock = RunLock(config.launcher.output_root)
    lease = DeviceLease([])
    try:
        lock.acquire()
        warnings = check_earlier_runs(config.launcher.output_root)
        for warning in warnings:
            print(f"warning: {warning}", file=sys.stderr)
        prepared = prepare(config)
        lease = lease_devices(prepared)  # before anything is on disk: a refusal changes nothing
        end_hold_guard()  # from here a stop signal waits for the supervisor, which records it in the run
        run_dir, store, attempt = _open_run(prepared, lock, resume, adopt)
        lease.describe(run_dir.run_id, run_dir.path, config.launcher.output_root)
        store.save(devices=[{"host_index": d.host_index, "identity": d.identity} for d in lease.devices])
    except (LauncherError, StopRequested):  # a stop: before the run existed (the hold's guard, signals.py)
        lease.release()
        lock.release()  # the caller that holds the handshake sends the refusal (`_supervise`)
        raise
    try:
        handshake.send(
            ok=True,
            run_id=run_dir.run_id,
            run_dir=str(run_dir.path),
            trainer_log=str(run_dir.trainer_log),
            log=str(run_dir.log),
            pid=os.getpid(),
            warnings=warnings,
        )
        if echo:
            print(
                f"run {run_dir.run_id}\n  run dir:     {run_dir.path}\n  trainer log: {run_dir.trainer_log}"
                f"\n  job log:     {run_dir.log}",
                flush=True,
            )
        return Supervisor(
            prepared,
            run_dir,
            store,
            echo=echo,
            attempt=attempt,
            watch_stop_request=watch_stop_request,
        ).run()
    except BaseException as err:  # record any supervisor failure before giving up the lock
        left = _stop_the_job(store, config.launcher.stop_grace_s)
        if not store.record.terminal:
            state = RunState.FAILED_SETUP if store.state is RunState.PENDING else RunState.FAILED
            reason = f"supervisor error: {type(err).__name__}: {shown(str(err)[:500])}"
            if left:
                reason += f"; {left}"
            store.record_end(state, reason=reason, run_exit_code=run_exit_code(state, exit_code=1))
        if not store.landed:  # the end must be on disk before the lock is given up
            store.land()
        raise
    finally:
        lease.release()  # after the end record, as the run lock
        lock.release()
