"""A run whose processes live in this pid namespace: this machine, or the container a verb runs in.

Start: ``launcher start`` spawns the supervisor in its own session (no terminal, stdin from /dev/null, output to
the run's ``supervisor.log``) and waits only for its handshake: the run directory exists (or the run was refused,
with the reason). The run then lives on when the SSH session ends. ``launcher run`` is the same supervisor in the
foreground (``run/supervisor.py``).

Liveness: the supervisor is checked by pid, start time and command line; gone means ``SUPERVISOR_LOST``, with the
job's surviving processes listed. A record of another pid namespace that no placement here can reach (a container
seen from another container) is shown as recorded, liveness unknown.

Stop: through the run's supervisor when it is alive (the stop request, then SIGTERM; ``state/stop.py``), else the
clean-up after the lost supervisor, with the save on stop the supervisor would have asked for.

Resume: a new attempt under a new supervisor, in the foreground or detached like ``start``.
"""

from __future__ import annotations

import json
import os
import selectors
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from launcher import SOURCE_ROOT
from launcher.errors import ExitCode, LauncherError
from launcher.files import make_folder, read_yaml_mapping
from launcher.run.placement.base import Placement, StopAsk, Supervise
from launcher.state.procs import find_live, namespace_started, terminate
from launcher.state.reconcile import Reconciled, first_look, restarted_since, same_namespace
from launcher.state.record import RecordUnreadable, RunRecord, RunStore, read_record
from launcher.state.runs import CONFIG_COPY, OVERRIDES_FILE, SUPERVISOR_LOG, follow_up
from launcher.state.states import RunState
from launcher.state.stop import (
    SAVE_KILL_GRACE_S,
    ask_to_save,
    job_can_save,
    read_saved,
    request_stop,
    save_asked,
    saved_checkpoint,
)

if TYPE_CHECKING:  # the config's schema (pydantic) is imported only by what starts a run: `status` stays light
    from launcher.config.run_config import RunConfig
    from launcher.run.resume import ResumePlan

HANDSHAKE_TIMEOUT_S = 300.0
CLEANUP_KILL_GRACE_S = 30.0  # the clean-up after a lost supervisor: SIGTERM, then SIGKILL after this (or --grace)


class LocalPlacement(Placement):
    """A run of this pid namespace (and, as the fallback, any run no other placement holds)."""

    kind = "local"

    @staticmethod
    def holds(record: RunRecord) -> bool:
        return True

    @classmethod
    def start(cls, config: RunConfig, **options: Any) -> int:
        """``launcher start``: the supervisor detached (``resume``: a ``ResumePlan`` to carry out instead)."""
        return start_detached(config, options.get("resume"))

    def where(self) -> str:
        if same_namespace(self.record):
            return "this pid namespace"
        name = (self.record.container or {}).get("name")
        return f"container {name}" if name else "another pid namespace"

    def reconcile(self, run_dir: Path) -> Reconciled:
        record = self.record
        here = same_namespace(record)
        live = (
            [p for p in (find_live(r, str(record.run_id)) for r in record.processes) if p is not None] if here else []
        )
        result = first_look(record, live, here)
        if record.terminal or result.state is RunState.NODE_LOST:
            return result
        if not here:
            result.note = f"recorded in {self.where()}, which cannot be reached from here: liveness unknown"
            return result
        if restarted_since(record, namespace_started()):  # a restarted container may reuse its ns id
            result.state, result.live, result.liveness = RunState.NODE_LOST, [], "gone"
            result.note = "its container was restarted since the run was recorded live"
            return result
        if find_live(record.supervisor or {}, "launcher") is None:
            result.state, result.liveness = RunState.SUPERVISOR_LOST, "gone"
            result.note = "the supervisor is gone" + (
                f"; {len(live)} training process(es) still alive (`launcher stop` cleans them up)" if live else ""
            )
        return result

    def status_fields(self, seen: Reconciled) -> dict[str, Any]:
        fields = super().status_fields(seen)
        if self.record.container:  # seen from inside its own container: no engine answers there
            name = self.record.container.get("name") or self.record.container.get("id")
            fields |= {"container_name": name, "container_status": "state unknown (no answer from a Docker engine)"}
        return fields

    def _stop(self, run_dir: Path, store: RunStore, seen: Reconciled, ask: StopAsk) -> int:
        record = self.record
        if seen.liveness == "unknown":
            raise LauncherError(
                f"run {record.run_id} lives in {self.where()}, whose processes cannot be signalled from here; "
                "run `launcher stop` where it runs",
                ExitCode.FAILED,
            )
        supervisor = find_live(record.supervisor or {}, "launcher")
        if supervisor is not None:
            ended = _stop_through_supervisor(run_dir, supervisor, ask)
            if ended is not None:
                print(f"run {record.run_id} ended {ended.value}")
                return ExitCode.OK
            print(
                f"run {record.run_id}: the supervisor (pid {supervisor.pid}) ended before recording the end; "
                "cleaning up after it"
            )
            store = RunStore.open(run_dir)  # what it wrote before it died
            seen = LocalPlacement(store.record).reconcile(run_dir)
            if store.record.terminal and not seen.live:
                print(f"run {record.run_id} ended {store.record.state.value}")
                return ExitCode.OK
        kill_grace = ask.given if ask.given is not None else CLEANUP_KILL_GRACE_S
        return _clean_up(run_dir, store, seen, ask.by, ask.now, ask.grace, kill_grace)

    def resume(self, run_dir: Path, plan: ResumePlan, adapter_only: bool, in_process: Supervise | None) -> int:
        for why in plan.skipped:
            print(f"note: skipped the newer {why}; it stays on disk")
        print(f"resuming from {plan.checkpoint} (step {plan.step}, {plan.mode})")
        if plan.mode == "adapter-only":
            print("note: optimizer and learning-rate schedule restart; only the adapter and step count are reloaded")
        overrides = read_yaml_mapping(run_dir / OVERRIDES_FILE) if (run_dir / OVERRIDES_FILE).exists() else {}
        if isinstance(overrides, str):
            raise LauncherError(f"{overrides}; it holds the run's KEY=VALUE overrides: restore it to resume")
        from launcher.config.run_config import load_run_config

        config = load_run_config(run_dir / CONFIG_COPY, overrides)
        if in_process is not None:
            return in_process(config, resume=plan)
        return start_detached(config, resume=plan)


