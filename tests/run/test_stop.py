"""`launcher stop` ends in every state a live run can be in, with real processes.

PENDING (preflight running), FINISHING, STALLED, and a supervisor that dies while `stop` waits for the save
on stop; RUNNING is `test_recovery.py::test_stop_saves_through_the_protocol_and_the_record_names_the_step`.
Everything is real (the `launcher` command in child processes, the detached supervisor, torchrun, signals,
files) except the training: the ranks are fake (tests/support/fake_rank.py), because each state must be entered and
held at a chosen moment (a last step followed by a long final save, a freeze, a save held back until the
supervisor is dead), which the tiny model cannot be made to do on demand. The PENDING test runs the real
preflight with its real kernel check (a child process), held by stopping that process (SIGSTOP, as a kernel
check hanging on its device), so that the stop is known to arrive during preflight.

No clock: where waiting out a limit would be the failure, `stop` is given a grace far longer than the test
waits for it (`--grace 600`: `stop` would wait up to 670 s), and the test waits for `stop` with a shorter
deadline.
"""

from __future__ import annotations

import psutil
import pytest

from launcher.run.lock import is_locked
from tests.support import fake_runs as fr

pytestmark = pytest.mark.slow
STOP_DEADLINE_S = 180  # far below what `stop --grace 600` would wait before giving up


@pytest.fixture(autouse=True)
def no_leftovers(tmp_path):
    yield
    fr.kill_all(fr.processes_naming(str(tmp_path)))


