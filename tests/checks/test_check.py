"""A new user's first run: every mistake of a config caught by one `launcher check`, off the server too,
each message naming the key, the value and the fix; and the LLaMA-Factory habits (overrides, --version).

The checks run in-process against the real LLaMA-Factory dataclasses and registries and the tiny demo
model's config.json; the CLI cases run the real `launcher` command.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from launcher.checks.config_check import check_llamafactory
from launcher.checks.config_rules import check_run_config
from launcher.config.run_config import parse_overrides, read_run_config
from tests.support.common import launcher_cmd, make_config


@pytest.fixture(autouse=True)
def _disk_is_not_the_subject(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests count the problems of a config; the free space of the machine running them is not one.
    The seed is a formal run (10 GiB wanted), so a test machine with less free would add an ``output``
    error to every count; the ``output`` row has its own test in test_preflight.py."""
    monkeypatch.setenv("LAUNCHER_MIN_FREE_GIB", "0")


# The seed run's published LLaMA-Factory settings, exactly (this test holds its own copy).
SEED = {
    "stage": "sft",
    "finetuning_type": "lora",
    "lora_rank": 8,
    "lora_alpha": 16,
    "lora_dropout": 0.05,
    "lora_target": "q_proj,k_proj,v_proj,o_proj",
    "template": "qwen3_vl_nothink",
    "cutoff_len": 4096,
    "bf16": True,
    "gradient_checkpointing": True,
    "per_device_train_batch_size": 1,
    "gradient_accumulation_steps": 1,
    "learning_rate": 5.0e-5,
    "lr_scheduler_type": "cosine",
    "warmup_ratio": 0.03,
    "num_train_epochs": 3.0,
    "max_grad_norm": 1.0,
    "save_only_model": True,
    "save_strategy": "steps",
    "save_steps": 100,
    "eval_strategy": "steps",
    "eval_steps": 100,
}


def seed_config(tmp_path: Path, demo_assets: dict[str, Path], **extra) -> Path:
    """The seed's settings plus only what the README asks for: model, data, a launcher section."""
    data = {
        "launcher": {"backend": "cpu", "output_root": str(tmp_path / "runs")},
        "model_name_or_path": str(demo_assets["model"]),
        "dataset_dir": str(demo_assets["data"]),
        "dataset": "demo_counsel_train",
        "eval_dataset": "demo_counsel_eval",
        **SEED,
        **extra,
    }
    path = tmp_path / "seed.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def errors_of(path: Path, **kw) -> list[str]:
    config, problems = read_run_config(path, require_model=kw.pop("require_model", True))
    found = check_run_config(config, problems=problems, devices=False, **kw)
    return [f.message for f in found.errors]


def test_the_seeds_settings_as_published_give_one_message_naming_do_train(tmp_path, demo_assets):
    errors = errors_of(seed_config(tmp_path, demo_assets))
    assert len(errors) == 1, errors
    assert errors[0].startswith("do_train: not set") and "only evaluates" in errors[0]
    assert "do_train: true" in errors[0]
    assert errors_of(seed_config(tmp_path, demo_assets, do_train=True)) == []


def test_every_problem_is_reported_in_one_pass_each_naming_key_value_and_fix(tmp_path, demo_assets):
    path = seed_config(
        tmp_path,
        demo_assets,
        do_train=True,
        learning_rate="fast",
        num_train_epochs="3",
        save_step=100,
        template="qwen35_nothink",
        lora_target="q_proj,no_such_proj",
        flash_attn="fa2",
        dataset="demo_counsel_trian",
    )
    errors = errors_of(path)
    expected = {
        "learning_rate: 'fast' is not a number; write a number such as 5.0e-5": "learning_rate",
        "num_train_epochs: '3' is text, not a number; write it without quotes": "num_train_epochs",
        "save_step: not a LLaMA-Factory argument; did you mean save_steps?": "save_step",
        "template: 'qwen35_nothink' is not a LLaMA-Factory template; close names: qwen3_5_nothink": "template",
        "lora_target: 'no_such_proj' matches no module of this model": "lora_target",
        "flash_attn: fa2 fails with transformers 5.6.0": "flash_attn",
        "demo_counsel_trian: not registered in": "dataset",
    }
    for start in expected:
        assert any(e.startswith(start) for e in errors), (start, errors)
    assert any("close names: demo_counsel_train" in e for e in errors)
    assert any("use flash_attn: sdpa" in e for e in errors)
    assert len(errors) == len(expected), errors


