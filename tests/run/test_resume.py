"""`launcher resume`: which runs may continue, from which checkpoint, and how (exact or adapter-only)."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from launcher.errors import LauncherError
from tests.support.common import EMPTY_SAFETENSORS, launcher_cmd, make_config, only_run_dir, read_jsonl
from tests.support.fake_runs import planned_resume, write_record


def crafted_run(tmp_path, state: str, checkpoints: dict[int, bool]):
    """A run folder in ``state`` with ``checkpoint-N`` folders (True: with optimizer/scheduler state)."""
    run_dir = tmp_path / "run"
    (run_dir / "output").mkdir(parents=True)
    write_record(run_dir, state=state)
    for step, exact in checkpoints.items():
        ckpt = run_dir / "output" / f"checkpoint-{step}"
        ckpt.mkdir()
        (ckpt / "adapter_model.safetensors").write_bytes(EMPTY_SAFETENSORS)
        (ckpt / "adapter_config.json").write_text("{}")
        (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        if exact:
            (ckpt / "optimizer.pt").write_bytes(b"o")
            (ckpt / "scheduler.pt").write_bytes(b"s")
    return run_dir


def test_adapter_only_checkpoint_needs_the_flag(tmp_path):
    run_dir = crafted_run(tmp_path, "CANCELLED", {2: False, 4: False})
    with pytest.raises(LauncherError, match="--adapter-only") as info:
        planned_resume(run_dir, adapter_only=False)
    assert "optimizer and the learning-rate schedule restart" in str(info.value)
    plan = planned_resume(run_dir, adapter_only=True)
    assert plan.mode == "adapter-only" and plan.step == 4


def test_exact_resume_takes_the_newest_complete_checkpoint(tmp_path):
    run_dir = crafted_run(tmp_path, "FAILED", {2: True, 4: True})
    (run_dir / "output" / "checkpoint-4" / "trainer_state.json").unlink()  # partial: being written
    plan = planned_resume(run_dir, adapter_only=False)
    assert plan.mode == "exact" and plan.step == 2


@pytest.mark.parametrize(
    ("state", "checkpoints", "message"),
    [
        ("SUCCEEDED", {2: True}, "only stopped or failed runs are resumed"),
        ("CANCELLED", {}, "has no complete checkpoint"),
    ],
)
def test_runs_that_cannot_resume_are_refused(tmp_path, state, checkpoints, message):
    with pytest.raises(LauncherError, match=message):
        planned_resume(crafted_run(tmp_path, state, checkpoints), adapter_only=True)


def test_cli_refusal_is_one_line_and_exit_2(tmp_path):
    run_dir = crafted_run(tmp_path, "SUCCEEDED", {2: True})
    proc = launcher_cmd("resume", run_dir)
    assert proc.returncode == 2 and proc.stderr.startswith("error: run run ended SUCCEEDED")


def test_launcher_run_with_launcher_resume_resumes_that_run_instead(tmp_path, monkeypatch):
    """compose's RESUME_RUN: `launcher run CONFIG` resumes the named run (here refused: it SUCCEEDED, and a bad
    LAUNCHER_RESUME_ADAPTER_ONLY is one message) and starts no new run."""
    run_dir = crafted_run(tmp_path, "SUCCEEDED", {2: True})
    monkeypatch.setenv("LAUNCHER_RESUME", str(run_dir))
    proc = launcher_cmd("run", "configs/demo_cpu.yaml")
    assert proc.returncode == 2 and proc.stderr.startswith("error: run run ended SUCCEEDED"), proc.stderr
    assert f"LAUNCHER_RESUME={run_dir}: resuming that run instead of starting a new one" in proc.stdout
    monkeypatch.setenv("LAUNCHER_RESUME_ADAPTER_ONLY", "yes")
    proc = launcher_cmd("run", "configs/demo_cpu.yaml")
    assert proc.returncode == 2 and proc.stderr.startswith("error: LAUNCHER_RESUME_ADAPTER_ONLY='yes': expected 1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


@pytest.mark.slow
def test_a_stopped_run_resumes_exactly_as_a_new_attempt(tmp_path, demo_assets):
    """A real run whose end is cut back to 'cancelled after step 2', resumed through the CLI."""
    cfg = make_config(tmp_path, demo_assets, max_steps=4, save_steps=2, eval_steps=2, save_only_model=False)
    assert launcher_cmd("run", cfg, "--quiet").returncode == 0
    run_dir = only_run_dir(tmp_path / "runs")
    # as if `launcher stop` had ended it after the checkpoint at step 2
    shutil.rmtree(run_dir / "output" / "checkpoint-4")
    log = run_dir / "output" / "trainer_log.jsonl"
    log.write_text("".join(line + "\n" for line in log.read_text().splitlines()[:3]))
    status = json.loads((run_dir / "status.json").read_text())
    (run_dir / "status.json").write_text(json.dumps({**status, "state": "CANCELLED"}))  # SUCCEEDED is final

    proc = launcher_cmd("resume", run_dir, "--foreground")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "(step 2, exact)" in proc.stdout
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "SUCCEEDED" and status["attempt"] == 2 and status["resume_mode"] == "exact"
    args = yaml.safe_load((run_dir / "llamafactory.attempt2.yaml").read_text())
    assert args["resume_from_checkpoint"].endswith("checkpoint-2")
    steps = [r["current_steps"] for r in read_jsonl(log) if "loss" in r]
    assert steps[-1] == 4 and 3 in steps  # attempt 2 trained steps 3 and 4 only
    assert [e["event"] for e in read_jsonl(run_dir / "events.jsonl")].count("resumed") == 1
