"""Process-tree supervision, hangup and the container's SIGTERM, with real processes.

Each test runs the real `launcher start` or `launcher run` on a valid demo config whose ranks are
``tests.support.fake_rank`` under the real torchrun (tests/support/fake_runs.py), then signals, hangs up or kills
processes and checks what survives and what the run record says. The last test trains the tiny model
for real through `start` and follows it with `status --json`.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from launcher.run.lock import is_locked
from tests.support.common import make_config
from tests.support.fake_runs import (
    PREFLIGHT_SKIP,
    alive,
    crafted_run,
    events,
    fake_config,
    fake_env,
    kill_all,
    launcher,
    launcher_bg,
    processes_naming,
    rank_processes,
    read_status,
    recorded_processes,
    status_json,
    the_run_dir,
    wait_for,
    wait_for_growth,
    wait_for_run_dir,
)
from tests.support.terminal import hang_up, in_pty, read_until

pytestmark = pytest.mark.slow
TERMINAL = {
    "SUCCEEDED",
    "FAILED_ACCEPTANCE",
    "FAILED",
    "FAILED_SETUP",
    "CANCELLED",
    "TERMINATED",
    "OUT_OF_MEMORY",
    "SUPERVISOR_LOST",
    "NODE_LOST",
}


@pytest.fixture(autouse=True)
def no_leftovers(tmp_path):
    """Whatever a test leaves running under its folder is killed afterwards (and the test says so)."""
    yield
    kill_all(processes_naming(str(tmp_path)))


# --- hangup ---------------------------------------------------------------------------------------------


def test_a_trainer_started_without_detachment_dies_on_hangup(tmp_path):
    """The control for the next test: plain torchrun in a terminal, terminal closed, the job is gone."""
    run_dir = tmp_path / "plain"
    run_dir.mkdir()
    env = fake_env(tmp_path, {"lines": 100000, "interval": 0.3, "on_sighup": "exit"})
    torchrun = (
        f'exec "{sys.executable}" -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node 1 '
        f'-m tests.support.fake_rank "{run_dir}"'
    )
    pid, fd = in_pty(["sh", "-c", torchrun], env)
    read_until(fd, r"rank 0 step 1/", timeout=180)
    rank = psutil.Process(json.loads((run_dir / "fake_ranks" / "rank0.json").read_text())["pid"])
    hang_up(pid, fd)
    wait_for("the rank to die after the hangup", lambda: not alive(rank), timeout=60)


def test_a_started_run_survives_hangup_and_stop_kills_a_rank_that_ignores_sigterm(tmp_path, demo_assets):
    spec = {"lines": 100000, "interval": 0.3, "on_sighup": "exit", "ignore_sigterm": True}
    cfg, env = fake_config(tmp_path, demo_assets, spec, nproc_per_node=2)
    pid, fd = in_pty(["sh", "-c", f'"{sys.executable}" -m launcher start "{cfg}"; echo START_RC=$?; sleep 600'], env)
    out = read_until(fd, r"START_RC=\d+", timeout=300)
    assert "START_RC=0" in out and "started run" in out, out
    run_dir = the_run_dir(tmp_path / "runs")
    ranks = rank_processes(run_dir, 2)
    status = read_status(run_dir)
    supervisor, torchrun = psutil.Process(status["supervisor"]["pid"]), psutil.Process(status["job_pid"])
    # detached: its own session, no terminal, stdin from /dev/null
    assert os.getsid(supervisor.pid) == supervisor.pid and supervisor.terminal() is None
    assert os.readlink(f"/proc/{supervisor.pid}/fd/0") == "/dev/null"

    log = run_dir / "output" / "trainer_log.jsonl"
    wait_for_growth(log, lines=1)  # training has begun writing its log
    ended = hang_up(pid, fd)
    assert os.WIFSIGNALED(ended) and os.WTERMSIG(ended) == signal.SIGHUP  # the terminal's session got SIGHUP
    wait_for_growth(log, lines=3)  # still training after the hangup (a rank that died would write nothing)
    assert all(alive(p) for p in [supervisor, torchrun, *ranks]), "part of the run died with the terminal"
    assert not list((run_dir / "fake_ranks").glob("*.sighup")), "a rank received SIGHUP"
    assert status_json(run_dir, env)["state"] == "RUNNING"

    # stop: SIGTERM to every process group, 2 s of grace, then SIGKILL for the ranks that ignore it
    stopped = launcher("stop", run_dir, "--grace", "2", env=env, timeout=180)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert f"run {run_dir.name} ended CANCELLED" in stopped.stdout
    everyone = [supervisor, torchrun, *ranks]
    wait_for("every process of the run to end", lambda: not any(alive(p) for p in everyone), timeout=30)
    assert recorded_processes(run_dir) == []
    status = read_status(run_dir)
    assert status["state"] == "CANCELLED" and status["stop_signal"] == signal.SIGTERM
    assert (status["exit_code"], status["signal"]) != (0, None)
    assert "launcher stop" in status["reason"]
    kinds = {e["event"]: e for e in events(run_dir)}
    assert kinds["stopping"]["grace_s"] == 2 and kinds["stopping"]["signal"] == signal.SIGTERM
    assert {p.pid for p in ranks} <= set(kinds["killed_after_grace"]["pids"])  # they ignored SIGTERM
    assert kinds["ended"]["state"] == "CANCELLED"
    assert not is_locked(tmp_path / "runs")


# --- the job's processes die -----------------------------------------------------------------------------


def test_torchrun_killed_ends_failed_and_no_rank_lingers(tmp_path, demo_assets):
    # a run that was live when the host went down: the new start is allowed, says so, and marks it
    old = crafted_run(tmp_path, name="old-20261129-000000", boot_id="00000000-0000-4000-8000-000000000000")
    cfg, env = fake_config(tmp_path, demo_assets, {"lines": 100000, "interval": 0.3}, nproc_per_node=2)
    started = launcher("start", cfg, env=env, timeout=300)
    assert started.returncode == 0, started.stdout + started.stderr
    assert f"warning: run {old.name}: the host rebooted (boot id changed)" in started.stderr
    assert "recorded NODE_LOST" in started.stderr
    assert read_status(old)["state"] == "NODE_LOST"

    run_dir = next(p for p in (tmp_path / "runs").iterdir() if p.is_dir() and p != old)
    ranks = rank_processes(run_dir, 2)
    torchrun = psutil.Process(read_status(run_dir)["job_pid"])
    torchrun.send_signal(signal.SIGKILL)
    # the terminal record and event are on disk before the lock is released
    wait_for("the lock to be released", lambda: not is_locked(tmp_path / "runs"), timeout=120, every=0.05)
    status = read_status(run_dir)
    assert events(run_dir)[-1]["event"] == "ended"
    assert status["state"] == "FAILED"
    assert status["signal"] == 9 and status["exit_code"] is None
    assert "killed by signal 9 (SIGKILL)" in status["reason"]
    assert {p.pid for p in ranks} <= set(status["leftover_pids_stopped"])  # orphaned ranks were stopped
    assert not any(alive(p) for p in ranks)
    shown = launcher("status", run_dir, env=env).stdout
    assert "FAILED" in shown and "signal 9" in shown


def run_to_end(tmp_path: Path, demo_assets, spec: dict, nproc: int) -> tuple[Path, object]:
    cfg, env = fake_config(tmp_path, demo_assets, spec, nproc_per_node=nproc)
    proc = launcher("run", cfg, "--quiet", env=env, timeout=600)
    return the_run_dir(tmp_path / "runs"), proc


def test_a_rank_that_raises_leaves_its_traceback_in_the_record(tmp_path, demo_assets):
    spec = {
        "lines": 2,
        "interval": 0.1,
        "then": "sleep",
        "ranks": {"1": {"then": "raise", "message": "fake failure: shard 3 is empty"}},
    }
    run_dir, proc = run_to_end(tmp_path, demo_assets, spec, nproc=2)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    status = read_status(run_dir)
    assert status["state"] == "FAILED" and status["exit_code"] == 1
    reason = status["reason"]
    assert reason.startswith("exit code 1; first failure: rank 1")
    assert "rank 1: Traceback (most recent call last):" in reason  # the rank's own error file
    assert "tests/support/fake_rank.py" in reason and reason.endswith("RuntimeError: fake failure: shard 3 is empty")
    assert json.loads((run_dir / "errors" / "rank1.json").read_text())["type"] == "RuntimeError"
    shown = launcher("status", run_dir).stdout
    assert "RuntimeError: fake failure: shard 3 is empty" in shown and "FAILED" in shown


@pytest.mark.parametrize(
    ("spec", "nproc", "failed"),
    [
        (
            {"then": "sleep", "ranks": {"1": {"then": "exit", "exit_code": 3}}},
            2,
            {"rank": 1, "exit_code": 3, "signal": None},
        ),
        ({"then": "kill", "kill_signal": 9}, 1, {"rank": 0, "exit_code": None, "signal": 9}),
    ],
    ids=["exit-3", "sigkill"],
)
def test_a_ranks_exit_code_or_signal_is_recorded(tmp_path, demo_assets, spec, nproc, failed):
    run_dir, proc = run_to_end(tmp_path, demo_assets, {"lines": 1, "interval": 0.1, **spec}, nproc)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]  # torchrun's own exit code
    status = read_status(run_dir)
    rank_pid = json.loads((run_dir / "fake_ranks" / f"rank{failed['rank']}.json").read_text())["pid"]
    assert status["state"] == "FAILED" and status["exit_code"] == 1
    assert status["failed_rank"] == {**failed, "pid": rank_pid}
    if failed["signal"]:
        assert f"rank 0 (pid {rank_pid}) killed by signal 9 (SIGKILL)" in status["reason"]
    else:
        assert f"rank 1 (pid {rank_pid}) exit code 3" in status["reason"]
    assert "ChildFailedError" not in status["reason"]  # torchrun's own traceback is not a root cause
    shown = launcher("status", run_dir).stdout
    died = "signal 9" if failed["signal"] else "code 3"
    assert f"code 1 (rank {failed['rank']}: {died})" in shown


# --- the foreground supervisor: progress watchdog, then SIGTERM as from `docker stop` ---------------------


def test_stalled_progress_then_sigterm_records_terminated_within_the_grace(tmp_path, demo_assets):
    resume = tmp_path / "resume"
    # 60 lines: after the resume the job runs about 17 s before it stalls again, a window a loaded machine sees
    spec = {"lines": 60, "interval": 0.3, "stall_after": 4, "resume_file": str(resume), "then": "sleep"}
    grace = 60.0
    cfg, env = fake_config(tmp_path, demo_assets, spec, stall_minutes=0.05, stop_grace_s=grace)  # 3 s
    supervisor = launcher_bg("run", cfg, "--quiet", env=env, log=tmp_path / "run.out")
    run_dir = wait_for_run_dir(tmp_path / "runs")

    def state_at(state: str, step) -> dict | None:
        s = read_status(run_dir)
        return s if s["state"] == state and step((s.get("progress") or {}).get("step") or 0) else None

    wait_for("STALLED after step 4", lambda: state_at("STALLED", lambda step: step == 4), timeout=240)
    assert alive(psutil.Process(read_status(run_dir)["job_pid"]))  # a warning, not an end
    assert status_json(run_dir, env)["state"] == "STALLED"
    resume.touch()
    wait_for("RUNNING again past step 4", lambda: state_at("RUNNING", lambda step: step > 4), timeout=60)
    states = [e["state"] for e in events(run_dir) if e["event"] == "state"]
    assert "STALLED" in states and states[states.index("STALLED") + 1] == "RUNNING"

    job = recorded_processes(run_dir)
    sent = time.monotonic()
    supervisor.send_signal(signal.SIGTERM)
    rc = supervisor.wait(timeout=grace + 60)
    took = time.monotonic() - sent
    status = read_status(run_dir)
    assert status["state"] == "TERMINATED", status
    assert took < grace, f"the record took {took:.1f} s, longer than the {grace:.0f} s grace period"
    assert status["stop_signal"] == signal.SIGTERM and "received SIGTERM" in status["reason"]
    assert rc == 128 + signal.SIGTERM  # never 0 for a run stopped from outside, as a shell reports it
    assert (status["exit_code"], status["signal"]) != (0, None)  # torchrun's real end, not a reaped child's 0
    assert not any(alive(p) for p in job)
    kinds = [e["event"] for e in events(run_dir)]
    assert "stopping" in kinds and "killed_after_grace" not in kinds and kinds[-1] == "ended"


# --- end to end: the tiny model, for real ------------------------------------------------------------------


def test_tiny_model_trained_through_start_and_followed_with_status_json(tmp_path, demo_assets):
    cfg = make_config(tmp_path, demo_assets, max_steps=2, save_steps=2, eval_steps=2)
    env = {**os.environ, "LAUNCHER_PREFLIGHT_SKIP": PREFLIGHT_SKIP}
    started = launcher("start", cfg, env=env, timeout=300)
    assert started.returncode == 0, started.stdout + started.stderr
    run_id = started.stdout.split("started run ", 1)[1].split()[0]
    # the printed follow-up commands name the runs folder: they find the run from any folder
    printed = [shlex.split(line) for line in started.stdout.splitlines() if line.strip().startswith("launcher ")]
    assert [c[1] for c in printed] == ["status", "logs", "stop"], started.stdout
    assert all(c[2:5] == [run_id, "--root", str(tmp_path / "runs")] for c in printed), started.stdout
    watch = printed[0]
    assert watch[-1] == "--watch", watch
    seen = []
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        proc = launcher(*watch[1:-1], "--json", env=env, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        info = json.loads(proc.stdout)
        if not seen or seen[-1] != info["state"]:
            seen.append(info["state"])
        if info["state"] in TERMINAL:
            break
        time.sleep(2)
    assert info["state"] == "SUCCEEDED", (seen, info["reason"])
    assert info["exit_code"] == 0 and info["signal"] is None
    assert info["step"] == 2 and info["total_steps"] == 2 and info["loss"] is not None
    assert "RUNNING" in seen or "FINISHING" in seen, seen
    status = read_status(tmp_path / "runs" / run_id)
    assert status["acceptance"]["checked"] is True and status["acceptance"]["passed"] is True
    assert (tmp_path / "runs" / run_id / "output" / "adapter_model.safetensors").is_file()
    wait_for("the lock to be released", lambda: not is_locked(tmp_path / "runs"), timeout=30)