def test_a_bool_written_as_text_and_a_number_in_e_notation_are_named(tmp_path, demo_assets):
    args = {
        "model_name_or_path": str(demo_assets["model"]),
        "do_train": "true",
        "learning_rate": "1e-4",
        "stage": "sft",
        "output_dir": str(tmp_path / "o"),
    }
    errors = [f.message for f in check_llamafactory(args, model=False, data=False).errors]
    assert "do_train: 'true' is text; write true or false without quotes" in errors
    assert any(e.startswith("learning_rate: '1e-4' is text, not a number") and "1.0e-4" in e for e in errors)


def test_an_invalid_launcher_section_does_not_hide_smoke(tmp_path, demo_assets):
    """A smoke run with a bad launcher key reports that key alone, not a formal cutoff error as well."""
    path = make_config(tmp_path, demo_assets, launcher={"smoke": True, "colour": "blue"})
    config, problems = read_run_config(path)
    assert len(problems) == 1 and problems[0].startswith("launcher.colour: unknown key"), problems
    assert config.launcher.smoke is True


def test_reasoning_data_in_a_no_think_template_is_refused(tmp_path, demo_assets):
    data = tmp_path / "data"
    data.mkdir()
    records = [{"instruction": "hi", "input": "", "output": "<think>reasoning</think>answer"}] * 30
    (data / "think.json").write_text(json.dumps(records))
    (data / "dataset_info.json").write_text(json.dumps({"counsel_think": {"file_name": "think.json"}}))
    path = make_config(tmp_path, demo_assets, dataset_dir=str(data), dataset="counsel_think", eval_dataset=None)
    errors = errors_of(path)
    assert len(errors) == 1 and errors[0].startswith("template: qwen3_5_nothink trains without reasoning"), errors
    assert "counsel_think has <think> in 100% of its replies" in errors[0] and "--reasoning drop" in errors[0]


def test_records_of_the_wrong_type_are_named_by_file_index_and_field_without_their_text(tmp_path, demo_assets):
    data = tmp_path / "data"
    data.mkdir()
    secret = "my client told me something private"
    records = [{"instruction": secret, "input": "", "output": "fine"}] * 5
    records[3] = {"instruction": secret, "output": ["not", "text"]}
    (data / "train.json").write_text(json.dumps(records))
    (data / "dataset_info.json").write_text(json.dumps({"counsel": {"file_name": "train.json"}}))
    path = make_config(tmp_path, demo_assets, dataset_dir=str(data), dataset="counsel", eval_dataset=None)
    errors = errors_of(path)
    assert len(errors) == 1, errors
    assert "counsel: 1 of 5 records in" in errors[0] and "train.json" in errors[0]
    assert "record 3 'output' is a list, not text" in errors[0]
    assert secret not in errors[0]


def test_check_runs_off_the_server_for_another_machine_and_counts_what_it_skipped(tmp_path):
    """The formal config on a machine with no NPU, no model, no data and no output folder."""
    cfg = Path(__file__).resolve().parents[2] / "configs" / "qwen3_5_27b_lora_soulchat.yaml"
    proc = launcher_cmd("check", cfg, "--for-another-machine")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    verdict = next(i for i, line in enumerate(lines) if "OK (npu backend, 8 process(es) per node, fsdp2)" in line)
    assert lines[verdict].endswith("; 4 checks not made here:"), lines[verdict]
    skipped = lines[verdict + 1 :]
    assert len(skipped) == 4 and all(line.startswith("skip") for line in skipped), skipped
    for key, value in (
        ("devices", "npu"),
        ("lora_target", "/models/Qwen3.5-27B"),
        ("dataset_dir", "/data"),
        ("launcher.output_root", "/outputs/runs"),
    ):
        assert any(line.split()[1] == f"{key}:" and value in line for line in skipped), (key, skipped)


