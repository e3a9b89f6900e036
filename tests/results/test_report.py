"""``launcher report`` and model selection: curves, best checkpoint, overfitting verdict, test split,
the trainer-log reader it rests on, and the ``launcher.early_stopping`` mapping onto LLaMA-Factory.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import yaml

from launcher.checks.config_check import validate_llamafactory_args
from launcher.cli import main
from launcher.config.run_config import ConfigError, load_run_config
from launcher.results.curves import Point, load_curves, overfitting_verdict
from launcher.results.report import build_report
from launcher.state import trainer_log
from launcher.state.runs import LOSS_PNG, REPORT_JSON, REPORT_MD
from tests.support.run_fixtures import EARLY_STOPPING, log_lines, make_run, real_demo_run, write_trainer_log


def train_loss(step: int) -> float:
    """Falling with a little batch-to-batch noise, like a real training loss."""
    return 0.6 + 1.5 * math.exp(-step / 400) + 0.03 * math.sin(step * 1.7)


def overfitting_eval(step: int) -> float:
    """Validation loss: falls to its minimum at step 500, then climbs (the seed run's shape)."""
    return 1.5 - 0.4 * step / 500 if step <= 500 else 1.1 + 0.0004 * (step - 500)


def overfitting_run(tmp_path, name="overfit", **kwargs):
    options = dict(total=1200, eval_steps=100, save_steps=100, train_loss=train_loss, eval_loss=overfitting_eval)
    return make_run(tmp_path, name, **{**options, **kwargs})


# ---- the report on crafted runs -------------------------------------------------------------------------


def test_overfitting_run_picks_step_500_and_says_it_overfits(tmp_path):
    run = overfitting_run(tmp_path)
    report = build_report(run)
    assert report.selection_metric == "eval_loss"
    assert report.best == Point(500, pytest.approx(1.1))
    assert report.best_checkpoint == "output/checkpoint-500"
    assert report.verdict.status == "overfitting"
    assert "7 evaluation(s) after its best at step 500" in report.verdict.message
    assert report.recommended == "output/checkpoint-500"
    md = (run / REPORT_MD).read_text()
    assert "- Best checkpoint: step 500, eval_loss 1.1000 (output/checkpoint-500)" in md
    assert "- Overfitting: overfitting: eval loss has not improved" in md
    assert "**Recommended checkpoint: output/checkpoint-500**" in md
    rows = [line for line in md.splitlines() if line.startswith("| output/checkpoint-")]
    assert len(rows) == 12
    assert rows[4].startswith("| output/checkpoint-500 | 500 | 1.1000 |") and rows[4].endswith("| best, recommended |")
    assert "KiB" in rows[0]  # adapter size
    assert f"![training and eval loss]({LOSS_PNG})" in md
    png = (run / LOSS_PNG).read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    record = json.loads((run / REPORT_JSON).read_text())
    assert record["best"] == {"step": 500, "value": pytest.approx(1.1)}
    assert record["overfitting"]["status"] == "overfitting"


def test_a_trainer_log_alone_is_enough(tmp_path):
    """Only LLaMA-Factory's log (the run died before saving state or checkpoints): same best and verdict."""
    run = tmp_path / "runs" / "log-only"
    train = {s: train_loss(s) for s in range(1, 1201)}
    evals = {s: overfitting_eval(s) for s in range(100, 1201, 100)}
    write_trainer_log(run / "output", log_lines(train, evals, total=2475, done=1200))
    report = build_report(run)
    assert report.best.step == 500 and report.verdict.overfitting
    assert report.checkpoints == [] and report.recommended is None
    assert "no saved checkpoint has an evaluation" in report.recommended_reason


def test_falling_eval_loss_is_not_overfitting(tmp_path):
    run = make_run(
        tmp_path,
        total=1200,
        eval_steps=100,
        save_steps=100,
        train_loss=train_loss,
        eval_loss=lambda s: 1.5 - 0.0003 * s,
    )
    report = build_report(run)
    assert report.best.step == 1200 and report.recommended == "output/checkpoint-1200"
    assert report.verdict.status == "no" and not report.verdict.overfitting


def test_eval_worse_while_training_loss_is_flat_is_a_different_problem(tmp_path):
    run = overfitting_run(tmp_path, train_loss=lambda s: 1.0)
    report = build_report(run)
    assert report.best.step == 500
    assert report.verdict.status == "eval-worse-train-flat" and not report.verdict.overfitting
    assert "did not fall" in report.verdict.message


def test_patience_decides_when_a_rise_counts(tmp_path):
    # best at step 1000 of 1200: two evaluations after it
    run = overfitting_run(tmp_path, eval_loss=lambda s: 2.0 - s / 1000 if s <= 1000 else 1.0 + (s - 1000) / 1000)
    assert build_report(run).verdict.status == "not-yet"  # default patience 3
    assert build_report(run, patience=2).verdict.status == "overfitting"
    # the run's own early-stopping patience is the default when set
    early = overfitting_run(
        tmp_path,
        "early",
        eval_loss=lambda s: 2.0 - s / 1000 if s <= 1000 else 1.0 + s / 1e4,
        lf_extra={"early_stopping_steps": 2},
    )
    assert build_report(early).verdict.status == "overfitting"


def test_best_evaluation_without_a_checkpoint_recommends_the_best_saved_one(tmp_path):
    run = overfitting_run(tmp_path, save_steps=200)  # evaluations every 100: step 500 is never saved
    report = build_report(run)
    assert report.best.step == 500 and report.best_checkpoint is None
    assert report.recommended == "output/checkpoint-600"  # 1.14 beats checkpoint-400's 1.18
    assert "has no saved checkpoint" in report.recommended_reason
    assert "no checkpoint saved at that step" in (run / REPORT_MD).read_text()


def test_held_out_test_split_is_reported_separately_and_never_selects(tmp_path):
    # eval_on_each_dataset: validation "val" selects; "test" is best at step 700 and must not win
    run = overfitting_run(
        tmp_path,
        eval_key="eval_val_loss",
        history_extra=lambda s: {"eval_test_loss": 1.0 + abs(s - 700) / 1000},
        lf_extra={"eval_dataset": "val,test", "eval_on_each_dataset": True, "metric_for_best_model": "val_loss"},
    )
    report = build_report(run)
    assert report.selection_metric == "eval_val_loss"
    assert report.test_metrics == ["eval_test_loss"]
    assert report.best.step == 500 and report.recommended == "output/checkpoint-500"
    md = (run / REPORT_MD).read_text()
    selection, _, held_out = md.partition("## Held-out test split (not used for selection)")
    assert held_out, md
    assert "eval_test_loss" not in selection.split("## Checkpoints")[1]  # the selection table is validation only
    assert "| output/checkpoint-700 | 700 | 1.0000 |" in held_out
    assert "At the recommended checkpoint (step 500): eval_test_loss 1.2000." in held_out
    assert "Selection metric: `eval_val_loss` (validation split)" in md


def test_incomplete_and_temporary_checkpoint_folders_are_ignored(tmp_path):
    run = overfitting_run(tmp_path)
    (run / "output" / "checkpoint-1200" / "trainer_state.json").unlink()  # save interrupted
    (run / "output" / "tmp-checkpoint-1300").mkdir()
    report = build_report(run)
    assert [c.step for c in report.checkpoints][-1] == 1100
    assert any(i.startswith("checkpoint-1200 (incomplete") for i in report.ignored)
    assert any(i.startswith("tmp-checkpoint-1300") for i in report.ignored)


def test_resumed_log_keeps_the_newest_value_of_a_step(tmp_path):
    output = tmp_path / "output"
    first = log_lines({s: 5.0 for s in range(1, 7)}, {6: 5.0}, total=10, done=6)
    second = log_lines({s: 1.0 for s in range(4, 11)}, {6: 1.0, 10: 0.9}, total=10, done=10)
    write_trainer_log(output, first + second)
    curves = load_curves(output)
    assert [p.value for p in curves.train] == [5.0, 5.0, 5.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert curves.evals["eval_loss"] == [Point(6, 1.0), Point(10, 0.9)]


def test_overfitting_verdict_needs_two_evaluations():
    assert overfitting_verdict([Point(1, 1.0)], [Point(1, 1.0)]).status == "unknown"


def test_cli_report_by_run_id(tmp_path, capsys):
    run = overfitting_run(tmp_path)
    assert main(["report", run.name, "--root", str(tmp_path / "runs"), "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "best:        step 500, eval_loss 1.1000 (output/checkpoint-500)" in out
    assert "recommended: output/checkpoint-500" in out and "overfitting: overfitting:" in out
    assert not (run / LOSS_PNG).exists() and (run / REPORT_MD).is_file()
    assert main(["report", "missing", "--root", str(tmp_path / "runs")]) == 2
    assert "run 'missing' not found" in capsys.readouterr().err


# ---- trainer_log.jsonl reader ---------------------------------------------------------------------------


def test_half_written_last_line_is_ignored(tmp_path):
    path = tmp_path / "trainer_log.jsonl"
    path.write_text('{"current_steps": 1, "loss": 2.0}\n{"current_steps": 2, "loss": 1.9}\n{"current_steps": 3, "lo')
    assert trainer_log.read_trainer_log_tail(path, count=5) == [
        {"current_steps": 1, "loss": 2.0},
        {"current_steps": 2, "loss": 1.9},
    ]
    assert trainer_log.read_trainer_log_tail(path) == [{"current_steps": 2, "loss": 1.9}]
    assert [r["current_steps"] for r in trainer_log.iter_trainer_log(path)] == [1, 2]
    # a complete-looking JSON object without its newline is still being written
    path.write_text('{"current_steps": 1}\n{"current_steps": 2}')
    assert trainer_log.read_trainer_log_tail(path) == [{"current_steps": 1}]


def test_tail_of_a_50_mb_log_costs_a_few_kb(tmp_path, monkeypatch):
    path = tmp_path / "trainer_log.jsonl"
    line = json.dumps({"current_steps": 1, "total_steps": 2475, "loss": 1.0, "lr": 5e-5, "epoch": 0.1}) + "\n"
    block = (line * 1000).encode()
    with open(path, "wb") as f:
        while f.tell() < 50 << 20:
            f.write(block)
        f.write(b'{"current_steps": 2475, "total_steps": 2475, "loss": 0.5}\n{"current_steps": 24')
    read = []
    real = trainer_log._read_block
    monkeypatch.setattr(trainer_log, "_read_block", lambda fd, off, size: read.append(size) or real(fd, off, size))
    assert trainer_log.read_trainer_log_tail(path)[-1]["current_steps"] == 2475
    assert sum(read) <= 16 << 10, read


def test_a_last_line_longer_than_a_block_is_skipped_whole(tmp_path):
    path = tmp_path / "trainer_log.jsonl"
    path.write_text('{"current_steps": 7}\n{"current_steps": 8, "note": "' + "x" * 20_000)
    assert trainer_log.read_trainer_log_tail(path, count=3, block=512) == [{"current_steps": 7}]


def test_deleted_and_recreated_log_is_followed(tmp_path):
    path = tmp_path / "trainer_log.jsonl"
    path.write_text('{"current_steps": 40}\n')
    assert trainer_log.read_trainer_log_tail(path) == [{"current_steps": 40}]
    path.unlink()
    assert trainer_log.read_trainer_log_tail(path) == []
    path.write_text('{"current_steps": 1}\n')
    assert trainer_log.read_trainer_log_tail(path) == [{"current_steps": 1}]


# ---- launcher.early_stopping -> LLaMA-Factory -------------------------------------------------------------


def es_config(tmp_path, early_stopping, distribution="ddp", **lf) -> object:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text('{"model_type": "qwen3_5"}')
    data = {
        "launcher": {"backend": "cpu", "distribution": distribution, "early_stopping": early_stopping},
        "model_name_or_path": str(model),
        "stage": "sft",
        "do_train": True,
        "finetuning_type": "lora",
        "lora_target": "q_proj,k_proj,v_proj,o_proj",
        "dataset": "train",
        "eval_dataset": "val",
        "template": "qwen3_5_nothink",
        "cutoff_len": 4096,
        "max_steps": 20,
        "save_strategy": "steps",
        "save_steps": 4,
        "eval_strategy": "steps",
        "eval_steps": 2,
        "save_only_model": True,
        "report_to": "none",
        **lf,
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return load_run_config(path)


def mapped(tmp_path, config):
    return config.llamafactory_args("cpu", tmp_path / "x" / "output")


def test_early_stopping_maps_to_llamafactory_keys_its_parser_accepts(tmp_path):
    args = mapped(tmp_path, es_config(tmp_path, {"patience": 3}))
    assert {
        k: args[k]
        for k in ("early_stopping_steps", "metric_for_best_model", "greater_is_better", "load_best_model_at_end")
    } == {
        "early_stopping_steps": 3,
        "metric_for_best_model": "eval_loss",
        "greater_is_better": False,
        "load_best_model_at_end": True,
    }
    assert validate_llamafactory_args(args) == []
    assert "early_stopping_steps" not in mapped(tmp_path, es_config(tmp_path, None))


def test_early_stopping_with_unaligned_save_and_eval_steps_is_refused_before_training(tmp_path):
    # the launcher refuses it at config load, before LLaMA-Factory's parser would
    with pytest.raises(ConfigError, match="save_steps 3 is not a multiple of eval_steps 2"):
        es_config(tmp_path, {"patience": 3}, save_steps=3, eval_steps=2)


def test_early_stopping_under_fsdp2_keeps_the_best_adapter_in_its_checkpoint(tmp_path):
    # HF's Trainer refuses load_best_model_at_end with FSDP and save_only_model (trainer.py, __init__)
    args = mapped(tmp_path, es_config(tmp_path, {"patience": 2, "metric": "eval_val_loss"}, distribution="fsdp2"))
    assert args["load_best_model_at_end"] is False and args["metric_for_best_model"] == "eval_val_loss"
    assert validate_llamafactory_args(args) == []


@pytest.mark.parametrize(
    ("early", "text"),
    [
        ({"patience": 0}, "launcher.early_stopping.patience"),
        ({"patience": 2, "metric": "eval_accuracy"}, "launcher.early_stopping.metric"),
        ({"patience": 2, "mode": "min"}, "launcher.early_stopping.mode"),
    ],
)
def test_bad_early_stopping_settings_are_named(tmp_path, early, text):
    with pytest.raises(ConfigError) as info:
        es_config(tmp_path, early)
    assert text in str(info.value)


# ---- the real demo run ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_demo_run_report_and_early_stopping_keep_the_best_adapter(tmp_path_factory, demo_assets):
    from safetensors.numpy import load_file

    run = real_demo_run(tmp_path_factory, demo_assets)
    proc = subprocess.run(
        [sys.executable, "-m", "launcher", "report", str(run)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    md = (run / REPORT_MD).read_text()
    state = json.loads((run / "output" / "trainer_state.json").read_text())
    best_step = state["best_global_step"]
    assert f"- Best checkpoint: step {best_step}, eval_loss" in md
    assert (run / LOSS_PNG).read_bytes().startswith(b"\x89PNG")
    # the launcher's early_stopping reached LLaMA-Factory and HF's callback ran
    lf = yaml.safe_load((run / "llamafactory.yaml").read_text())
    assert lf["early_stopping_steps"] == EARLY_STOPPING["patience"] and lf["load_best_model_at_end"] is True
    assert "EarlyStoppingCallback" in state["stateful_callbacks"]
    # and the final adapter at the top of output/ is the best checkpoint's
    final = load_file(str(run / "output" / "adapter_model.safetensors"))
    best = load_file(str(run / "output" / f"checkpoint-{best_step}" / "adapter_model.safetensors"))
    assert final.keys() == best.keys() and all(np.array_equal(final[k], best[k]) for k in final)


def test_the_smoothed_training_loss_follows_the_raw_losses_without_lag():
    """A loss falling 0.01 per step with noise: the smoothed line stays on the trend instead of trailing it
    (a plain EMA of weight 0.9 runs about 0.09 above every raw value there)."""
    from launcher.results.report import _smooth

    trend = [4.0 - 0.01 * i for i in range(400)]
    raw = [t + (0.05 if i % 2 else -0.05) for i, t in enumerate(trend)]
    smoothed = _smooth(raw)
    assert len(smoothed) == len(raw)
    gaps = [s - t for s, t in zip(smoothed, trend, strict=True)][20:-20]  # the ends have one side to average
    assert max(abs(g) for g in gaps) < 0.02, max(gaps, key=abs)
    assert abs(sum(s - r for s, r in zip(smoothed, raw, strict=True)) / len(raw)) < 0.005
