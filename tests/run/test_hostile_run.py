"""A live run the world misbehaves around (issue 64): values planted in what the supervisor reads while the tiny
model trains, its run folder moved or deleted mid-run, and a supervisor that dies of an error of its own. The
supervisor never dies of what it reads, never gives up the lock while the job lives, and records a true end."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from launcher.errors import ExitCode
from launcher.run.setup import check_earlier_runs
from tests.support.common import REPO, make_config
from tests.support.fake_runs import (
    fake_config,
    kill_all,
    launcher,
    launcher_bg,
    processes_naming,
    rank_processes,
    read_status,
    wait_for,
    wait_for_run_dir,
)

HUGE = "9" * 5000
# one trainer-log line each of what the adversarial probes planted; the supervisor warns once per line
PLANTED_LINES = [
    '{"current_steps": ' + HUGE + ', "total_steps": 6, "loss": 1.0}',
    '{"current_steps": 3, "total_steps": 6, "loss": 1.0, "elapsed_time": "inf"}',
    '{"current_steps": 3, "total_steps": 6, "loss": NaN}',
    '{"current_steps": 3, "total_steps": 6, "loss": 1.0, "epoch": 1e999}',
    "[" * 5000 + "]" * 5000,
]


@pytest.fixture(autouse=True)
def no_leftovers(tmp_path):
    yield
    kill_all(processes_naming(str(tmp_path)))


@pytest.mark.slow
def test_values_planted_in_a_live_runs_trainer_log_are_skipped_with_a_warning_each(tmp_path, demo_assets):
    """The tiny model trains through the real entry, LLaMA-Factory and the Trainer; once step 3 is done the test
    appends the probes' lines to the trainer log (and a 5,000-digit step to checkpoint-3's trainer state), then
    lets training go on: the run ends SUCCEEDED, with one warning and one event for each planted line."""
    cfg = make_config(tmp_path, demo_assets, launcher={"entry": "tests.support.fault_entry"})
    env = {
        **os.environ,
        "FAULT_SPEC": json.dumps({"hold_after": [3], "hold_dir": str(tmp_path)}),
        "PYTHONPATH": str(REPO),
    }
    out = tmp_path / "run.out"
    supervisor = launcher_bg("run", cfg, env=env, log=out)
    wait_for("step 3 done", (tmp_path / "held-3").exists, timeout=600)
    run_dir = wait_for_run_dir(tmp_path / "runs")
    log_path = run_dir / "output" / "trainer_log.jsonl"

    def step_3_logged() -> bool:  # LLaMA-Factory writes its lines from a worker thread: its step-3 line first, whole
        text = log_path.read_text()
        return '"current_steps": 3,' in text and text.endswith("\n")

    wait_for("step 3 in the trainer log", step_3_logged, timeout=120)
    with open(log_path, "a") as log:
        log.write("\n".join(PLANTED_LINES) + "\n")
    (tmp_path / "go-3").touch()
    rc = supervisor.wait(timeout=600)
    text = out.read_text(errors="replace")
    status = read_status(run_dir)
    assert rc == 0 and status["state"] == "SUCCEEDED", (status["reason"], text[-3000:])
    warnings = [line for line in text.splitlines() if line.startswith("warning: ") and "line skipped" in line]
    assert len(warnings) == len(PLANTED_LINES), warnings
    for why in (
        "an integer of 5,000 digits",
        "'elapsed_time' is",
        "a non-finite number (NaN)",
        "a number out of range (1e999)",
        "nested more than",
    ):
        assert sum(why in w for w in warnings) == 1, (why, warnings)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert sum(e["event"] == "trainer_log_line_skipped" for e in events) == len(PLANTED_LINES)
    assert status["progress"]["step"] == 6


@pytest.mark.slow
@pytest.mark.parametrize("how", ["moved", "deleted"])
def test_a_run_folder_moved_or_deleted_mid_run_stops_the_job_and_records_why(tmp_path, demo_assets, how):
    """Fake ranks (real torchrun, real processes, no model): once they train, the run folder is renamed (or removed)
    under the supervisor. It notices by the folder's identity, stops the job, and records FAILED with the true
    reason in the moved folder (or where the run began), never FAILED_ACCEPTANCE; the lock is free after."""
    spec = {"lines": 400, "interval": 0.2, "quiet": True}
    cfg, env = fake_config(tmp_path, demo_assets, spec)
    root = tmp_path / "runs"
    supervisor = launcher_bg("run", cfg, env=env, log=tmp_path / "run.out")
    run_dir = wait_for_run_dir(root)
    ranks = rank_processes(run_dir, 1)
    if how == "moved":
        where = root / "renamed-by-hand"
        os.rename(run_dir, where)
    else:
        shutil.rmtree(run_dir)
        where = run_dir
    rc = supervisor.wait(timeout=300)
    assert not any(p.is_running() and p.status() != "zombie" for p in ranks), "the job outlived the supervisor"
    status = wait_for("the end record", lambda: read_status(where), timeout=30)
    out = (tmp_path / "run.out").read_text(errors="replace")
    assert rc == ExitCode.FAILED and status["state"] == "FAILED", (status, out[-3000:])
    said = f"was moved to {where}" if how == "moved" else "was deleted while the run was going on"
    assert said in status["reason"] and f"the run folder {run_dir}" in status["reason"], status["reason"]
    assert status["run_dir"] == str(where)
    events = [json.loads(line)["event"] for line in (where / "events.jsonl").read_text().splitlines()]
    assert "run_folder_moved" in events and events[-1] == "ended"
    proc = launcher("status", where, timeout=60)
    assert proc.returncode == 0 and "FAILED" in proc.stdout and "SUPERVISOR_LOST" not in proc.stdout, proc.stdout


@pytest.mark.slow
def test_a_supervisor_that_fails_stops_its_job_before_it_gives_up_the_lock(tmp_path, demo_assets):
    """The supervisor dies of an error of its own mid-run (a failure planted in its code path through
    ``sitecustomize``, as no value it reads can kill it any more): before it releases the lock it stops the job,
    records FAILED naming the error, and a new ``start`` on the root is not refused by live leftovers."""
    spec = {"lines": 400, "interval": 0.2, "quiet": True}
    cfg, env = fake_config(tmp_path, demo_assets, spec)
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "from launcher.state import trainer_log\n"  # only the supervisor follows the trainer log
        "real = trainer_log.TrainerLogFollower._add\n"
        "def _add(self, record):\n"
        "    if record.get('current_steps') == 4:\n"
        "        raise RuntimeError('planted supervisor failure')\n"
        "    return real(self, record)\n"
        "trainer_log.TrainerLogFollower._add = _add\n"
    )
    env = {**env, "PYTHONPATH": os.pathsep.join((str(hook), env["PYTHONPATH"]))}
    supervisor = launcher_bg("run", cfg, env=env, log=tmp_path / "run.out")
    run_dir = wait_for_run_dir(tmp_path / "runs")
    ranks = rank_processes(run_dir, 1)
    rc = supervisor.wait(timeout=300)
    status = read_status(run_dir)
    out = (tmp_path / "run.out").read_text(errors="replace")
    assert rc != 0 and status["state"] == "FAILED", (status, out[-3000:])
    assert "planted supervisor failure" in status["reason"] and "process(es) were stopped" in status["reason"]
    assert not any(p.is_running() and p.status() != "zombie" for p in ranks), "the job outlived the supervisor"
    assert status["processes"] == []
    assert check_earlier_runs(run_dir.parent) == []  # the next start is not refused: nothing of the job lives


def test_the_reason_status_shows_names_the_rank_that_died_first_not_its_victim():
    """After rank 1 is SIGKILLed, rank 0 dies of the broken connection with a traceback: the reason's last line (the
    one ``launcher status`` shows) is the first failure, rank 1's signal; a rank's own traceback stays last."""
    from launcher.run.supervisor import failure_reason

    what = "exit code 1; first failure: rank 1 (pid 42) killed by signal 9 (SIGKILL)"
    victim = "rank 0: Traceback (most recent call last):\n  ...\nRuntimeError: Connection reset by peer"
    reason = failure_reason(what, victim, {"rank": 1, "signal": 9, "exit_code": None})
    assert reason.splitlines()[-1] == what and "Connection reset by peer" in reason
    own = "rank 1: Traceback (most recent call last):\n  ...\nRuntimeError: shard 3 is empty"
    assert failure_reason(what, own, {"rank": 1, "signal": 9}).splitlines()[-1] == "RuntimeError: shard 3 is empty"
    raised = failure_reason("exit code 1; first failure: rank 0 exit code 1", victim, {"rank": 0, "exit_code": 1})
    assert raised.splitlines()[-1] == "RuntimeError: Connection reset by peer"
    assert failure_reason(what, None, None) == what