def test_check_without_the_flag_fails_on_a_data_folder_that_is_not_here(tmp_path):
    cfg = Path(__file__).resolve().parents[2] / "configs" / "qwen3_5_27b_lora_soulchat.yaml"
    proc = launcher_cmd("check", cfg, "--no-model", f"launcher.output_root={tmp_path / 'runs'}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (error,) = [line for line in proc.stdout.splitlines() if line.startswith("ERROR")]
    assert "dataset_dir: '/data' is not a folder on this machine; point dataset_dir at the folder" in error
    assert "--for-another-machine" in error and "OK" not in proc.stdout


def test_check_exits_2_and_lists_each_problem_once(tmp_path, demo_assets):
    path = seed_config(tmp_path, demo_assets)  # no do_train
    proc = launcher_cmd("check", path)
    assert proc.returncode == 2
    assert proc.stdout.count("ERROR") == 1 and "do_train: not set" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr


# --- paths the config names that this machine cannot check ----------------------------------------------

# A folder in which no one can create a file, root included (tests run as root, for whom a chmod does not hold).
UNWRITABLE = Path("/sys")


def findings_of(path: Path, elsewhere: bool):
    config, problems = read_run_config(path, require_model=not elsewhere)
    return check_run_config(config, problems=problems, devices=False, elsewhere=elsewhere)


def test_the_unwritable_folder_of_these_tests_cannot_be_written():
    import tempfile

    assert UNWRITABLE.is_dir()
    with pytest.raises(OSError), tempfile.NamedTemporaryFile(dir=UNWRITABLE):
        pass


@pytest.mark.parametrize(
    ("case", "launcher", "lf", "key", "error", "for_another_machine"),
    [
        (
            "no dataset key, no data folder",
            {},
            {"dataset": None, "eval_dataset": None, "dataset_dir": "MISSING"},
            "dataset",
            "dataset: no dataset named; set dataset: to the name of a dataset registered in",
            "error",
        ),
        (
            "data folder missing",
            {},
            {"dataset_dir": "MISSING"},
            "dataset_dir",
            "dataset_dir: 'MISSING' is not a folder on this machine; point dataset_dir at the folder that holds "
            "dataset_info.json",
            "skipped",
        ),
        (
            "output root not writable",
            {"output_root": str(UNWRITABLE)},
            {},
            "launcher.output_root",
            f"launcher.output_root: {UNWRITABLE} is not writable",
            "error",
        ),
        (
            "output root missing, cannot be made",
            {"output_root": str(UNWRITABLE / "launcher-absent" / "runs")},
            {},
            "launcher.output_root",
            f"launcher.output_root: {UNWRITABLE / 'launcher-absent' / 'runs'} is not writable",
            "skipped",
        ),
        ("model missing", {}, {"model_name_or_path": "MISSING"}, "lora_target", None, "skipped"),
        (
            "model folder here, no config.json",
            {},
            {"model_name_or_path": "EMPTY"},
            "lora_target",
            "lora_target: not checked, EMPTY/config.json is unreadable",
            "error",
        ),
    ],
    ids=[
        "no-dataset",
        "no-dataset-dir",
        "unwritable-output",
        "output-not-makeable",
        "no-model-folder",
        "no-model-config",
    ],
)
def test_a_path_missing_here_fails_unless_the_config_is_for_another_machine(
    tmp_path, demo_assets, case, launcher, lf, key, error, for_another_machine
):
    (tmp_path / "empty").mkdir()
    paths = {"MISSING": str(tmp_path / "absent"), "EMPTY": str(tmp_path / "empty")}
    lf = {k: paths.get(v, v) if isinstance(v, str) else v for k, v in lf.items()}
    for token, value in paths.items():
        error = error and error.replace(token, value)
    path = make_config(tmp_path, demo_assets, launcher=launcher, **lf)
    here = findings_of(path, elsewhere=False)
    if error is not None:
        assert [f.message for f in here.errors if f.key == key and f.message.startswith(error)], (case, here.items)
    else:  # the model folder: read_run_config names it
        assert any(e.message.startswith("model_name_or_path:") for e in here.errors), here.items
    elsewhere = findings_of(path, elsewhere=True)
    mine = [f for f in elsewhere.items if f.key == key and f.level in ("error", "skipped")]
    assert len(mine) == 1 and mine[0].level == for_another_machine, (case, elsewhere.items)
    assert [f.key for f in elsewhere.errors] == ([key] if for_another_machine == "error" else []), elsewhere.items


def test_check_names_each_unusable_path_and_never_says_ok(tmp_path, demo_assets):
    """No dataset key, a data folder that is not here, an output root that exists but cannot be written."""
    path = make_config(
        tmp_path,
        demo_assets,
        launcher={"output_root": str(UNWRITABLE)},
        dataset=None,
        eval_dataset=None,
        dataset_dir=str(tmp_path / "absent"),
    )
    runs = [
        ((), ("dataset", "dataset_dir", "launcher.output_root")),
        (("--for-another-machine",), ("dataset", "launcher.output_root")),
    ]
    for flag, failed in runs:
        proc = launcher_cmd("check", path, *flag)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        errors = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("ERROR")]
        assert errors == [f"{key}:" for key in failed], proc.stdout
        assert "OK" not in proc.stdout and f"{len(failed)} problem(s)" in proc.stdout
        assert ("skip   dataset_dir: not checked" in proc.stdout) == bool(flag), proc.stdout


