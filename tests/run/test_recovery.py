"""Save on stop, automatic recovery and the hang watchdog, with real processes.

The tiny real model trains for the save on stop and for a restart after a rank is killed (a Trainer
callback of ``tests.support.fault_entry`` kills it at a chosen step); fake ranks under the real torchrun
(tests/support/fake_rank.py) stand for the failures that a real model cannot be made to have on demand here:
a rank that raises, a crash loop, a rank that freezes.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.support.common import make_config, read_jsonl
from tests.support.fake_runs import (
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
    settings = {
        "max_steps": 6,
        "save_steps": 3,
        "save_only_model": False,
        "eval_strategy": "no",
        "eval_dataset": None,
        "eval_steps": None,
        "per_device_eval_batch_size": None,
        **lf,
    }
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
    cfg, env = tiny_config(
        tmp_path, demo_assets, {"nproc_per_node": 2, "stop_grace_s": 300}, max_steps=10, save_steps=1000
    )
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


def started_saving_run(tmp_path: Path, demo_assets) -> tuple[Path, dict[str, str], list]:
    """A started run of fake ranks that honour the save on stop, once the job has announced it: its folder,
    the environment and the ranks."""
    cfg, env = fake_config(tmp_path, demo_assets, {"lines": 100000, "interval": 0.2, "save_on_stop": True})
    started = launcher("start", cfg, env=env, timeout=300)
    assert started.returncode == 0, started.stdout + started.stderr
    run_dir = the_run_dir(tmp_path / "runs")
    ranks = rank_processes(run_dir, 1)
    wait_for("the job to announce its save on stop", lambda: (run_dir / "save_on_stop.json").exists())
    return run_dir, env, ranks


@pytest.mark.slow
def test_stop_now_skips_the_save(tmp_path, demo_assets):
    run_dir, env, _ = started_saving_run(tmp_path, demo_assets)
    stopped = launcher("stop", run_dir, "--now", env=env, timeout=180)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    status = read_status(run_dir)
    assert status["state"] == "CANCELLED" and status["saved_checkpoint"] is None
    assert not list((run_dir / "output").glob("checkpoint-*")) and not (run_dir / "save_request.json").exists()
    assert "launcher stop" in status["stopped_by"] and status["run_exit_code"] == 143
    assert [e for e in events(run_dir) if e["event"] == "stopping"][0]["save"] is False


@pytest.mark.slow
def test_stop_saves_through_the_protocol_and_the_record_names_the_step(tmp_path, demo_assets):
    run_dir, env, _ = started_saving_run(tmp_path, demo_assets)
    stopped = launcher("stop", run_dir, env=env, timeout=180)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    status = read_status(run_dir)
    assert status["state"] == "CANCELLED" and status["saved_checkpoint"]["step"] >= 1
    assert (run_dir / status["saved_checkpoint"]["path"]).is_dir()
    wait_for("every process of the run to end", lambda: recorded_processes(run_dir) == [], timeout=60)
    shown = launcher("status", run_dir, env=env).stdout
    assert f"step {status['saved_checkpoint']['step']} on the stop" in shown and "143 (128 + signal 15)" in shown


@pytest.mark.slow
def test_stop_of_a_run_whose_supervisor_is_lost_saves_through_the_protocol_then_cleans_up(tmp_path, demo_assets):
    import psutil

    from tests.support.fake_runs import alive, status_json

    run_dir, env, ranks = started_saving_run(tmp_path, demo_assets)
    torchrun = psutil.Process(read_status(run_dir)["job_pid"])
    supervisor = psutil.Process(read_status(run_dir)["supervisor"]["pid"])
    supervisor.kill()  # the OOM killer, or a `kill -9` by mistake: the job trains on, unsupervised
    wait_for("the supervisor to be gone", lambda: not alive(supervisor))
    assert status_json(run_dir, env)["state"] == "SUPERVISOR_LOST"
    stopped = launcher("stop", run_dir, env=env, timeout=180)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert "the supervisor is gone; the job saves a checkpoint at the next step" in stopped.stdout
    status = read_status(run_dir)
    saved = status["saved_checkpoint"]
    assert status["state"] == "SUPERVISOR_LOST" and saved is not None, status["reason"]
    assert (run_dir / saved["path"] / "adapter_model.safetensors").is_file() and saved["optimizer_state"] is True
    assert max(logged_steps(run_dir)) - 1 <= saved["step"]  # at most one step behind the log
    assert f"checkpoint {saved['path']} saved at step {saved['step']} on the stop" in status["reason"]
    assert "killed after the grace period" not in status["reason"]  # it exited by itself after the save
    assert "launcher stop (pid" in status["stopped_by"]
    assert not any(alive(p) for p in [torchrun, *ranks])
    kinds = [e["event"] for e in events(run_dir)]
    assert kinds.index("stopping") < kinds.index("ended") < kinds.index("cleanup") and "save_timeout" not in kinds
    assert [e for e in events(run_dir) if e["event"] == "stopping"][0]["save"] is True
    shown = launcher("status", run_dir, env=env).stdout
    assert f"step {saved['step']} on the stop" in shown


# --- automatic recovery ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_rank_killed_at_step_5_is_restarted_from_the_checkpoint_and_succeeds(tmp_path, demo_assets):
    restart = {"max_restarts": 2, "backoff_s": 0}
    cfg, env = tiny_config(tmp_path, demo_assets, {"entry": "tests.support.fault_entry", "restart": restart})
    env["FAULT_SPEC"] = json.dumps({"kill_at_step": 5, "attempt": 1, "rank": 0, "signal": 9})
    here = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
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
    print(
        f"\nrestart: attempt 1 {first['cause']} after logged step {first['last_step']}, resumed from step "
        f"{first['resumed_step']}, {first['steps_lost']} step(s) lost"
    )
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
    spec = {
        "lines": 2,
        "interval": 0.1,
        "then": "sleep",
        "checkpoints": 1,
        "resume": True,
        "ranks": {"1": {"then": "kill", "kill_signal": 9}},
    }
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
    spec = {
        "lines": 100000,
        "interval": 0.2,
        "stall_after": 3,
        "resume_file": str(tmp_path / "never"),
        "save_on_stop": True,
        "ignore_sigterm": True,
    }
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


@pytest.mark.slow
def test_the_watchdog_counts_from_the_first_logged_step_not_through_a_long_model_load(tmp_path, demo_assets):
    """A rank that loads for longer than ``stall_minutes`` before its first step is not a hang; a freeze after
    its steps still is. Waits for heartbeats, not for time: the record's heartbeat is rewritten at least every
    10 s, so two new heartbeats mean more than the 3 s stall limit has passed during the load."""
    loaded = tmp_path / "loaded"
    spec = {
        "lines": 100000,
        "interval": 0.2,
        "loaded_file": str(loaded),
        "stall_after": 3,
        "resume_file": str(tmp_path / "never"),
        "save_on_stop": True,
    }
    cfg, env = fake_config(tmp_path, demo_assets, spec, stall_minutes=0.05, stall_action="stop", stop_grace_s=3)
    supervisor = launcher_bg("run", cfg, "--quiet", env=env, log=tmp_path / "run.out")
    try:
        run_dir = wait_for_run_dir(tmp_path / "runs")
        first = wait_for(
            "the job running",
            lambda: read_status(run_dir).get("heartbeat") if read_status(run_dir)["state"] == "RUNNING" else None,
            timeout=240,
        )
        seen = {first}
        wait_for(
            "two more heartbeats during the load",
            lambda: seen.add(read_status(run_dir).get("heartbeat")) or len(seen) >= 3,
            timeout=120,
        )
        assert read_status(run_dir)["state"] == "RUNNING"
        assert "stall_action" not in [e["event"] for e in events(run_dir)]
        loaded.touch()
        assert supervisor.wait(timeout=600) != 0
    finally:
        kill_all(processes_naming(str(tmp_path)))
    status = read_status(run_dir)
    assert status["state"] == "FAILED" and status["reason"].startswith("hang watchdog: no progress for 0.05 min")
    (fired,) = [e for e in events(run_dir) if e["event"] == "stall_action"]
    assert fired["step"] == 3  # the freeze after step 3


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
)
def test_which_failures_are_retried(state, how, retried):
    from launcher.run.restart import retry_cause
    from launcher.state.states import RunState

    cause = retry_cause(
        RunState(state),
        signal=how.get("signal"),
        failed_rank=how.get("failed_rank"),
        reason=how.get("reason"),
        stopped=how.get("stopped", False),
    )
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
)
def test_bad_recovery_settings_are_refused_naming_the_key(tmp_path, settings, message):
    import yaml

    from launcher.config.run_config import ConfigError, load_run_config

    model = tmp_path / "model"
    model.mkdir()
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"model_name_or_path": str(model), "launcher": {"smoke": True, **settings}}))
    with pytest.raises(ConfigError) as info:
        load_run_config(cfg)
    assert message in str(info.value)


@pytest.mark.slow
def test_stall_action_restart_resumes_a_frozen_attempt_from_its_checkpoint(tmp_path, demo_assets):
    spec = {
        "lines": 6,
        "interval": 0.2,
        "checkpoints": 2,
        "resume": True,
        "then": "exit",
        "exit_code": 3,
        "attempts": {"1": {"stall_after": 3, "resume_file": str(tmp_path / "never")}},
    }
    cfg, env = fake_config(
        tmp_path,
        demo_assets,
        spec,
        stall_minutes=0.3,
        stall_action="restart",
        stop_grace_s=3,
        restart={"max_restarts": 1, "backoff_s": 0},
    )
    proc = launcher("run", cfg, "--quiet", env=env, timeout=600)
    run_dir = the_run_dir(tmp_path / "runs")
    status = read_status(run_dir)
    assert proc.returncode == 1 and status["state"] == "FAILED" and status["attempt"] == 2, status
    (first,) = status["attempts"]
    assert first["cause"].startswith("hang watchdog") and first["resumed_step"] == 2
    assert first["last_step"] == 3 and first["steps_lost"] == 1
    assert status["failed_rank"]["exit_code"] == 3  # the second attempt ran on to its own end
    assert logged_steps(run_dir)[-1] == 6


# --- pace and ETA after a resume --------------------------------------------------------------------------------


def _lf_line(step: int, total: int, elapsed_s: int, tokens: int) -> dict:
    """A training line as LLaMA-Factory 0.9.5's LogCallback writes it, with its own (cumulative) figures."""
    from datetime import timedelta

    return {
        "current_steps": step,
        "total_steps": total,
        "loss": 1.0,
        "lr": 1e-4,
        "epoch": step / total,
        "percentage": round(100 * step / total, 2),
        "elapsed_time": str(timedelta(seconds=elapsed_s)),
        "remaining_time": str(timedelta(seconds=int((total - step) * elapsed_s / step))),
        "throughput": round(tokens / elapsed_s, 2),
        "total_tokens": tokens,
    }


