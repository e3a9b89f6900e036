"""``launcher start``, ``stop`` and ``resume``: detach a supervisor, stop a run, continue a run.

``start`` spawns the supervisor in its own session (no terminal, stdin from /dev/null, output to the
run's ``supervisor.log``) and waits only for its handshake: the run directory exists (or the run was
refused, with the reason). The run then lives on when the SSH session ends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .procs import find_live, terminate
from .records import TERMINAL, RunState, StatusRecord, append_event, now_iso, read_status

HANDSHAKE_TIMEOUT_S = 300.0
SUPERVISOR_LOG = "supervisor.log"


def start_detached(config_path: Path, resume: dict[str, Any] | None = None) -> int:
    """Start a supervisor in its own session; print where to follow the run; return at once."""
    read_fd, write_fd = os.pipe()
    cmd = [sys.executable, "-m", "launcher", "_supervise", str(config_path), "--handshake-fd", str(write_fd)]
    if resume is not None:
        cmd += ["--resume", json.dumps({**resume, "run_dir": str(resume["run_dir"]),
                                         "checkpoint": str(resume["checkpoint"])})]  # fmt: skip
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
    early_log = _early_log_path(config_path)
    with open(early_log, "ab") as log:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            pass_fds=(write_fd,), env=env, close_fds=True,
        )  # fmt: skip
    os.close(write_fd)
    with os.fdopen(read_fd) as handshake:
        line = _read_line(handshake, proc, HANDSHAKE_TIMEOUT_S)
    if not line:
        print(f"error: the supervisor (pid {proc.pid}) ended before reporting; see {early_log}", file=sys.stderr)
        return 1
    reply = json.loads(line)
    if not reply.get("ok"):
        print(f"error: {reply.get('error')}", file=sys.stderr)
        early_log.unlink(missing_ok=True)  # it holds only the message just printed; no run folder to move it to
        return int(reply.get("code", 2))
    for warning in reply.get("warnings", []):  # the detached supervisor's stderr is its log, not this terminal
        print(f"warning: {warning}", file=sys.stderr)
    _move_early_log(early_log, Path(reply["run_dir"]))
    print(
        f"started run {reply['run_id']} (supervisor pid {reply['pid']})\n"
        f"  run dir:     {reply['run_dir']}\n"
        f"  trainer log: {reply['trainer_log']}\n"
        f"follow it with:\n"
        f"  launcher status {reply['run_id']} --watch\n"
        f"  launcher logs {reply['run_id']} -f\n"
        f"  tail -f {reply['trainer_log']}\n"
        f"stop it with:\n"
        f"  launcher stop {reply['run_id']}"
    )
    return 0


def _early_log_path(config_path: Path) -> Path:
    """Where the supervisor writes until its run directory exists (moved there afterwards)."""
    from .config import load_run_config

    root = load_run_config(config_path).launcher.output_root
    root.mkdir(parents=True, exist_ok=True)
    return root / f".supervisor-{os.getpid()}-{time.time_ns()}.log"


def _move_early_log(early: Path, run_dir: Path) -> None:
    try:
        os.replace(early, run_dir / SUPERVISOR_LOG)
    except OSError:
        pass  # the supervisor keeps writing to the open file either way


def _read_line(stream, proc: subprocess.Popen, timeout_s: float) -> str:
    """One line from the supervisor, or '' if it exits or times out first."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(stream, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sel.select(timeout=0.2):
            return stream.readline()
        if proc.poll() is not None and not sel.select(timeout=0):
            return ""
    return ""


def stop_run(run_dir: Path, grace_s: float | None, wait_s: float | None = None) -> int:
    """Stop a live run: through its supervisor if alive, else by cleaning up its processes."""
    from .supervisor import request_stop

    try:
        status = read_status(run_dir)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    run_id = status.get("run_id", run_dir.name)
    if RunState(status["state"]) in TERMINAL and not _live(status, run_dir):
        print(f"run {run_id} already ended: {status['state']}")
        return 0
    supervisor = find_live(status.get("supervisor") or {}, "launcher")
    if supervisor is not None:
        request_stop(run_dir, grace_s, by=f"launcher stop (pid {os.getpid()})")
        supervisor.terminate()
        limit = (grace_s if grace_s is not None else 120.0) + 60 if wait_s is None else wait_s
        print(f"stopping run {run_id}: SIGTERM sent to supervisor {supervisor.pid}; waiting up to {limit:.0f} s")
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            try:
                state = read_status(run_dir)["state"]
            except ValueError:
                state = None
            if state and RunState(state) in TERMINAL:
                print(f"run {run_id} ended {state}")
                return 0
            time.sleep(0.5)
        print(f"error: run {run_id} has not ended after {limit:.0f} s; check `launcher status {run_id}`",
              file=sys.stderr)  # fmt: skip
        return 1
    # The supervisor is gone: clean up what it left, and record it.
    procs = _live(status, run_dir)
    killed = terminate(procs, grace_s=grace_s if grace_s is not None else 30.0) if procs else []
    record = StatusRecord.reopen(run_dir, status)
    reason = f"supervisor lost; `launcher stop` stopped {len(procs)} leftover process(es) {[p.pid for p in procs]}"
    if killed:
        reason += f", killed after the grace period: {killed}"
    if RunState(status["state"]) not in TERMINAL:
        record.update(state=RunState.SUPERVISOR_LOST, ended=now_iso(), reason=reason, processes=[])
    append_event(run_dir, "cleanup", state=record.data["state"], reason=reason)
    print(f"run {run_id}: {reason}; recorded {record.data['state']}")
    return 0


def _live(status: dict[str, Any], run_dir: Path) -> list:
    return [p for p in (find_live(r, str(run_dir)) for r in status.get("processes", [])) if p is not None]