def test_check_for_another_machine_counts_missing_paths_and_exits_0(tmp_path, demo_assets):
    path = make_config(
        tmp_path,
        demo_assets,
        launcher={"output_root": str(UNWRITABLE / "launcher-absent" / "runs")},
        dataset_dir=str(tmp_path / "absent"),
    )
    proc = launcher_cmd("check", path, "--for-another-machine")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "run.yaml: OK (cpu backend, 1 process(es) per node, ddp, smoke); 3 checks not made here:" in proc.stdout
    skipped = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("skip")]
    assert skipped == ["devices:", "dataset_dir:", "launcher.output_root:"], proc.stdout
    assert "ok     lora_target" in proc.stdout  # the model is here: still checked


def test_check_of_a_valid_config_ends_ok(tmp_path, demo_assets):
    proc = launcher_cmd("check", make_config(tmp_path, demo_assets))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    *_, verdict, skipped = proc.stdout.splitlines()
    expected = f"{tmp_path / 'run.yaml'}: OK (cpu backend, 1 process(es) per node, ddp, smoke); 1 check not made here:"
    assert verdict == expected, proc.stdout
    assert skipped.startswith("skip   devices: not counted here"), proc.stdout
    assert "ERROR" not in proc.stdout and "ok     datasets: demo_counsel_train" in proc.stdout


def test_an_output_root_that_is_a_file_is_one_clear_message(tmp_path, demo_assets):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    path = make_config(tmp_path, demo_assets, launcher={"output_root": str(blocker / "runs")})
    for verb in ("run", "start"):
        proc = launcher_cmd(verb, path)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "Traceback" not in proc.stderr and f"{blocker / 'runs'}" in proc.stderr
        assert "point it at a writable folder" in proc.stderr
    assert blocker.read_text() == "x"


# --- LLaMA-Factory habits ----------------------------------------------------------------------------


def test_overrides_are_read_as_llamafactory_cli_reads_them():
    assert parse_overrides(["learning_rate=1e-4", "max_steps=3", "launcher.smoke=true", "template=qwen3_5"]) == {
        "learning_rate": 1e-4,
        "max_steps": 3,
        "launcher.smoke": True,
        "template": "qwen3_5",
    }
    with pytest.raises(Exception, match="'learning_rate': an override is KEY=VALUE"):
        parse_overrides(["learning_rate"])


