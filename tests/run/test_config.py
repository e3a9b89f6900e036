"""Run-config validation: the launcher section (pydantic), our formal rules, LLaMA-Factory's parser."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from launcher.checks.config_check import validate_llamafactory_args
from launcher.config.run_config import ConfigError, load_run_config
from tests.support.common import make_config

# The seed's formal LLaMA-Factory settings, verbatim from the design brief.
SEED_FORMAL = """
stage: sft
finetuning_type: lora
lora_rank: 8
lora_alpha: 16
lora_dropout: 0.05
lora_target: q_proj,k_proj,v_proj,o_proj
template: qwen3_vl_nothink
cutoff_len: 4096
bf16: true
gradient_checkpointing: true
per_device_train_batch_size: 1
gradient_accumulation_steps: 1
learning_rate: 5.0e-5
lr_scheduler_type: cosine
warmup_ratio: 0.03
num_train_epochs: 3.0
max_grad_norm: 1.0
save_only_model: true
save_strategy: steps
save_steps: 100
eval_strategy: steps
eval_steps: 100
"""


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "qwen3_5"}')
    return path


def write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_seed_formal_config_is_expressible_unchanged(tmp_path, model_dir):
    lf = yaml.safe_load(SEED_FORMAL)
    data = {
        **lf,
        "model_name_or_path": str(model_dir),
        "dataset": "soulchat_r1_nothink",
        "dataset_dir": str(tmp_path),
        "do_train": True,
        "launcher": {"backend": "cpu", "nproc_per_node": 8, "distribution": "fsdp2"},
    }
    config = load_run_config(write(tmp_path, data))
    for key, value in lf.items():
        assert config.llamafactory[key] == value
    assert config.launcher.smoke is False
    args = config.llamafactory_args("cpu", tmp_path / "x" / "output")
    assert validate_llamafactory_args(args) == []


def test_every_problem_is_reported_at_once_naming_its_key(tmp_path):
    data = {
        "cutoff_len": 1024,
        "model_name_or_path": str(tmp_path / "absent"),
        "launcher": {"backend": "tpu", "nproc_per_node": 0, "colour": "blue"},
    }
    with pytest.raises(ConfigError) as info:
        load_run_config(write(tmp_path, data))
    text = str(info.value)
    for needle in (
        "launcher.backend",
        "launcher.nproc_per_node",
        "launcher.colour: unknown key",
        "cutoff_len: 1024 is below 4096",
        "launcher.smoke: true",
        "model_name_or_path",
        "is not a folder here",
    ):
        assert needle in text, (needle, text)
    assert len(info.value.problems) == 5


def test_short_cutoff_is_allowed_and_recorded_for_smoke_runs(tmp_path, model_dir):
    data = {"cutoff_len": 128, "model_name_or_path": str(model_dir), "launcher": {"smoke": True}}
    config = load_run_config(write(tmp_path, data))
    assert config.launcher.smoke is True


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_run_config(tmp_path / "nope.yaml")


def test_not_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_run_config(path)


def test_bad_run_name(tmp_path, model_dir):
    data = {"model_name_or_path": str(model_dir), "launcher": {"smoke": True, "run_name": "../escape"}}
    with pytest.raises(ConfigError, match="launcher.run_name"):
        load_run_config(write(tmp_path, data))


def test_output_dir_is_owned_by_the_launcher(tmp_path, model_dir):
    data = {"model_name_or_path": str(model_dir), "output_dir": "saves/x", "launcher": {"smoke": True}}
    config = load_run_config(write(tmp_path, data))
    assert "output_dir" not in config.llamafactory
    assert any("output_dir" in note and "ignored" in note for note in config.notes)
    args = config.llamafactory_args("cpu", tmp_path / "r" / "output")
    assert args["output_dir"] == str(tmp_path / "r" / "output")
    assert args["use_cpu"] is True


def test_lora_targets_are_checked_against_the_models_modules(demo_assets):
    """From the model's config.json alone: what each target matches, a note when no DeltaNet projection is
    adapted, and an error for a target that matches nothing (no such note for it)."""
    from launcher.checks.config_check import Findings, check_lora_target

    def findings(target: str) -> list:
        out = Findings()
        check_lora_target({"model_name_or_path": str(demo_assets["model"]), "lora_target": target}, out, model=True)
        return out.items

    qv = findings("q_proj,v_proj")
    assert [f.level for f in qv if "covers" in f.message] == ["warn"]
    assert any("in_proj_qkv" in f.message and "full-attention" in f.message for f in qv)
    assert not [f for f in findings("q_proj,in_proj_qkv") if f.level != "ok"]
    wrong = findings("q_proj,no_such_proj")
    assert [f.message.split(":")[1].strip().split()[0] for f in wrong if f.level == "error"] == ["'no_such_proj'"]
    assert "matches no module" in next(f.message for f in wrong if f.level == "error")


def test_unknown_llamafactory_keys_are_refused_by_its_parser(tmp_path, demo_assets):
    config = load_run_config(make_config(tmp_path, demo_assets, learning_rat=0.1, lora_rnk=4))
    args = config.llamafactory_args("cpu", tmp_path / "x" / "output")
    problems = validate_llamafactory_args(args)
    assert len(problems) == 1
    assert "learning_rat" in problems[0] and "lora_rnk" in problems[0]


def test_unknown_nested_keys_list_the_nested_allowed_keys(tmp_path, model_dir):
    data = {
        "model_name_or_path": str(model_dir),
        "launcher": {"smoke": True, "fsdp": {"wrap": ["X"]}, "early_stopping": {"patience": 2, "mode": "min"}},
    }
    with pytest.raises(ConfigError) as info:
        load_run_config(write(tmp_path, data))
    text = str(info.value)
    assert "launcher.fsdp.wrap: unknown key; allowed keys: wrap_classes, reshard_after_forward" in text
    assert "launcher.early_stopping.mode: unknown key; allowed keys: patience, metric" in text


def test_a_misspelt_launcher_key_gets_did_you_mean(tmp_path, model_dir):
    """As LLaMA-Factory keys do (checks/config_check.py): the closest allowed key, with its section, then the list;
    a key close to none gets the list alone."""
    data = {
        "model_name_or_path": str(model_dir),
        "launcher": {"smoke": True, "stop_grace": 30, "restart": {"max_restart": 2}, "colour": "blue"},
    }
    with pytest.raises(ConfigError) as info:
        load_run_config(write(tmp_path, data))
    problems = info.value.problems
    assert any(
        p.startswith("launcher.stop_grace: unknown key; did you mean launcher.stop_grace_s? (allowed keys: ")
        for p in problems
    ), problems
    nested = (
        "launcher.restart.max_restart: unknown key; did you mean launcher.restart.max_restarts? (allowed keys: "
        "max_restarts, backoff_s)"
    )
    assert nested in problems, problems
    (colour,) = [p for p in problems if p.startswith("launcher.colour")]
    assert "did you mean" not in colour and "allowed keys: backend, " in colour, colour


def test_early_stopping_needs_aligned_eval_and_save(tmp_path, model_dir):
    base = {"model_name_or_path": str(model_dir), "launcher": {"smoke": True, "early_stopping": {"patience": 2}}}
    with pytest.raises(ConfigError, match="eval_strategy is 'no'"):
        load_run_config(write(tmp_path, {**base, "save_strategy": "steps"}))
    misaligned = {**base, "eval_strategy": "steps", "save_strategy": "steps", "eval_steps": 30, "save_steps": 50}
    with pytest.raises(ConfigError, match="save_steps 50 is not a multiple of eval_steps 30"):
        load_run_config(write(tmp_path, misaligned))
    load_run_config(write(tmp_path, {**misaligned, "save_steps": 60}))


@pytest.mark.parametrize("value", [-1, "many", 1.5])
def test_memory_history_steps_is_a_count_of_steps(tmp_path, model_dir, value):
    data = {"model_name_or_path": str(model_dir), "launcher": {"smoke": True, "memory_history_steps": value}}
    with pytest.raises(ConfigError) as info:
        load_run_config(write(tmp_path, data))
    assert len(info.value.problems) == 1 and "launcher.memory_history_steps" in str(info.value), str(info.value)
    good = load_run_config(write(tmp_path, {**data, "launcher": {"smoke": True, "memory_history_steps": 3}}))
    assert good.launcher.memory_history_steps == 3


@pytest.mark.parametrize("value", [1000, 1000.0])
def test_the_formal_cutoff_floor_holds_for_an_integer_and_a_float(tmp_path, model_dir, value):
    """YAML reads ``1000.0`` as a float; the floor of a formal run held only for integers."""
    with pytest.raises(ConfigError) as info:
        load_run_config(write(tmp_path, {"model_name_or_path": str(model_dir), "cutoff_len": value}))
    assert any(p.startswith("cutoff_len: 1000 is below 4096") for p in info.value.problems), info.value.problems