@pytest.mark.parametrize("days", [0, 2], ids=["hours", "past-a-day"])
def test_pace_and_eta_after_a_resume_are_measured_from_the_resume_point(tmp_path, days):
    """Attempt 1 ran 120 steps at 10 s a step; attempt 2 resumed from checkpoint-100 and runs at 20 s a
    step (10,000 tokens a step: 500 tokens/s). LLaMA-Factory's elapsed time restarts with attempt 2 while
    its step and token counts do not, so its own throughput and remaining time are wrong."""
    from launcher.monitor.status import _eta, collect
    from tests.support.fake_runs import write_record

    total, since, per_step = 1000, 100, 20
    offset = days * 86400  # a long attempt: LLaMA-Factory then writes "2 days, 1:02:03"
    run_dir = tmp_path / "runs" / "r-20261130-101500"
    ckpt = run_dir / "output" / f"checkpoint-{since}"
    ckpt.mkdir(parents=True)
    state = {"global_step": since, "num_input_tokens_seen": since * 10_000}
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    lines = [_lf_line(s, total, s * 10, s * 10_000) for s in range(1, 121)]  # attempt 1, then a kill at 120
    lines += [_lf_line(s, total, offset + (s - since) * per_step, s * 10_000) for s in range(since + 1, 131)]
    (run_dir / "output" / "trainer_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    write_record(
        run_dir,
        run_id=run_dir.name,
        state="CANCELLED",
        attempt=2,
        resumed_from=f"output/checkpoint-{since}",
        progress={"first_step": since + 1, "step": 130, "total_steps": total},
    )

    info = collect(run_dir)
    pace = info["pace"]
    elapsed = offset + 30 * per_step
    assert pace["since_step"] == since and pace["steps"] == 30 and pace["elapsed_s"] == elapsed
    assert pace["s_per_step"] == pytest.approx(elapsed / 30)
    assert pace["tokens_per_s"] == pytest.approx(30 * 10_000 / elapsed)
    wrong = lines[-1]["throughput"]  # LLaMA-Factory's: 1.3 M tokens over this attempt's time
    assert wrong > 2 * pace["tokens_per_s"]
    eta = _eta(lines[-1], pace)
    assert eta == pytest.approx((total - 130) * elapsed / 30)
    if not days:
        assert pace["s_per_step"] == 20 and pace["tokens_per_s"] == 500
        shown = launcher("status", run_dir, timeout=60).stdout
        assert "pace        20 s/step, 500 tokens/s (30 step(s) in 0:10:00 since step 100)" in shown, shown

    # the attempt has not logged yet (the record's first step is attempt 1's): no pace rather than a wrong one
    write_record(
        run_dir,
        run_id=run_dir.name,
        state="CANCELLED",
        attempt=2,
        resumed_from=f"output/checkpoint-{since}",
        progress={"first_step": 1, "step": 120, "total_steps": total},
    )
    with open(run_dir / "output" / "trainer_log.jsonl", "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in lines[:120]))
    assert collect(run_dir)["pace"] is None


SIGTERM_PROBE = r"""
import sys, time
from pathlib import Path
from launcher.rank import stopsave
stopsave.install_sigterm_handler(Path(sys.argv[1]))
stopsave._TRAINING = True  # as on_train_begin sets it
print("ready", flush=True)
deadline = time.monotonic() + 120
while time.monotonic() < deadline:  # a training step that takes long; the handler runs between bytecodes
    if stopsave._SIGNALLED:
        print("save requested", flush=True)
        sys.exit(0)
    time.sleep(0.01)
sys.exit(3)
"""


@pytest.mark.parametrize("now", [False, True], ids=["stop", "stop-now"])
def test_one_sigterm_during_training_asks_for_a_save_unless_stop_now_sent_it(tmp_path, now):
    """One SIGTERM reaches a training rank (real process, real signal; whether torchrun forwards a second one
    depends on timing, so exactly one is the case to hold): after `launcher stop` it is a request to save at the
    next step; after `launcher stop --now` (its request in the run folder says so) the rank dies of it."""
    import subprocess
    import sys

    from launcher.state.stop import request_stop
    from tests.support.common import REPO

    request_stop(tmp_path, None, by="launcher stop (test)", now=now)
    proc = subprocess.Popen(
        [sys.executable, "-c", SIGTERM_PROBE, str(tmp_path)],
        cwd=REPO,
        text=True,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    rest = proc.stdout.read()
    code = proc.wait(timeout=120)
    if now:
        assert code == -signal.SIGTERM and "save requested" not in rest
    else:
        assert code == 0 and "save requested" in rest


# --- the one rule for "can this job save?" (state/stop.py), used by the supervisor and by `stop` ----------------


@pytest.mark.parametrize(
    ("announced_by", "state", "can"),
    [
        ("live rank", "RUNNING", True),
        ("live rank", "STALLED", True),  # a save is asked for; a frozen job is killed after the grace
        ("live rank", "FINISHING", False),  # no step end left to save at
        ("dead rank", "RUNNING", False),  # an earlier attempt's announcement, or a rank that has died since
        ("nobody", "RUNNING", False),  # a custom entry without the callback
        ("no pid", "RUNNING", False),
    ],
)
def test_a_job_can_save_when_a_live_rank_announced_it_and_steps_are_left(tmp_path, announced_by, state, can):
    from launcher.state.runs import SAVE_READY
    from launcher.state.states import RunState
    from launcher.state.stop import announce_save, job_can_save

    rank = os.getpid()  # stands for the job's local rank 0
    if announced_by == "live rank":
        announce_save(tmp_path, step=3)
    elif announced_by == "dead rank":
        (tmp_path / SAVE_READY).write_text(json.dumps({"pid": 2**22 + 1, "time": time.time(), "step": 3}))
    elif announced_by == "no pid":
        (tmp_path / SAVE_READY).write_text(json.dumps({"time": time.time(), "step": 3}))
    assert job_can_save(tmp_path, RunState(state), [1, rank]) is can
    assert job_can_save(tmp_path, RunState(state), []) is False  # no live process of the job: nothing can save


def test_the_save_files_round_trip_and_a_new_attempt_clears_them(tmp_path):
    from launcher.state.stop import (
        StopRequest,
        ask_to_save,
        clear_save_files,
        clear_stop_request,
        read_saved,
        read_stop_request,
        record_saved,
        request_stop,
        save_asked,
        saved_checkpoint,
        skips_save,
    )

    request_stop(tmp_path, 5.0, by="launcher stop (test)", now=True)
    request = read_stop_request(tmp_path)
    assert request is not None and request.grace_s == 5.0 and request.by == "launcher stop (test)"
    assert skips_save(request) and not skips_save(None) and not skips_save(StopRequest(now=False))
    clear_stop_request(tmp_path)
    assert read_stop_request(tmp_path) is None
    assert not save_asked(tmp_path)
    ask_to_save(tmp_path, "received SIGTERM")
    assert save_asked(tmp_path)
    record_saved(tmp_path, 4, signalled=False)
    saved = read_saved(tmp_path)
    assert saved is not None and saved.step == 4 and saved.path == "output/checkpoint-4"
    assert saved_checkpoint(tmp_path, saved) is None  # no complete checkpoint-4 on disk
    ask_to_save(tmp_path, "launcher stop; the supervisor is gone", anew=True)  # forgets the save recorded before
    assert read_saved(tmp_path) is None and save_asked(tmp_path)
    clear_save_files(tmp_path)
    assert not save_asked(tmp_path) and not list(tmp_path.iterdir())