@pytest.mark.slow
def test_overrides_apply_to_check_and_are_recorded_in_the_run(tmp_path, demo_assets):
    path = make_config(tmp_path, demo_assets, max_steps=2, save_steps=2, eval_steps=2)
    refused = launcher_cmd("check", path, "do_train=false")
    assert refused.returncode == 2 and "do_train: not set" in refused.stdout
    env_free = launcher_cmd("run", path, "--quiet", "learning_rate=2.0e-3", "launcher.run_name=overridden")
    assert env_free.returncode == 0, env_free.stdout[-2000:] + env_free.stderr[-2000:]
    (run_dir,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    assert run_dir.name.startswith("overridden-")
    assert yaml.safe_load((run_dir / "overrides.yaml").read_text()) == {
        "learning_rate": 2.0e-3,
        "launcher.run_name": "overridden",
    }
    assert yaml.safe_load((run_dir / "llamafactory.yaml").read_text())["learning_rate"] == 2.0e-3
    assert json.loads((run_dir / "manifest.json").read_text())["config"]["overrides"]["learning_rate"] == 2.0e-3


def test_nproc_per_node_comes_from_the_environment_like_the_torchrun_variables(tmp_path, demo_assets, monkeypatch):
    monkeypatch.setenv("NPROC_PER_NODE", "2")
    config, problems = read_run_config(make_config(tmp_path, demo_assets))
    assert problems == [] and config.launcher.nproc_per_node == 2
    assert any("NPROC_PER_NODE" in note for note in config.notes)


def test_version_internal_verbs_and_options_before_run():
    version = launcher_cmd("--version")
    assert version.returncode == 0 and version.stdout.startswith("launcher ")
    wrong = launcher_cmd("stats")
    assert wrong.returncode == 2 and "invalid choice: 'stats'" in wrong.stderr
    assert "_supervise" not in wrong.stderr and "_kernel-check" not in wrong.stderr


def test_status_takes_watch_before_run(tmp_path):
    from tests.support.fake_runs import crafted_run

    run_dir = crafted_run(tmp_path, name="r-20261201-101500", state="FAILED", ended="2026-12-01T10:20:00+00:00")
    proc = launcher_cmd("status", "--watch", run_dir, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "r-20261201-101500" in proc.stdout and "FAILED" in proc.stdout
    assert launcher_cmd("status", "--watch", "x", run_dir, timeout=60).returncode == 2


# --- the data, before a long run -------------------------------------------------------------------------


def _stats(**split):
    base = {
        "samples": 100,
        "records_total": 100,
        "truncated": {"count": 0, "share": 0.0},
        "supervised_tokens": {"before": 1000, "after": 1000, "lost_share": 0.0},
        "no_supervised": {"before": 0, "after": 0},
        "dropped_invalid": 0,
        "length": {"p99": 10, "max": 12},
    }
    return {k: {**base, **v} for k, v in split.items()}


def test_data_problems_are_named_with_their_numbers_and_fix():
    from launcher.data.stats import problems_for

    result = {
        "cutoff_len": 4096,
        "splits": _stats(
            train={
                "supervised_tokens": {"before": 1000, "after": 800, "lost_share": 0.2},
                "no_supervised": {"before": 0, "after": 7},
            },
            validation={"samples": 1, "records_total": 1},
        ),
    }
    found = problems_for(result, warn_share=0.05)
    assert any("train: truncation at cutoff_len 4096 removes 20.0% of the supervised tokens" in p for p in found)
    assert any("train: 7 of 100 sample(s) keep no supervised token" in p and "raise cutoff_len" in p for p in found)
    assert any("validation: 1 sample(s) are too few to select a checkpoint by" in p for p in found)
    assert problems_for({"cutoff_len": 4096, "splits": _stats(train={}, validation={})}, warn_share=0.05) == []


@pytest.mark.parametrize(("smoke", "status"), [(False, "fail"), (True, "warn")])
def test_preflight_refuses_a_formal_run_and_warns_a_smoke_run_on_data_problems(
    tmp_path, demo_assets, monkeypatch, smoke, status
):
    from launcher.checks import preflight
    from launcher.data import stats

    config, _ = read_run_config(make_config(tmp_path, demo_assets, launcher={"smoke": smoke}, cutoff_len=4096))
    result = {
        "cutoff_len": 4096,
        "sampled": 500,
        "splits": _stats(train={"no_supervised": {"before": 0, "after": 3}}),
        "warnings": [],
    }
    result["problems"] = stats.problems_for(result, 0.05)
    monkeypatch.setattr(stats, "short_stats", lambda *a, **k: result)
    name, got, detail = preflight.check_data_stats(config, {})
    assert (name, got) == ("data_stats", status) and "keep no supervised token" in detail


def test_preflight_warns_when_the_trainer_log_would_be_too_sparse_to_watch():
    from types import SimpleNamespace

    from launcher.checks.preflight import logging_warnings

    launcher = SimpleNamespace(nproc_per_node=8, nnodes=1)
    result = {"splits": {"train": {"records_total": 6598}}}
    formal = {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 1, "num_train_epochs": 3.0}
    (warning,) = logging_warnings(formal, result, launcher)
    assert "logging_steps 500" in warning and "2475 planned steps" in warning and "set logging_steps: 49" in warning
    assert logging_warnings({**formal, "logging_steps": 10}, result, launcher) == []


def test_shipped_configs_log_often_enough():
    for cfg in (Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"):
        data = yaml.safe_load(cfg.read_text())
        assert data.get("logging_steps") and int(data["logging_steps"]) <= 10, cfg


# --- advice after a failure ----------------------------------------------------------------------------


def test_a_run_that_never_trained_says_so_and_names_do_train(tmp_path):
    from launcher.results.report import build_report
    from launcher.results.verify import verify_run
    from tests.support.fake_runs import crafted_run

    run_dir = crafted_run(tmp_path, state="FAILED_ACCEPTANCE", exit_code=0, ended="2026-12-01T10:20:00+00:00")
    (run_dir / "llamafactory.yaml").write_text(yaml.safe_dump({"stage": "sft", "eval_strategy": "steps"}))
    (run_dir / "output" / "trainer_log.jsonl").write_text(json.dumps({"current_steps": 0, "eval_loss": 2.0}) + "\n")
    report = verify_run(run_dir, write=False)
    fixes = [c.fix for c in report.failed if c.fix]
    assert fixes and all("do_train is not set" in f or "do_train" in f for f in fixes[:1]), fixes
    assert not any("resume" in f and "launcher resume" in f for f in fixes)
    rep = build_report(run_dir, write=False)
    assert (
        rep.recommended is None and "never trained" in rep.recommended_reason and "do_train" in rep.recommended_reason
    )


def test_logs_show_the_supervisors_own_output_when_the_job_never_started(tmp_path):
    from tests.support.fake_runs import crafted_run

    run_dir = crafted_run(tmp_path, state="FAILED_SETUP", ended="2026-12-01T10:20:00+00:00")
    (run_dir / "supervisor.log").write_text("preflight failed: model.weights\n")
    proc = launcher_cmd("logs", run_dir)
    assert proc.returncode == 0 and "supervisor's own output" in proc.stdout
    assert "preflight failed: model.weights" in proc.stdout


@pytest.mark.parametrize(
    ("launcher", "lf", "expected"),
    [
        (
            {},
            {"compute_accuracy": True},
            "compute_accuracy: true reads the training logits, which "
            "launcher.patches.chunked_loss never builds; remove compute_accuracy or set "
            "launcher.patches.chunked_loss: false",
        ),
        ({}, {"label_smoothing_factor": 0.1}, "label_smoothing_factor: 0.1 reads the training logits"),
        (
            {"patches": {"checkpoint_all_layers": {"memory_budget_gib": 60}}},
            {},
            "memory_budget_gib needs a device that reports its peak memory (cuda, npu); the backend is cpu",
        ),
        (
            {"patches": {"packed_rows": False}},
            {"packing": True},
            "neat_packing: true needs "
            "launcher.patches.packed_rows: without it transformers' DeltaNet layers run a packed row as one sequence",
        ),
        ({"patches": {"deltanet_routing": False}}, {"packing": True}, "needs launcher.patches.deltanet_routing"),
        (
            {},
            {"packing": True, "include_num_input_tokens_seen": "non_padding"},
            "include_num_input_tokens_seen: "
            "non_padding with neat_packing: true: the Trainer counts the tokens seen by summing the attention mask",
        ),
    ],
    ids=[
        "accuracy-needs-logits",
        "label-smoothing",
        "budget-on-cpu",
        "packing-without-the-patch",
        "packing-without-routing",
        "packing-counting-the-mask",
    ],
)
def test_patch_options_that_cannot_work_are_refused_naming_the_key(tmp_path, demo_assets, launcher, lf, expected):
    cfg = make_config(tmp_path, demo_assets, launcher={"backend": "cpu", **launcher}, **lf)
    errors = errors_of(cfg)
    assert any(expected in e for e in errors), errors
    assert len(errors) == 1, errors


@pytest.mark.parametrize(
    ("option", "shown"),
    [
        ({"varlen_attention": "fast"}, "launcher.patches.packed_rows.varlen_attention"),
        ({"device_mask": "yes"}, "launcher.patches.packed_rows.device_mask"),
        ({"unpacked_forward": "on"}, "launcher.patches.packed_rows.unpacked_forward"),
    ],
)
def test_a_bad_packed_rows_option_is_the_one_error_of_a_packing_config(tmp_path, demo_assets, option, shown):
    """The option's own message names the key and the value; the packing rules, which read the patch settings, say
    nothing more while those settings could not be read (they would report every patch as off)."""
    cfg = make_config(
        tmp_path, demo_assets, launcher={"backend": "cpu", "patches": {"packed_rows": option}}, packing=True
    )
    errors = errors_of(cfg)
    assert len(errors) == 1 and shown in errors[0], errors


def test_the_layer_plan_is_accepted_under_fsdp2(tmp_path, demo_assets):
    """The plan is measured inside the model's own forward (patches/planning/meter.py), so FSDP2 takes it too."""
    plan = {
        "distribution": "fsdp2",
        "nproc_per_node": 2,
        "patches": {"checkpoint_all_layers": {"uncheckpointed_layers": 4}},
    }
    assert errors_of(make_config(tmp_path, demo_assets, launcher={"backend": "cpu", **plan})) == []


def test_packing_that_would_let_samples_see_each_other_is_refused(tmp_path, demo_assets):
    fa2 = errors_of(make_config(tmp_path, demo_assets, name="fa2.yaml", neat_packing=True, flash_attn="fa2"))
    assert any(
        "flash_attn: fa2 with neat_packing: LLaMA-Factory 0.9.5 then replaces the Qwen3.5 decoder and "
        "DeltaNet forwards with direct FLA calls"
        in e
        and "use flash_attn: sdpa" in e
        for e in fa2
    ), fa2
    pretraining = errors_of(make_config(tmp_path, demo_assets, name="pt.yaml", packing=True, stage="pt"))
    assert any(
        "packing: true with stage pt: LLaMA-Factory packs stage pt rows as one token stream" in e for e in pretraining
    ), pretraining
    by_default = errors_of(make_config(tmp_path, demo_assets, name="pt-default.yaml", stage="pt"))
    assert any("packing (LLaMA-Factory's default for stage pt) with stage pt" in e for e in by_default), by_default
    dummy = errors_of(
        make_config(tmp_path, demo_assets, {"patches": {"text_only_batches": False}}, name="dummy.yaml", packing=True)
    )
    assert any(
        "needs batches without LLaMA-Factory's dummy image" in e and "text_only_batches is off" in e for e in dummy
    ), dummy
    assert errors_of(make_config(tmp_path, demo_assets, name="ok.yaml", packing=True)) == []


def test_the_media_count_reads_only_datasets_that_map_a_media_column(tmp_path, demo_assets):
    from launcher.checks.data_check import dataset_media

    lf = {"dataset_dir": str(demo_assets["data"]), "dataset": "demo_counsel_train", "eval_dataset": "demo_counsel_eval"}
    assert dataset_media(lf) == {
        "counted": True,
        "images": 0,
        "videos": 0,
        "records": 0,
        "datasets": ["demo_counsel_train", "demo_counsel_eval"],
    }
    records = [
        {
            "messages": [{"role": "user", "content": "<image>hi"}, {"role": "assistant", "content": "ok"}],
            "images": ["a.png"],
        },
        {"messages": [], "images": []},
    ]
    (tmp_path / "mm.json").write_text(json.dumps(records))
    info = {
        "mm": {
            "file_name": "mm.json",
            "formatting": "sharegpt",
            "columns": {"messages": "messages", "images": "images"},
        }
    }
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    found = dataset_media({"dataset_dir": str(tmp_path), "dataset": "mm"})
    assert (found["counted"], found["images"], found["records"]) == (True, 1, 2)
    missing = dataset_media({"dataset_dir": str(tmp_path), "dataset": "nope"})
    assert missing["counted"] is False and "nope: not registered" in missing["why"]
