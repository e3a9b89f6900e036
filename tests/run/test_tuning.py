"""``launcher.tuning``: the job's environment levers, set on the right backend, the caller's value winning,
recorded in the manifest, and seen by a real job's ranks."""

from __future__ import annotations

import json

import pytest

from launcher.config.tuning import Tuning, tuning_env
from tests.support.common import launcher_cmd, make_config


def test_npu_gets_ascends_defaults_and_every_backend_a_triton_cache(tmp_path):
    to_set, record = tuning_env(Tuning(), "npu", tmp_path / "runs", {})
    assert to_set == {
        "TASK_QUEUE_ENABLE": "2",
        "CPU_AFFINITY_CONF": "1",
        "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
        "TRITON_CACHE_DIR": str((tmp_path / "runs" / ".cache" / "triton").resolve()),
        "TRITON_CACHE_AUTOTUNING": "1",
    }
    assert all(r["from"] == "launcher.tuning" for r in record.values())
    cuda, _ = tuning_env(Tuning(), "cuda", tmp_path, {})
    assert set(cuda) == {"TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING"}  # the NPU variables mean nothing elsewhere


def test_the_callers_environment_wins_and_null_leaves_a_variable_alone(tmp_path):
    tuning = Tuning(task_queue_enable=None, triton_cache=False)
    to_set, record = tuning_env(tuning, "npu", tmp_path, {"CPU_AFFINITY_CONF": "2"})
    assert to_set == {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"}
    assert record["CPU_AFFINITY_CONF"] == {"value": "2", "from": "environment"}
    assert "TASK_QUEUE_ENABLE" not in record and "TRITON_CACHE_DIR" not in record
    assert "TRITON_CACHE_AUTOTUNING" not in record  # one switch for the cache and the autotuner's part of it
    _, record = tuning_env(Tuning(), "cuda", tmp_path, {"TRITON_CACHE_AUTOTUNING": "0"})
    assert record["TRITON_CACHE_AUTOTUNING"] == {"value": "0", "from": "environment"}


def test_a_bad_lever_is_refused_naming_the_key():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="task_queue_enable"):
        Tuning(task_queue_enable=3)
    with pytest.raises(ValidationError, match="extra"):
        Tuning.model_validate({"task_queue": 2})


@pytest.mark.slow
def test_a_run_records_the_levers_and_its_ranks_see_them(tmp_path, demo_assets, monkeypatch):
    for name in ("TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING"):
        monkeypatch.delenv(name, raising=False)  # the caller's would win
    cfg = make_config(
        tmp_path, demo_assets, launcher={"entry": "tests.support.env_entry"}, max_steps=2, save_steps=2, eval_steps=2
    )
    proc = launcher_cmd("run", cfg, "--quiet")
    run_dir = next(p for p in (tmp_path / "runs").iterdir() if p.is_dir())
    manifest = json.loads((run_dir / "manifest.json").read_text())
    cache = str((tmp_path / "runs" / ".cache" / "triton").resolve())
    assert manifest["tuning"] == {
        "TRITON_CACHE_DIR": {"value": cache, "from": "launcher.tuning"},
        "TRITON_CACHE_AUTOTUNING": {"value": "1", "from": "launcher.tuning"},
    }, proc.stderr
    seen = json.loads((run_dir / "env.rank0.json").read_text())
    assert seen["TRITON_CACHE_DIR"] == cache and seen["TRITON_CACHE_AUTOTUNING"] == "1"
    assert "TASK_QUEUE_ENABLE" not in seen  # a cpu run
