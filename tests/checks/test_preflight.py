"""Preflight: model-folder checks on good and broken folders, the other rows, the table and its record.

Model folders are built by hand here (JSON config plus safetensors files written byte by byte), so
these tests need no torch and no download. One test runs the real DeltaNet kernel check on the CPU
(a child process that imports transformers; about 10 s).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from launcher.checks import model as modelcheck
from launcher.checks import packages as lockfile
from launcher.checks import preflight
from launcher.config.backend import BACKENDS
from launcher.config.run_config import load_run_config

ROOT = Path(__file__).resolve().parents[2]


# --- builders ---------------------------------------------------------------------------------------


def write_safetensors(path: Path, tensors: dict[str, int]) -> None:
    """A valid safetensors file whose tensors are float32 vectors of the given lengths."""
    header, offset = {}, 0
    for name, n in tensors.items():
        header[name] = {"dtype": "F32", "shape": [n], "data_offsets": [offset, offset + 4 * n]}
        offset += 4 * n
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + b"\0" * offset)


def make_model(root: Path, *, model_type: str = "qwen3_5", layer_types: list[str] | None = None) -> Path:
    """A tiny Qwen3.5-shaped folder: config, two shards with an index, tokenizer and processor files."""
    model = root / "model"
    model.mkdir()
    layers = layer_types or ["linear_attention"] * 3 + ["full_attention"]
    config = {
        "model_type": model_type,
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": {"layer_types": layers, "num_hidden_layers": len(layers)},
    }
    (model / "config.json").write_text(json.dumps(config))
    shards = {
        "model-00001-of-00002.safetensors": {"a.weight": 8, "b.weight": 4},
        "model-00002-of-00002.safetensors": {"c.weight": 16},
    }
    weight_map = {}
    for shard, tensors in shards.items():
        write_safetensors(model / shard, tensors)
        weight_map.update({t: shard for t in tensors})
    (model / modelcheck.INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (model / "tokenizer.json").write_text("{}")
    (model / "processor_config.json").write_text("{}")
    return model


def make_data(root: Path, records: list | None = None) -> Path:
    data = root / "data"
    data.mkdir()
    rows = records if records is not None else [{"instruction": "hi", "input": "", "output": "hello"}]
    (data / "train.json").write_text(json.dumps(rows))
    (data / "dataset_info.json").write_text(json.dumps({"counsel_nothink": {"file_name": "train.json"}}))
    return data


def prepared_for(tmp_path: Path, model: Path, data: Path, **lf: object) -> SimpleNamespace:
    """What supervisor.prepare returns (config + backend), for a CPU smoke config."""
    cfg = {
        "launcher": {"backend": "cpu", "smoke": True, "output_root": str(tmp_path / "runs")},
        "model_name_or_path": str(model),
        "dataset_dir": str(data),
        "dataset": "counsel_nothink",
        "stage": "sft",
        "do_train": True,
        "finetuning_type": "lora",
        "cutoff_len": 256,
        **lf,
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return SimpleNamespace(config=load_run_config(path), backend=BACKENDS["cpu"])


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return make_model(tmp_path)


# --- model folder -----------------------------------------------------------------------------------


def test_good_model_folder_passes_every_model_check(model: Path) -> None:
    rows = {name: (status, detail) for name, status, detail in preflight.check_model(model, set())}
    assert {name: status for name, (status, _) in rows.items()} == {
        "model.config": "ok",
        "model.layers": "ok",
        "model.weights": "ok",
        "model.tokenizer": "ok",
        "model.checksums": "ok",
    }
    assert "3 Gated DeltaNet + 1 full attention (at 3)" in rows["model.layers"][1]
    assert "2 shard(s)" in rows["model.weights"][1]


def test_missing_shard_fails_and_names_it(model: Path) -> None:
    (model / "model-00002-of-00002.safetensors").unlink()
    status, detail = modelcheck.check_weights(model)
    assert status == "fail"
    assert "model-00002-of-00002.safetensors: missing" in detail


def test_empty_shard_fails(model: Path) -> None:
    (model / "model-00001-of-00002.safetensors").write_bytes(b"")
    status, detail = modelcheck.check_weights(model)
    assert status == "fail"
    assert "model-00001-of-00002.safetensors: empty file" in detail


def test_truncated_shard_fails_with_sizes(model: Path) -> None:
    shard = model / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    status, detail = modelcheck.check_weights(model)
    assert status == "fail" and "truncated" in detail and "bytes" in detail


def test_shard_without_the_tensors_the_index_names_fails(model: Path) -> None:
    write_safetensors(model / "model-00002-of-00002.safetensors", {"other.weight": 16})
    status, detail = modelcheck.check_weights(model)
    assert status == "fail" and "c.weight" in detail


def test_missing_index_with_shards_fails(model: Path) -> None:
    (model / modelcheck.INDEX_FILE).unlink()
    status, detail = modelcheck.check_weights(model)
    assert status == "fail"
    assert modelcheck.INDEX_FILE in detail and "missing" in detail


def test_single_file_model_needs_no_index(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "model.safetensors", {"w": 4})
    assert modelcheck.check_weights(tmp_path)[0] == "ok"


def test_folder_without_weights_fails(tmp_path: Path) -> None:
    status, detail = modelcheck.check_weights(tmp_path)
    assert status == "fail" and "no weights" in detail


def test_wrong_model_type_fails(tmp_path: Path) -> None:
    model = make_model(tmp_path, model_type="llama")
    rows = {name: (status, detail) for name, status, detail in preflight.check_model(model, set())}
    status, detail = rows["model.config"]
    assert status == "fail"
    assert "'llama'" in detail and "qwen3_5" in detail


def test_missing_config_is_one_clear_failure(tmp_path: Path) -> None:
    rows = preflight.check_model(tmp_path / "nowhere", set())
    assert rows == [("model.config", "fail", f"{tmp_path / 'nowhere'} is not a folder (mount or copy the model there)")]


@pytest.mark.parametrize(
    ("layers", "needle"),
    [
        (["full_attention"] * 4, "has both"),
        (["linear_attention", "sliding_attention"], "unknown kinds"),
    ],
)
def test_layer_pattern_that_is_not_hybrid_fails(tmp_path: Path, layers: list[str], needle: str) -> None:
    model = make_model(tmp_path, layer_types=layers)
    status, detail = modelcheck.check_layer_pattern(modelcheck.read_config(model))
    assert status == "fail" and needle in detail


def test_layer_count_must_match_num_hidden_layers() -> None:
    config = {"text_config": {"layer_types": ["linear_attention", "full_attention"], "num_hidden_layers": 64}}
    status, detail = modelcheck.check_layer_pattern(config)
    assert status == "fail" and "64" in detail


def test_qwen35_27b_layer_pattern_is_described() -> None:
    layers = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(64)]
    status, detail = modelcheck.check_layer_pattern({"text_config": {"layer_types": layers, "num_hidden_layers": 64}})
    assert status == "ok"
    assert detail.startswith("64 layers: 48 Gated DeltaNet + 16 full attention (at 3,7,11,15,19,23,...)")


def test_checksum_manifest_is_verified(model: Path) -> None:
    import hashlib

    shard = "model-00001-of-00002.safetensors"
    digest = hashlib.sha256((model / shard).read_bytes()).hexdigest()
    (model / "SHA256SUMS").write_text(f"{digest}  {shard}\n")
    assert modelcheck.check_checksums(model)[0] == "ok"
    (model / "SHA256SUMS").write_text(f"{'0' * 64}  {shard}\n")
    status, detail = modelcheck.check_checksums(model)
    assert status == "fail" and shard in detail


def test_missing_processor_is_a_warning(model: Path) -> None:
    (model / "processor_config.json").unlink()
    assert modelcheck.check_tokenizer(model)[0] == "warn"
    (model / "tokenizer.json").unlink()
    assert modelcheck.check_tokenizer(model)[0] == "fail"


# --- dataset, output, driver, triton ----------------------------------------------------------------


def test_dataset_registered_and_present(tmp_path: Path) -> None:
    data = make_data(tmp_path)
    assert preflight.check_dataset({"dataset_dir": str(data), "dataset": "counsel_nothink"})[1] == "ok"


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda d: (d / "train.json").unlink(), "missing"),
        (lambda d: (d / "train.json").write_text(""), "empty"),
        (lambda d: (d / "dataset_info.json").write_text("{}"), "not registered"),
        (lambda d: (d / "train.json").write_text(json.dumps([{"prompt": "x"}])), "lacks column"),
        (
            lambda d: (d / "train.json").write_text(json.dumps([{"instruction": "a", "output": "<think>x</think>b"}])),
            "<think>",
        ),
    ],
)
def test_bad_dataset_fails_with_reason(tmp_path: Path, mutate, needle: str) -> None:
    data = make_data(tmp_path)
    mutate(data)
    _, status, detail = preflight.check_dataset({"dataset_dir": str(data), "dataset": "counsel_nothink"})
    assert status == "fail" and needle in detail


def test_output_root_under_a_file_fails(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    _, status, detail = preflight.check_output(blocker / "runs", smoke=True)
    assert status == "fail" and "not a folder" in detail


def test_output_needs_free_space(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert preflight.check_output(tmp_path / "runs", smoke=True)[1] == "ok"
    assert not (tmp_path / "runs").exists()  # preflight creates nothing
    monkeypatch.setenv("LAUNCHER_MIN_FREE_GIB", str(10**9))
    _, status, detail = preflight.check_output(tmp_path / "runs", smoke=True)
    assert status == "fail" and "free" in detail


@pytest.mark.parametrize(
    ("version", "status"),
    [("25.2.0", "ok"), ("25.5.rc1", "ok"), ("24.1.rc3", "fail"), ("26.0.0", "warn")],
)
def test_driver_version_against_cann(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: str, status: str
) -> None:
    monkeypatch.setenv("LAUNCHER_CANN_VERSION", "8.5.0")
    (tmp_path / "version.info").write_text(f"Version={version}\nascendhal_version=7.35.23\n")
    assert preflight.check_driver(tmp_path)[1] == status


def test_unmounted_driver_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAUNCHER_CANN_VERSION", "8.5.0")
    _, status, detail = preflight.check_driver(tmp_path)
    assert status == "fail" and "read-only" in detail


def test_community_triton_next_to_triton_ascend_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    versions = {"triton": "3.3.1", "triton-ascend": "3.2.0"}
    monkeypatch.setattr(lockfile, "installed_version", versions.get)
    _, status, detail = preflight.check_triton("npu")
    assert status == "fail" and "triton-ascend" in detail
    versions.pop("triton")
    assert preflight.check_triton("npu")[1] == "ok"


def test_triton_fla_refuses_on_hopper_is_flagged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lockfile, "installed_version", {"triton": "3.6.0"}.get)
    assert preflight.check_triton("cuda")[1] == "warn"
    monkeypatch.setattr(lockfile, "installed_version", {"triton": "3.3.1"}.get)
    assert preflight.check_triton("cuda")[1] == "ok"


def test_cann_environment_must_be_in_effect(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
    monkeypatch.delenv("ASCEND_TOOLKIT_HOME", raising=False)
    assert preflight.check_cann_env()[1] == "fail"
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path))
    assert preflight.check_cann_env()[1] in ("ok", "warn")


# --- packages ---------------------------------------------------------------------------------------


def test_lock_parsing_keeps_versions_markers_and_hashes() -> None:
    packages = {p.name: p for p in lockfile.parse_lock(ROOT / "requirements.lock")}
    torch = packages["torch"]
    assert torch.version == "2.7.1" and torch.direct and torch.hashes
    cublas = next(p for name, p in packages.items() if name.startswith("nvidia-cublas"))
    assert not cublas.direct
    assert cublas.applies({**_env(), "platform_machine": "x86_64"})
    assert not cublas.applies({**_env(), "platform_machine": "aarch64"})


def _env() -> dict[str, str]:
    from packaging.markers import default_environment

    return {**default_environment(), "sys_platform": "linux", "python_full_version": "3.11.9", "python_version": "3.11"}


def test_training_stack_mismatch_fails_even_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    real = lockfile.installed_version
    monkeypatch.setattr(lockfile, "installed_version", lambda n: "0.0.1" if n == "peft" else real(n))
    _, status, detail = preflight.check_packages("cpu")
    assert status == "fail" and "peft 0.0.1 (lock 0.18.1)" in detail


# --- the whole report -------------------------------------------------------------------------------


def test_report_on_good_setup_passes_and_is_written(tmp_path: Path) -> None:
    prepared = prepared_for(tmp_path, make_model(tmp_path), make_data(tmp_path))
    report = preflight.run_preflight(prepared, skip={"kernel"})
    assert report.ok, report.to_dict()
    path = report.write(tmp_path)
    saved = json.loads(path.read_text())
    assert path.name == "preflight.json" and saved["ok"] is True
    assert {c["name"] for c in saved["checks"]} >= {"backend", "packages", "model.weights", "dataset", "output"}
    assert next(c for c in saved["checks"] if c["name"] == "kernel")["status"] == "skip"


def test_report_on_broken_model_fails_and_prints_a_table(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model = make_model(tmp_path)
    (model / "model-00001-of-00002.safetensors").write_bytes(b"")
    report = preflight.run_preflight(prepared_for(tmp_path, model, make_data(tmp_path)), skip={"kernel"})
    assert not report.ok and report.failed == ["model.weights"]
    report.render()
    err = capsys.readouterr().err
    assert "model.weights" in err and "FAIL" in err and "failed: model.weights" in err


def test_skip_comes_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(preflight.SKIP_ENV, "kernel, dataset")
    report = preflight.run_preflight(prepared_for(tmp_path, make_model(tmp_path), tmp_path / "no-data"))
    statuses = {c.name: c.status for c in report.checks}
    assert statuses["kernel"] == statuses["dataset"] == "skip" and report.ok


def test_kernel_check_runs_the_torch_deltanet_on_cpu() -> None:
    pytest.importorskip("transformers")
    name, status, detail = preflight.check_kernel("cpu")
    assert (name, status) == ("kernel", "ok"), detail
    assert "torch_chunk_gated_delta_rule" in detail and "1x96x2x64" in detail


def test_a_crashing_check_becomes_a_failed_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_a, **_k):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(preflight, "check_kernel", boom)
    report = preflight.run_preflight(prepared_for(tmp_path, make_model(tmp_path), make_data(tmp_path)))
    kernel = next(c for c in report.checks if c.name == "kernel")
    assert kernel.status == "fail" and "kaboom" in kernel.detail and not report.ok


def test_cli_preflight_exits_nonzero_on_a_bad_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    pytest.importorskip("llamafactory")
    from launcher.cli import main

    model = make_model(tmp_path, model_type="llama")
    prepared_for(tmp_path, model, make_data(tmp_path))  # writes run.yaml
    monkeypatch.setenv(preflight.SKIP_ENV, "kernel")
    out = tmp_path / "report.json"
    assert main(["preflight", str(tmp_path / "run.yaml"), "--json", str(out)]) == 1
    assert "model.config" in capsys.readouterr().err
    assert json.loads(out.read_text())["failed"] == ["model.config"]


def test_run_refuses_to_train_and_records_preflight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`launcher run` with an empty shard: exit 2, no job started, FAILED_SETUP and preflight.json on disk."""
    pytest.importorskip("llamafactory")
    from launcher.run.supervisor import supervise

    model = make_model(tmp_path)
    (model / "model-00002-of-00002.safetensors").write_bytes(b"")
    prepared_for(tmp_path, model, make_data(tmp_path))
    monkeypatch.setenv(preflight.SKIP_ENV, "kernel")
    assert supervise(load_run_config(tmp_path / "run.yaml"), echo=False) == 2
    (run_dir,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "FAILED_SETUP" and "model.weights" in status["reason"]
    assert json.loads((run_dir / "preflight.json").read_text())["failed"] == ["model.weights"]
    events = [json.loads(line)["event"] for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert "preflight" in events and events[-1] == "ended" and "started" not in events