def started(tmp_path, demo_assets, spec: dict, env_extra: dict | None = None, **settings) -> tuple:
    """A run of fake ranks started with `launcher start`: its folder and environment."""
    cfg, env = fr.fake_config(tmp_path, demo_assets, spec, **settings)
    env.update(env_extra or {})
    done = fr.launcher("start", cfg, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return fr.the_run_dir(tmp_path / "runs"), env


def stalled(tmp_path, demo_assets, **settings) -> tuple:
    """A run of fake ranks frozen after step 3 (they honour a save request, but never reach the next step end),
    recorded STALLED: its folder and environment."""
    never = str(tmp_path / "never")
    spec = {"lines": 100000, "interval": 0.2, "stall_after": 3, "resume_file": never, "save_on_stop": True}
    run_dir, env = started(tmp_path, demo_assets, spec, stall_minutes=0.05, **settings)  # 3 s; stall_action: warn
    fr.wait_for(
        "STALLED after step 3",
        lambda: in_state(run_dir, "STALLED") and (fr.read_status(run_dir).get("progress") or {}).get("step") == 3,
        timeout=240,
    )
    return run_dir, env


def in_state(run_dir, state: str) -> bool:
    return fr.read_status(run_dir)["state"] == state


def assert_stopped(run_dir, env, stopped, state: str = "CANCELLED") -> dict:
    """`stop` said the run ended in ``state``, which the record, `status` and the last event agree on; no
    process of the run is left and the lock is free."""
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert f"ended {state}" in stopped.stdout, stopped.stdout
    status = fr.read_status(run_dir)
    assert status["state"] == state and fr.status_json(run_dir, env)["state"] == state, status
    last = fr.events(run_dir)[-1]
    assert last["event"] == "ended" and last["state"] == state, last
    fr.wait_for("every process of the run to end", lambda: fr.recorded_processes(run_dir) == [], timeout=60)
    fr.wait_for("the lock to be released", lambda: not is_locked(run_dir.parent), timeout=60)
    return status


def kernel_check(supervisor: psutil.Process) -> psutil.Process | None:
    return next((p for p in supervisor.children() if "_kernel-check" in " ".join(p.cmdline())), None)


def test_stop_now_during_preflight_ends_cancelled_with_its_end_recorded(tmp_path, demo_assets):
    """The supervisor leaves preflight at once on the stop (the hung kernel check is killed) and records
    CANCELLED with an `ended` event; not a supervisor dead of SIGTERM, read later as SUPERVISOR_LOST."""
    # the kernel check is not skipped here: preflight's longest row, a child process of the supervisor
    run_dir, env = started(tmp_path, demo_assets, {"lines": 100000}, {"LAUNCHER_PREFLIGHT_SKIP": ""})
    supervisor = psutil.Process(fr.read_status(run_dir)["supervisor"]["pid"])
    check = None
    try:
        check = fr.wait_for("preflight's kernel check to start", lambda: kernel_check(supervisor), timeout=240)
        check.suspend()
        assert in_state(run_dir, "PENDING")
        stopped = fr.launcher("stop", run_dir, "--now", "--grace", "600", env=env, timeout=STOP_DEADLINE_S)
        status = assert_stopped(run_dir, env, stopped)
        assert not fr.alive(check) and not fr.alive(supervisor)
    finally:
        fr.kill_all([check] if check else [])
    assert "during preflight; no job was running" in status["reason"]
    assert "launcher stop (pid" in status["stopped_by"] and status["run_exit_code"] == 143
    kinds = [e["event"] for e in fr.events(run_dir)]
    assert "preflight" not in kinds and "started" not in kinds  # the stop came during preflight, before any job


def test_stop_while_finishing_stops_the_job_at_once_without_asking_for_a_save(tmp_path, demo_assets):
    """After the last optimizer step no step end is left to save at: the job gets SIGTERM at once (its grace
    of 600 s is for a job that ignores SIGTERM), it is not asked to save and waited for."""
    spec = {"lines": 5, "total_steps": 5, "interval": 0.2, "then": "sleep", "save_on_stop": True}
    run_dir, env = started(tmp_path, demo_assets, spec)
    ranks = fr.rank_processes(run_dir, 1)
    fr.wait_for("FINISHING after the last step", lambda: in_state(run_dir, "FINISHING"), timeout=240)
    stopped = fr.launcher("stop", run_dir, "--grace", "600", env=env, timeout=STOP_DEADLINE_S)
    status = assert_stopped(run_dir, env, stopped)
    assert not any(fr.alive(p) for p in ranks)
    assert status["saved_checkpoint"] is None and not (run_dir / "save_request.json").exists()
    (stopping,) = [e for e in fr.events(run_dir) if e["event"] == "stopping"]
    assert stopping["save"] is False


def test_stop_while_stalled_tries_the_save_then_kills_the_frozen_job(tmp_path, demo_assets):
    """A frozen job cannot reach the step end it would save at: the save is asked for, the grace runs out,
    the job is killed and the run ends CANCELLED with no checkpoint."""
    run_dir, env = stalled(tmp_path, demo_assets)
    ranks = fr.rank_processes(run_dir, 1)
    stopped = fr.launcher("stop", run_dir, "--grace", "3", env=env, timeout=STOP_DEADLINE_S)
    status = assert_stopped(run_dir, env, stopped)
    assert not any(fr.alive(p) for p in ranks)
    assert status["saved_checkpoint"] is None and "no checkpoint saved on the stop" in status["reason"]
    kinds = [e["event"] for e in fr.events(run_dir)]
    assert kinds.index("stopping") < kinds.index("save_timeout") < kinds.index("ended")


def test_a_supervisor_killed_while_stop_waits_for_the_save_is_noticed_and_the_save_recorded(tmp_path, demo_assets):
    """`stop` asks the supervisor, which asks the job to save; the supervisor is SIGKILLed before the job
    reaches its next step end. `stop` notices the supervisor is gone, waits for the save the supervisor asked
    for (not asking again), and records the end with the saved checkpoint."""
    go = tmp_path / "go"
    spec = {"lines": 100000, "interval": 0.2, "stall_after": 3, "resume_file": str(go), "save_on_stop": True}
    run_dir, env = started(tmp_path, demo_assets, spec)
    ranks = fr.rank_processes(run_dir, 1)
    fr.wait_for("step 3 in the record", lambda: (fr.read_status(run_dir).get("progress") or {}).get("step") == 3)
    supervisor = psutil.Process(fr.read_status(run_dir)["supervisor"]["pid"])
    torchrun = psutil.Process(fr.read_status(run_dir)["job_pid"])
    stop = fr.launcher_bg("stop", run_dir, "--grace", "600", env=env, log=tmp_path / "stop.out")

    # the request file is written just before the `stopping` event is appended: wait for the event, whole
    def asked() -> bool:
        return (run_dir / "save_request.json").exists() and "stopping" in [e["event"] for e in fr.events(run_dir)]

    fr.wait_for("the supervisor to ask the job to save and say so", asked)
    supervisor.kill()
    fr.wait_for("the supervisor to be gone", lambda: not fr.alive(supervisor))
    go.touch()  # the job reaches its next step end only now, with no supervisor to see it
    assert stop.wait(timeout=STOP_DEADLINE_S) == 0, (tmp_path / "stop.out").read_text()
    out = (tmp_path / "stop.out").read_text()
    assert "ended before recording the end; cleaning up after it" in out, out
    status = fr.read_status(run_dir)
    saved = status["saved_checkpoint"]
    assert status["state"] == "SUPERVISOR_LOST" and saved is not None and saved["step"] == 4, status
    assert (run_dir / saved["path"]).is_dir()
    assert f"checkpoint {saved['path']} saved at step 4 on the stop" in status["reason"]
    assert "launcher stop (pid" in status["stopped_by"]
    assert not any(fr.alive(p) for p in [torchrun, *ranks])
    kinds = [e["event"] for e in fr.events(run_dir)]
    assert kinds.count("stopping") == 1 and kinds.index("stopping") < kinds.index("ended") < kinds.index("cleanup")
    assert "step 4 on the stop" in fr.launcher("status", run_dir, env=env).stdout