def start_detached(config: RunConfig, resume: ResumePlan | None = None) -> int:
    """Start a supervisor in its own session; print where to follow the run; return at once.

    Raises:
        LauncherError: the supervisor refused the run (the lock, live processes, the config) or ended
            before reporting.
    """
    read_fd, write_fd = os.pipe()
    cmd = [sys.executable, "-m", "launcher", "_supervise", str(config.source), "--handshake-fd", str(write_fd)]
    cmd += [f"{key}={json.dumps(value)}" for key, value in config.overrides.items()]  # JSON is YAML: read back as is
    if resume is not None:
        cmd += ["--resume", resume.to_json()]
    path = os.pathsep.join(p for p in (str(SOURCE_ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    early_log = _early_log_path(config.launcher.output_root)
    with open(early_log, "ab") as log:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            pass_fds=(write_fd,),
            env=env,
            close_fds=True,
        )
    os.close(write_fd)
    with os.fdopen(read_fd) as handshake:
        line = _read_line(handshake, proc, HANDSHAKE_TIMEOUT_S)
    if not line:
        raise LauncherError(f"the supervisor (pid {proc.pid}) ended before reporting; see {early_log}", ExitCode.FAILED)
    reply = json.loads(line)
    if not reply.get("ok"):
        early_log.unlink(missing_ok=True)  # it holds only the message printed now; no run folder to move it to
        raise LauncherError(str(reply.get("error")), int(reply.get("code", ExitCode.USAGE)))
    for warning in reply.get("warnings", []):  # the detached supervisor's stderr is its log, not this terminal
        print(f"warning: {warning}", file=sys.stderr)
    _move_early_log(early_log, Path(reply["run_dir"]))
    print(
        f"started run {reply['run_id']} (supervisor pid {reply['pid']})\n"
        f"  run dir:     {reply['run_dir']}\n"
        f"  trainer log: {reply['trainer_log']}\n"
        + follow_up(reply["run_id"], Path(reply["run_dir"]).parent, shlex.join(["tail", "-f", reply["trainer_log"]]))
    )
    return 0


def _early_log_path(root: Path) -> Path:
    """Where the supervisor writes until its run directory exists (moved there afterwards)."""
    make_folder(root, "launcher.output_root")
    return root / f".supervisor-{os.getpid()}-{time.time_ns()}.log"


def _move_early_log(early: Path, run_dir: Path) -> None:
    try:
        os.replace(early, run_dir / SUPERVISOR_LOG)
    except OSError:
        pass  # the supervisor keeps writing to the open file either way


def _read_line(stream, proc: subprocess.Popen, timeout_s: float) -> str:
    """One line from the supervisor, or '' if it exits or times out first."""
    sel = selectors.DefaultSelector()
    sel.register(stream, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sel.select(timeout=0.2):
            return stream.readline()
        if proc.poll() is not None and not sel.select(timeout=0):
            return ""
    return ""


def _stop_through_supervisor(run_dir: Path, supervisor, ask: StopAsk) -> RunState | None:
    """Ask the live supervisor to stop the run and wait for the recorded end: the terminal state, or None when
    the supervisor died first (checked at every poll: pid and start time)."""
    identity = {"pid": supervisor.pid, "create_time": supervisor.create_time()}
    try:
        request_stop(run_dir, ask.given, by=ask.by, now=ask.now)
    except OSError as err:  # e.g. a full disk: the supervisor still stops the run, as for `docker stop`
        print(f"warning: cannot write the stop request in {run_dir} ({err}); sending SIGTERM anyway", file=sys.stderr)
    supervisor.terminate()
    # the save's grace, then SIGTERM and SIGKILL after SAVE_KILL_GRACE_S, and time to record the end
    limit = ask.grace + SAVE_KILL_GRACE_S + 60 if ask.wait_s is None else ask.wait_s
    run_id = run_dir.name
    print(f"stopping run {run_id}: SIGTERM sent to supervisor {supervisor.pid}; waiting up to {limit:.0f} s")
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        gone = find_live(identity) is None  # asked first: a supervisor that wrote its end and left is no loss
        try:
            state = read_record(run_dir).state
        except RecordUnreadable:
            state = None
        if state is not None and state.terminal:
            return state
        if gone:
            return None
        time.sleep(0.5)
    raise LauncherError(
        f"run {run_id} has not ended after {limit:.0f} s; check `launcher status {run_id}`", ExitCode.FAILED
    )


def _clean_up(run_dir: Path, store: RunStore, seen, by: str, now: bool, grace: float, kill_grace: float) -> int:
    """The supervisor is gone: clean up what it left (after a save on stop when the job can save, by the rule
    the supervisor follows, ``state.stop.job_can_save``: one it had asked for before it died is waited for, not
    asked again, up to ``grace``; then SIGTERM, and SIGKILL after ``kill_grace``), and record it."""
    record = store.record
    procs = seen.live
    pids = [p.pid for p in procs]
    asked = save_asked(run_dir)  # by the supervisor, before it died (or its watchdog)
    saving = not now and (asked or job_can_save(run_dir, record.state, pids))
    if procs and saving:
        _save_before_cleanup(run_dir, store, procs, grace, by, ask=not asked)
        procs = [p for p in procs if p.is_running()]
    killed = terminate(procs, grace_s=kill_grace) if procs else []
    reason = f"supervisor lost; `launcher stop` stopped {len(pids)} leftover process(es) {pids}"
    if killed:
        reason += f", killed after the grace period: {killed}"
    fields: dict = {}
    if saving:
        saved = saved_checkpoint(run_dir, read_saved(run_dir))
        fields = {"saved_checkpoint": saved, "stopped_by": by}
        reason += (
            f"; checkpoint {saved['path']} saved at step {saved['step']} on the stop"
            if saved
            else "; no checkpoint saved on the stop"
        )
    if not record.terminal:
        store.record_end(
            seen.state if seen.state.terminal else RunState.SUPERVISOR_LOST, reason=reason, processes=[], **fields
        )
    store.event("cleanup", state=store.state.value, reason=reason)
    print(f"run {record.run_id}: {reason}; recorded {store.state.value}")
    return ExitCode.OK


def _save_before_cleanup(run_dir: Path, store: RunStore, procs: list, grace: float, by: str, ask: bool) -> None:
    """Let the job of a run whose supervisor is gone save a checkpoint at the next step and exit, the way the
    supervisor does (``save_request.json``, read by rank/stopsave.py in each rank; written here when ``ask``, else
    the supervisor's own is waited for); wait for its processes to end, up to ``grace`` seconds."""
    if ask:
        ask_to_save(run_dir, f"{by}; the supervisor is gone", anew=True)
        store.event(
            "stopping",
            signal=None,
            grace_s=grace,
            why="launcher stop: the supervisor is gone",
            save=True,
            requested_by=by,
        )
    print(
        f"run {store.record.run_id}: the supervisor is gone; the job saves a checkpoint at the next step and "
        f"exits (up to {grace:g} s)"
    )
    _, left = psutil.wait_procs(procs, timeout=grace)
    if left:
        store.event("save_timeout", pids=[p.pid for p in left])
