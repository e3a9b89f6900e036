"""``launcher start``, ``stop`` and ``resume``: detach a supervisor, stop a run, continue a run.

``start`` spawns the supervisor in its own session (no terminal, stdin from /dev/null, output to the
run's ``supervisor.log``) and waits only for its handshake: the run directory exists (or the run was
refused, with the reason). The run then lives on when the SSH session ends.

``stop`` follows the stop protocol (``state/stop.py``): through the run's supervisor when it is alive,
through the Docker engine for a run in a container seen from outside (``container.py``), else it cleans up
after the lost supervisor itself, with the save on stop the supervisor would have asked for.

``resume`` continues a run from the plan ``resume.py`` makes: in the foreground (``supervisor.py``),
detached like ``start``, or in a new container for a container run seen from the host.
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

import psutil

from launcher import SOURCE_ROOT
from launcher.config.run_config import RunConfig, load_run_config
from launcher.errors import ExitCode, LauncherError
from launcher.files import make_folder, read_yaml_mapping
from launcher.run.container import resume_in_container, stop_container_run
from launcher.run.resume import ResumePlan, plan_resume
from launcher.run.signals import drop_hold
from launcher.run.slurm import stop_slurm_run
from launcher.run.supervisor import supervise
from launcher.state.procs import container_identity, find_live, terminate
from launcher.state.reconcile import reconcile, same_namespace
from launcher.state.record import RecordUnreadable, RunStore, read_record
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
    stop_grace,
)

HANDSHAKE_TIMEOUT_S = 300.0


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


def stop_run(run_dir: Path, grace_s: float | None, wait_s: float | None = None, now: bool = False) -> int:
    """Stop a live run: through its supervisor if alive (a save on stop first unless ``now``), else by
    cleaning up its processes. A supervisor that dies while it stops the run is noticed at the next poll:
    the clean-up then finishes its work."""
    store = RunStore.open(run_dir)
    record = store.record
    seen = reconcile(record, run_dir)
    by = f"launcher stop (pid {os.getpid()}, uid {os.getuid()})"
    if record.terminal and not seen.live:
        print(f"run {record.run_id} already ended: {record.state.value}")
        return ExitCode.OK
    if (record.slurm or {}).get("job_id"):  # its processes live on the job's nodes: through Slurm
        return stop_slurm_run(run_dir, store, grace_s, now, by)
    if record.container and not same_namespace(record):  # its pids mean nothing here: through the engine
        return stop_container_run(run_dir, store, seen, grace_s, now, by)
    if seen.liveness == "unknown":
        raise LauncherError(
            f"run {record.run_id} lives in another pid namespace and in no known container, whose processes "
            "cannot be signalled from here; run `launcher stop` where it runs",
            ExitCode.FAILED,
        )
    grace = stop_grace(grace_s, record.stop_grace_s)
    supervisor = find_live(record.supervisor or {}, "launcher")
    if supervisor is not None:
        ended = _stop_through_supervisor(run_dir, supervisor, grace_s, grace, wait_s, by, now)
        if ended is not None:
            print(f"run {record.run_id} ended {ended.value}")
            return ExitCode.OK
        print(
            f"run {record.run_id}: the supervisor (pid {supervisor.pid}) ended before recording the end; "
            "cleaning up after it"
        )
        store = RunStore.open(run_dir)  # what it wrote before it died
        record = store.record
        seen = reconcile(record, run_dir)
        if record.terminal and not seen.live:
            print(f"run {record.run_id} ended {record.state.value}")
            return ExitCode.OK
    return _clean_up(run_dir, store, seen, by, now, grace, kill_grace=grace_s if grace_s is not None else 30.0)


def _stop_through_supervisor(
    run_dir: Path, supervisor, grace_s: float | None, grace: float, wait_s: float | None, by: str, now: bool
) -> RunState | None:
    """Ask the live supervisor to stop the run and wait for the recorded end: the terminal state, or None when
    the supervisor died first (checked at every poll: pid and start time)."""
    identity = {"pid": supervisor.pid, "create_time": supervisor.create_time()}
    try:
        request_stop(run_dir, grace_s, by=by, now=now)
    except OSError as err:  # e.g. a full disk: the supervisor still stops the run, as for `docker stop`
        print(f"warning: cannot write the stop request in {run_dir} ({err}); sending SIGTERM anyway", file=sys.stderr)
    supervisor.terminate()
    # the save's grace, then SIGTERM and SIGKILL after SAVE_KILL_GRACE_S, and time to record the end
    limit = grace + SAVE_KILL_GRACE_S + 60 if wait_s is None else wait_s
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


def resume_run(run_dir: Path, adapter_only: bool = False, foreground: bool = False) -> int:
    """``launcher resume``: plan, then supervise the new attempt (detached unless ``foreground``)."""
    plan = plan_resume(run_dir, adapter_only)
    record = read_record(run_dir)
    if record.container and container_identity() is None:  # on the host: the run resumes in a container
        drop_hold()  # a --foreground resume held the stop signals for a supervisor this process will not be
        return resume_in_container(run_dir, record, adapter_only)
    for why in plan.skipped:
        print(f"note: skipped the newer {why}; it stays on disk")
    print(f"resuming from {plan.checkpoint} (step {plan.step}, {plan.mode})")
    if plan.mode == "adapter-only":
        print("note: optimizer and learning-rate schedule restart; only the adapter and step count are reloaded")
    overrides = read_yaml_mapping(run_dir / OVERRIDES_FILE) if (run_dir / OVERRIDES_FILE).exists() else {}
    if isinstance(overrides, str):
        raise LauncherError(f"{overrides}; it holds the run's KEY=VALUE overrides: restore it to resume")
    config = load_run_config(run_dir / CONFIG_COPY, overrides)
    if foreground:
        return supervise(config, resume=plan)
    return start_detached(config, resume=plan)
