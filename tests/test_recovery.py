"""Save on stop, automatic recovery and the hang watchdog, with real processes.

The tiny real model trains for the save on stop and for a restart after a rank is killed (a Trainer
callback of ``tests.fault_entry`` kills it at a chosen step); fake ranks under the real torchrun
(tests/fake_rank.py) stand for the failures that a real model cannot be made to have on demand here:
a rank that raises, a crash loop, a rank that freezes.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import make_config, read_jsonl
from tests.fake_runs import (
    PREFLIGHT_SKIP,
    events,
    fake_config,
    kill_all,
    launcher,
    launcher_bg,
    processes_naming,
    rank_processes,
    read_status,
    recorded_processes,
    the_run_dir,
    wait_for,
    wait_for_run_dir,
)


@pytest.fixture(autouse=True)
def no_leftovers(tmp_path):
    yield
    kill_all(processes_naming(str(tmp_path)))


def tiny_config(tmp_path: Path, demo_assets, launcher_settings: dict, **lf) -> tuple[Path, dict[str, str]]:
    """The demo config with full checkpoints (optimizer state: an exact resume) and no evaluation."""
    settings = {"max_steps": 6, "save_steps": 3, "save_only_model": False, "eval_strategy": "no",
                "eval_dataset": None, "eval_steps": None, "per_device_eval_batch_size": None, **lf}  # fmt: skip
    cfg = make_config(tmp_path, demo_assets, launcher=launcher_settings, **settings)
    return cfg, {**os.environ, "LAUNCHER_PREFLIGHT_SKIP": PREFLIGHT_SKIP}


def logged_steps(run_dir: Path) -> list[int]:
    return [r["current_steps"] for r in read_jsonl(run_dir / "output" / "trainer_log.jsonl") if "loss" in r]


# --- save on stop -------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_at_the_next_step_and_resume_reaches_the_planned_steps(tmp_path, demo_assets):
    grace = 300.0
    planned = 10
    cfg, env = tiny_config(tmp_path, demo_assets, {"stop_grace_s": grace}, max_steps=planned, save_steps=1000)
    supervisor = launcher_bg("run", cfg, "--quiet", env=env, log=tmp_path / "run.out")
    run_dir = wait_for_run_dir(tmp_path / "runs")
    wait_for("three logged optimizer steps", lambda: len(logged_steps(run_dir)) >= 3, timeout=600, every=0.1)
    sent = time.monotonic()
    supervisor.send_signal(signal.SIGTERM)  # what `docker stop` / `docker compose stop` does to the main process
    rc = supervisor.wait(timeout=grace + 60)
    took = time.monotonic() - sent
    status = read_status(run_dir)
    out = (tmp_path / "run.out").read_text()
    assert rc == 128 + signal.SIGTERM, out[-3000:]
    assert status["state"] == "TERMINATED" and status["run_exit_code"] == 143
    assert status["stop_signal"] == signal.SIGTERM and f"SIGTERM from pid {os.getpid()} (" in status["stopped_by"]
    saved = status["saved_checkpoint"]
    last_logged = max(logged_steps(run_dir))
    assert saved is not None, status["reason"]
    assert last_logged - 1 <= saved["step"] < planned, (saved, last_logged)  # at most one step behind the log
    assert saved["optimizer_state"] is True and (run_dir / saved["path"] / "optimizer.pt").is_file()
    assert f"checkpoint-{saved['step']}" in status["reason"]
    assert took < grace
    kinds = [e["event"] for e in events(run_dir)]
    assert "stopping" in kinds and "killed_after_grace" not in kinds and "save_timeout" not in kinds
    assert not (run_dir / "output" / "adapter_model.safetensors").exists()  # no final save: the run did not finish
    print(f"\nsave on stop: last logged step {last_logged}, saved step {saved['step']}, {took:.1f} s after SIGTERM")

    resumed = launcher("resume", run_dir, "--foreground", env=env, timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    status = read_status(run_dir)
    assert status["state"] == "SUCCEEDED" and status["attempt"] == 2
    assert status["resumed_from"] == saved["path"] and status["resume_mode"] == "exact"
    steps = logged_steps(run_dir)
    assert steps[-1] == planned and steps[steps.index(saved["step"]) + 1] == saved["step"] + 1
    assert (run_dir / "output" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_two_ranks_agree_on_the_step_they_save_at_on_launcher_stop(tmp_path, demo_assets):
    cfg, env = tiny_config(tmp_path, demo_assets, {"nproc_per_node": 2, "stop_grace_s": 300}, max_steps=10,
                           save_steps=1000)  # fmt: skip
    started = launcher("start", cfg, env=env, timeout=300)
    assert started.returncode == 0, started.stdout + started.stderr
    run_dir = the_run_dir(tmp_path / "runs")
    wait_for("two logged optimizer steps", lambda: len(logged_steps(run_dir)) >= 2, timeout=600, every=0.1)
    stopped = launcher("stop", run_dir, env=env, timeout=600)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    status = read_status(run_dir)
    saved = status["saved_checkpoint"]
    assert status["state"] == "CANCELLED" and saved is not None, status["reason"]
    assert max(logged_steps(run_dir)) - 1 <= saved["step"] < 10
    assert status["exit_code"] == 0  # both ranks left at the same step; none was killed or hung
    kinds = [e["event"] for e in events(run_dir)]
    assert "killed_after_grace" not in kinds and "save_timeout" not in kinds
    log = (run_dir / "launcher.log").read_text()
    assert f"rank 0: stopped after saving checkpoint-{saved['step']}" in log
    assert f"rank 1: stopped after saving checkpoint-{saved['step']}" in log


@pytest.mark.slow
def test_stop_now_skips_the_save(tmp_path, demo_assets):
    spec = {"lines": 100000, "interval": 0.2, "save_on_stop": True}
    cfg, env = fake_config(tmp_path, demo_assets, spec)
    started = launcher("start", cfg, env=env, timeout=300)
    assert started.returncode == 0, started.stdout + started.stderr
    run_dir = the_run_dir(tmp_path / "runs")
    rank_processes(run_dir, 1)
    wait_for("the job to announce its save on stop", lambda: (run_dir / "save_on_stop.json").exists())
    stopped = launcher("stop", run_dir, "--now", env=env, timeout=180)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    status = read_status(run_dir)
    assert status["state"] == "CANCELLED" and status["saved_checkpoint"] is None
    assert not list((run_dir / "output").glob("checkpoint-*")) and not (run_dir / "save_request.json").exists()
    assert "launcher stop" in status["stopped_by"] and status["run_exit_code"] == 143
    assert [e for e in events(run_dir) if e["event"] == "stopping"][0]["save"] is False


@pytest.mark.slow
def test_stop_saves_through_the_protocol_and_the_record_names_the_step(tmp_path, demo_assets):
    spec = {"lines": 100000, "interval": 0.2, "save_on_stop": True}
    cfg, env = fake_config(tmp_path, demo_assets, spec)
    started = launcher("start", cfg, env=env, timeout=300)
    assert started.returncode == 0, started.stdout + started.stderr
    run_dir = the_run_dir(tmp_path / "runs")
    rank_processes(run_dir, 1)
    wait_for("the job to announce its save on stop", lambda: (run_dir / "save_on_stop.json").exists())
    stopped = launcher("stop", run_dir, env=env, timeout=180)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    status = read_status(run_dir)
    assert status["state"] == "CANCELLED" and status["saved_checkpoint"]["step"] >= 1
    assert (run_dir / status["saved_checkpoint"]["path"]).is_dir()
    wait_for("every process of the run to end", lambda: recorded_processes(run_dir) == [], timeout=60)
    shown = launcher("status", run_dir, env=env).stdout
    assert f"step {status['saved_checkpoint']['step']} on the stop" in shown and "143 (128 + signal 15)" in shown


# --- automatic recovery ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_rank_killed_at_step_5_is_restarted_from_the_checkpoint_and_succeeds(tmp_path, demo_assets):
    restart = {"max_restarts": 2, "backoff_s": 0}
    cfg, env = tiny_config(tmp_path, demo_assets, {"entry": "tests.fault_entry", "restart": restart})
    env["FAULT_SPEC"] = json.dumps({"kill_at_step": 5, "attempt": 1, "rank": 0, "signal": 9})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).parent.parent), env.get("PYTHONPATH")) if p)
    proc = launcher("run", cfg, "--quiet", env=env, timeout=900)
    run_dir = the_run_dir(tmp_path / "runs")
    status = read_status(run_dir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert status["state"] == "SUCCEEDED" and status["attempt"] == 2, status["reason"]
    (first,) = status["attempts"]
    assert first["attempt"] == 1 and first["state"] == "FAILED" and "killed by signal 9" in first["cause"]
    assert first["resumed_step"] == 3 and first["steps_lost"] == first["last_step"] - 3 >= 1
    assert status["resumed_from"] == "output/checkpoint-3"
    assert logged_steps(run_dir)[-1] == 6
    print(f"\nrestart: attempt 1 {first['cause']} after logged step {first['last_step']}, resumed from step "
          f"{first['resumed_step']}, {first['steps_lost']} step(s) lost")  # fmt: skip
    kinds = [e["event"] for e in events(run_dir)]
    assert kinds.count("started") == 2 and "restarting" in kinds and kinds[-1] == "ended"
    shown = launcher("status", run_dir, env=env).stdout
    assert "attempt 1" in shown and "killed by signal 9" in shown


@pytest.mark.slow
def test_a_rank_that_raises_is_not_restarted(tmp_path, demo_assets):
    spec = {"lines": 2, "interval": 0.1, "then": "raise", "message": "bad record in shard 3"}
    cfg, env = fake_config(tmp_path, demo_assets, spec, restart={"max_restarts": 3, "backoff_s": 0})
    proc = launcher("run", cfg, "--quiet", env=env, timeout=600)
    run_dir = the_run_dir(tmp_path / "runs")
    status = read_status(run_dir)
    assert proc.returncode == 1 and status["state"] == "FAILED" and status["attempt"] == 1
    assert status["attempts"] == [] and "bad record in shard 3" in status["reason"]
    (why,) = [e for e in events(run_dir) if e["event"] == "not_restarted"]
    assert "not one a restart gets past" in why["why"]


@pytest.mark.slow
def test_a_crash_loop_ends_after_max_restarts(tmp_path, demo_assets):
    spec = {"lines": 2, "interval": 0.1, "then": "sleep", "checkpoints": 1, "resume": True,
            "ranks": {"1": {"then": "kill", "kill_signal": 9}}}  # fmt: skip
    cfg, env = fake_config(tmp_path, demo_assets, spec, nproc_per_node=2, restart={"max_restarts": 2, "backoff_s": 0})
    proc = launcher("run", cfg, "--quiet", env=env, timeout=600)
    run_dir = the_run_dir(tmp_path / "runs")
    status = read_status(run_dir)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert status["state"] == "FAILED" and status["attempt"] == 3
    assert [a["attempt"] for a in status["attempts"]] == [1, 2]
    assert all("rank 1 killed by signal 9" in a["cause"] for a in status["attempts"])
    assert "not restarted: 2 restart(s) done" in status["reason"]
    assert [e["event"] for e in events(run_dir)].count("restarting") == 2


# --- hang watchdog -------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_frozen_rank_is_stopped_by_the_watchdog_after_a_save_attempt(tmp_path, demo_assets):
    spec = {"lines": 100000, "interval": 0.2, "stall_after": 3, "resume_file": str(tmp_path / "never"),
            "save_on_stop": True, "ignore_sigterm": True}  # fmt: skip
    # 18 s without progress: longer than torchrun and the ranks take to start on a busy 2-core machine
    cfg, env = fake_config(tmp_path, demo_assets, spec, stall_minutes=0.3, stall_action="stop", stop_grace_s=3)
    proc = launcher("run", cfg, "--quiet", env=env, timeout=600)
    run_dir = the_run_dir(tmp_path / "runs")
    status = read_status(run_dir)
    assert proc.returncode != 0 and status["state"] == "FAILED", status
    assert status["reason"].startswith("hang watchdog: no progress for 0.3 min")
    (fired,) = [e for e in events(run_dir) if e["event"] == "stall_action"]
    assert fired["step"] == 3 and fired["action"] == "stop"  # the freeze after step 3, not a slow start
    kinds = [e["event"] for e in events(run_dir)]
    assert kinds.index("stall_action") < kinds.index("stopping") < kinds.index("save_timeout")
    assert "killed_after_grace" in kinds  # it ignored SIGTERM too
    assert [e for e in events(run_dir) if e["event"] == "stopping"][0]["save"] is True
    assert recorded_processes(run_dir) == []


@pytest.mark.parametrize(
    ("state", "how", "retried"),
    [
        ("FAILED", {"failed_rank": {"rank": 3, "signal": 9}}, "rank 3 killed by signal 9 (SIGKILL)"),
        ("FAILED", {"signal": 11}, "the job was killed by signal 11 (SIGSEGV)"),
        ("FAILED", {"reason": "[Rank 5] Watchdog caught collective operation timeout: WorkNCCL(...)"}, "collective"),
        ("FAILED", {"reason": "RuntimeError: HCCL function error: EI0002 ... timeout"}, "collective"),
        ("FAILED", {"reason": "torch.distributed.DistNetworkError: Connection reset by peer"}, "collective"),
        ("FAILED", {"reason": "ValueError: bad record in shard 3"}, None),
        ("FAILED", {"failed_rank": {"rank": 0, "signal": 9}, "stopped": True}, None),
        ("OUT_OF_MEMORY", {"failed_rank": {"rank": 0, "signal": 9}}, None),
        ("FAILED_SETUP", {"reason": "preflight failed: model.weights"}, None),
        ("FAILED_ACCEPTANCE", {}, None),
        ("CANCELLED", {"signal": 15}, None),
    ],
)  # fmt: skip
def test_which_failures_are_retried(state, how, retried):
    from launcher.run.restart import retry_cause
    from launcher.state.states import RunState

    cause = retry_cause(RunState(state), signal=how.get("signal"), failed_rank=how.get("failed_rank"),
                        reason=how.get("reason"), stopped=how.get("stopped", False))  # fmt: skip
    if retried is None:
        assert cause is None
    else:
        assert cause is not None and retried in cause, cause


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"stall_action": "restart"}, "launcher.stall_action: 'restart' needs automatic recovery"),
        ({"stall_action": "kill"}, "launcher.stall_action: Input should be 'warn', 'stop' or 'restart'"),
        ({"restart": {"max_restarts": -1}}, "launcher.restart.max_restarts: Input should be greater than or equal"),
        ({"restart": {"tries": 3}}, "launcher.restart.tries: unknown key; allowed keys: max_restarts, backoff_s"),
        ({"record_write_stop_s": 0}, "launcher.record_write_stop_s: Input should be greater than 0"),
    ],
)  # fmt: skip
def test_bad_recovery_settings_are_refused_naming_the_key(tmp_path, settings, message):
    import yaml

    from launcher.run.config import ConfigError, load_run_config

    model = tmp_path / "model"
    model.mkdir()
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"model_name_or_path": str(model), "launcher": {"smoke": True, **settings}}))
    with pytest.raises(ConfigError) as info:
        load_run_config(cfg)
    assert message in str(info.value)


@pytest.mark.slow
def test_stall_action_restart_resumes_a_frozen_attempt_from_its_checkpoint(tmp_path, demo_assets):
    spec = {"lines": 6, "interval": 0.2, "checkpoints": 2, "resume": True, "then": "exit", "exit_code": 3,
            "attempts": {"1": {"stall_after": 3, "resume_file": str(tmp_path / "never")}}}  # fmt: skip
    cfg, env = fake_config(tmp_path, demo_assets, spec, stall_minutes=0.3, stall_action="restart", stop_grace_s=3,
                           restart={"max_restarts": 1, "backoff_s": 0})  # fmt: skip
    proc = launcher("run", cfg, "--quiet", env=env, timeout=600)
    run_dir = the_run_dir(tmp_path / "runs")
    status = read_status(run_dir)
    assert proc.returncode == 1 and status["state"] == "FAILED" and status["attempt"] == 2, status
    (first,) = status["attempts"]
    assert first["cause"].startswith("hang watchdog") and first["resumed_step"] == 2
    assert first["last_step"] == 3 and first["steps_lost"] == 1
    assert status["failed_rank"]["exit_code"] == 3  # the second attempt ran on to its own end
    assert logged_steps(run_dir)[-1] == 6
