"""``LAUNCHER_OVERRIDES`` (compose's ``TRAIN_OVERRIDES``): KEY=VALUE overrides of any config key for ``launcher run``,
the container's main process. The real ``launcher`` command in a child process; the applied case trains the tiny
model (slow)."""

from __future__ import annotations

import pytest
import yaml

from tests.support.common import launcher_cmd, make_config, only_run_dir, read_jsonl

NAMED = "(set by LAUNCHER_OVERRIDES, compose's TRAIN_OVERRIDES)"


def _no_run_folder(tmp_path) -> bool:
    runs = tmp_path / "runs"  # the lock may live here; no run folder may
    return not runs.exists() or not [p for p in runs.iterdir() if p.is_dir()]


def test_a_bad_launcher_key_is_one_message_naming_where_it_was_set(tmp_path, demo_assets, monkeypatch):
    cfg = make_config(tmp_path, demo_assets)
    monkeypatch.setenv("LAUNCHER_OVERRIDES", "max_steps=3 launcher.stop_grace=30")
    proc = launcher_cmd("run", cfg)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "launcher.stop_grace: unknown key; did you mean launcher.stop_grace_s? (allowed keys: " in proc.stderr
    assert proc.stderr.rstrip().endswith(NAMED) and "Traceback" not in proc.stderr, proc.stderr
    assert _no_run_folder(tmp_path)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "'max_steps=3",
            "error: LAUNCHER_OVERRIDES (compose's TRAIN_OVERRIDES)=\"'max_steps=3\": No closing quotation",
        ),
        (
            "max_steps",
            "error: LAUNCHER_OVERRIDES (compose's TRAIN_OVERRIDES): 1 problem(s):\n  - 'max_steps': an "
            "override is KEY=VALUE",
        ),
    ],
)
def test_a_malformed_value_is_one_message(tmp_path, demo_assets, monkeypatch, value, message):
    monkeypatch.setenv("LAUNCHER_OVERRIDES", value)
    proc = launcher_cmd("run", make_config(tmp_path, demo_assets))
    assert proc.returncode == 2 and proc.stderr.startswith(message), proc.stderr
    assert _no_run_folder(tmp_path)


def test_overrides_with_a_resume_are_refused(tmp_path, demo_assets, monkeypatch):
    """A resume runs the run's own config and overrides: new ones would be dropped without a word."""
    monkeypatch.setenv("LAUNCHER_OVERRIDES", "max_steps=3")
    monkeypatch.setenv("LAUNCHER_RESUME", "some-run")
    proc = launcher_cmd("run", make_config(tmp_path, demo_assets))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("error: LAUNCHER_OVERRIDES (compose's TRAIN_OVERRIDES) and LAUNCHER_RESUME")
    assert "resuming" not in proc.stdout and _no_run_folder(tmp_path)


@pytest.mark.slow
def test_overrides_apply_are_recorded_and_a_bad_llamafactory_key_is_named(tmp_path, demo_assets, monkeypatch):
    cfg = make_config(tmp_path, demo_assets, max_steps=6, save_steps=2, eval_steps=2)
    monkeypatch.setenv("LAUNCHER_OVERRIDES", "max_step=2")
    proc = launcher_cmd("run", cfg)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"max_step: not a LLaMA-Factory argument; did you mean max_steps? {NAMED}" in proc.stderr, proc.stderr
    assert _no_run_folder(tmp_path)
    # the command line's overrides win over the environment's
    monkeypatch.setenv("LAUNCHER_OVERRIDES", "max_steps=2 launcher.stop_grace_s=30 save_steps=9")
    proc = launcher_cmd("run", cfg, "save_steps=1", "--quiet")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run = only_run_dir(tmp_path / "runs")
    assert yaml.safe_load((run / "overrides.yaml").read_text()) == {
        "max_steps": 2,
        "launcher.stop_grace_s": 30,
        "save_steps": 1,
    }
    steps = [r["current_steps"] for r in read_jsonl(run / "output" / "trainer_log.jsonl") if "loss" in r]
    assert steps[-1] == 2 and (run / "output" / "checkpoint-1").is_dir()
