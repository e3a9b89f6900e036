"""``launcher verify``: the acceptance checklist, on crafted run folders and on one real demo run.

Each crafted folder starts complete and passing, then one thing is damaged; the test asserts that
exactly the checks a user would expect fail, and that the evidence names the culprit.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import numpy as np
import pytest

from launcher.cli import main
from launcher.results.verify import verify_run
from launcher.state.runs import VERIFY_FILE
from tests.support.run_fixtures import (
    QKVO,
    TINY_QKVO_MODULES,
    make_run,
    real_demo_run,
    rewrite_adapter,
    tensor_key,
    write_adapter,
    write_json,
)

ADAPTER_CHECKS = {"adapter", "finite", "lora_count", "lora_b_nonzero"}


def failed(report) -> set[str]:
    return {c.name for c in report.failed}


def test_a_complete_run_passes_and_writes_verify_json(tmp_path):
    run = make_run(tmp_path)
    report = verify_run(run)
    assert report.passed, [(c.name, c.evidence) for c in report.failed]
    assert [c.name for c in report.checks] == [
        "steps",
        "exit_code",
        "adapter",
        "finite",
        "lora_count",
        "lora_b_nonzero",
        "coverage",
        "metrics",
    ]
    record = json.loads((run / VERIFY_FILE).read_text())
    assert record["passed"] is True and record["failed"] == []
    assert report.check("coverage").status == "INFO"
    assert report.check("coverage").evidence.startswith("full-attention projections only")
    assert "DeltaNet: not adapted (3 layers)" in report.check("coverage").evidence
    assert "expected 8 tensors (4 modules x A, B)" in report.check("lora_count").evidence


def _nan_in_a(run):
    rewrite_adapter(run, lambda t: t[tensor_key(TINY_QKVO_MODULES[2], "A")].__setitem__((0, 0), np.nan))


def _zero_b(run):
    key = tensor_key(TINY_QKVO_MODULES[1], "B")
    rewrite_adapter(run, lambda t: t.__setitem__(key, np.zeros_like(t[key])))


def _truncate(run):
    path = run / "output" / "adapter_model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-100])


def _delete(*names):
    def damage(run):
        for name in names:
            (run / "output" / name).unlink()

    return damage


def _status(**fields):
    def damage(run):
        status = json.loads((run / "status.json").read_text())
        status.update(fields)
        write_json(run / "status.json", status)

    return damage


def _drop_module(run):
    """An adapter (and its config) without q_proj: consistent in itself, but not what lora_target asks."""
    kept = [m for m in TINY_QKVO_MODULES if not m.endswith("q_proj")]
    write_adapter(run / "output", kept)


def _config_disagrees(run):
    """The safetensors file lacks o_proj while adapter_config.json still targets it."""
    rewrite_adapter(run, lambda t: [t.pop(tensor_key(TINY_QKVO_MODULES[3], ab)) for ab in "AB"])


@pytest.mark.parametrize(
    ("damage", "expected_fail", "evidence"),
    [
        (_nan_in_a, {"finite"}, {"finite": "layers.3.self_attn.v_proj.lora_A.weight (1 NaN, 0 inf)"}),
        (
            _zero_b,
            {"lora_b_nonzero"},
            {"lora_b_nonzero": "1 of 4 LoRA B matrices are all zero: layers.3.self_attn.k_proj"},
        ),
        (_delete("adapter_model.safetensors"), ADAPTER_CHECKS, {"adapter": "adapter_model.safetensors missing"}),
        (_delete("adapter_config.json"), ADAPTER_CHECKS, {"adapter": "adapter_config.json missing"}),
        (_truncate, ADAPTER_CHECKS, {"adapter": "truncated"}),
        (_delete("all_results.json"), {"metrics"}, {"metrics": "all_results.json is missing"}),
        (_delete("eval_results.json"), {"metrics"}, {"metrics": "eval_results.json is missing"}),
        (_delete("trainer_log.jsonl"), {"metrics"}, {"metrics": "trainer_log.jsonl is missing"}),
        (_status(exit_code=1, state="FAILED"), {"exit_code"}, {"exit_code": "exit_code 1"}),
        (_status(exit_code=None, signal=9, state="FAILED"), {"exit_code"}, {"exit_code": "signal 9"}),
        (_drop_module, {"lora_count", "lora_b_nonzero"}, {"lora_count": "missing 1: layers.3.self_attn.q_proj"}),
        (
            _config_disagrees,
            {"adapter", "lora_count", "lora_b_nonzero"},
            {"adapter": "adapter_config.json targets with no tensors"},
        ),
    ],
    ids=[
        "nan-tensor",
        "zero-b",
        "no-adapter",
        "no-adapter-config",
        "truncated-adapter",
        "no-all-results",
        "no-eval-results",
        "no-trainer-log",
        "exit-1",
        "killed",
        "module-missing",
        "config-disagrees",
    ],
)
def test_each_damage_fails_exactly_its_checks(tmp_path, damage, expected_fail, evidence):
    run = make_run(tmp_path)
    damage(run)
    report = verify_run(run)
    assert not report.passed
    assert failed(report) == expected_fail, [(c.name, c.evidence) for c in report.failed]
    for name, text in evidence.items():
        assert text in report.check(name).evidence, report.check(name).evidence
    assert all(c.fix for c in report.failed if c.name in evidence)  # every FAIL it names says how to fix
    assert json.loads((run / VERIFY_FILE).read_text())["failed"] == [c.name for c in report.failed]


def test_too_few_steps_fails_steps_and_metrics(tmp_path):
    run = make_run(tmp_path, total=6, done=4, save_steps=2, eval_steps=2)
    report = verify_run(run)
    assert failed(report) == {"steps", "metrics"}
    assert report.check("steps").evidence.startswith("4 of 6 planned steps")
    assert "trainer_log.jsonl ends at step 4 of 6" in report.check("metrics").evidence


def test_early_stopping_that_fired_counts_as_reaching_the_plan(tmp_path):
    # eval loss best at step 2, then worse at 4 and 6: patience 2 stops training at step 6 of 10
    losses = {2: 1.0, 4: 1.1, 6: 1.2}
    kwargs = dict(total=10, done=6, save_steps=2, eval_steps=2, eval_loss=lambda s: losses.get(s, 9.9))
    stopped = make_run(
        tmp_path, "stopped", lf_extra={"early_stopping_steps": 2, "metric_for_best_model": "eval_loss"}, **kwargs
    )
    report = verify_run(stopped)
    assert report.passed, [(c.name, c.evidence) for c in report.failed]
    assert "stopped early on purpose" in report.check("steps").evidence
    assert "best at step 2" in report.check("steps").evidence
    # the same curve without early stopping configured is a run that ended too soon
    assert failed(verify_run(make_run(tmp_path, "no-early-stopping", **kwargs))) == {"steps", "metrics"}
    # and early stopping configured but not yet entitled to stop (patience 3) is too
    impatient = make_run(tmp_path, "impatient", lf_extra={"early_stopping_steps": 3}, **kwargs)
    assert failed(verify_run(impatient)) == {"steps", "metrics"}


def test_exit_code_given_by_the_supervisor_overrides_a_status_not_yet_final(tmp_path):
    run = make_run(tmp_path)
    _status(state="RUNNING", exit_code=None)(run)
    assert failed(verify_run(run)) == {"exit_code"}
    report = verify_run(run, exit_code=0)
    assert report.passed and "from the supervisor" in report.check("exit_code").evidence
    assert failed(verify_run(run, exit_code=3)) == {"exit_code"}


def _seed_modules() -> list[str]:
    """The seed's q/k/v/o on Qwen3.5-27B, written out by hand: full attention at 3, 7, ..., 63."""
    return [
        f"model.language_model.layers.{i}.self_attn.{p}"
        for i in range(3, 64, 4)
        for p in ("q_proj", "k_proj", "v_proj", "o_proj")
    ]


def test_seed_shape_q_k_v_o_implies_128_tensors_in_16_full_attention_layers(tmp_path):
    layers = tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(64))
    modules = _seed_modules()
    run = make_run(tmp_path, layers=layers, modules=modules)
    report = verify_run(run)
    assert report.passed, [(c.name, c.evidence) for c in report.failed]
    assert "expected 128 tensors (64 modules x A, B)" in report.check("lora_count").evidence
    assert "found 128" in report.check("lora_count").evidence
    coverage = report.check("coverage").evidence
    assert coverage.startswith("full-attention projections only")
    assert "in 16 of 16 layers" in coverage and "DeltaNet: not adapted (48 layers)" in coverage
    assert report.coverage["verdict"] == "full-attention projections only"


def test_lora_target_all_expects_deltanet_and_mlp_projections_too(tmp_path):
    layers = tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(8))
    full = [
        f"model.language_model.layers.{i}.self_attn.{p}"
        for i in (3, 7)
        for p in ("q_proj", "k_proj", "v_proj", "o_proj")
    ]
    delta = [
        f"model.language_model.layers.{i}.linear_attn.{p}"
        for i in (0, 1, 2, 4, 5, 6)
        for p in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
    ]
    mlp = [f"model.language_model.layers.{i}.mlp.{p}" for i in range(8) for p in ("gate_proj", "up_proj", "down_proj")]
    run = make_run(tmp_path, "all", layers=layers, lora_target="all", modules=full + delta + mlp)
    report = verify_run(run)
    assert report.passed, [(c.name, c.evidence) for c in report.failed]
    assert f"expected {2 * (8 + 30 + 24)} tensors" in report.check("lora_count").evidence
    assert report.coverage["verdict"] == "full-attention, DeltaNet and MLP projections"
    # the same adapter judged against q/k/v/o: everything beyond the 8 attention modules is unexpected
    (run / "llamafactory.yaml").write_text(
        (run / "llamafactory.yaml").read_text().replace("lora_target: all", f"lora_target: {QKVO}")
    )
    report = verify_run(run)
    assert failed(report) == {"lora_count"}
    assert "unexpected 54" in report.check("lora_count").evidence


def test_bf16_adapter_is_read_without_torch(tmp_path):
    """numpy has no bfloat16; the reader widens BF16 itself (what a bf16 run may save)."""
    run = make_run(tmp_path)
    header, blobs, offset = {}, [], 0
    for i, module in enumerate(TINY_QKVO_MODULES):
        for ab, shape in (("A", (8, 16)), ("B", (16, 8))):
            values = np.full(shape, 0.5 if ab == "A" else 0.25 * (i + 1), dtype=np.float32)
            if module.endswith("v_proj") and ab == "B":
                values[:] = 0.0
            raw = (values.view(np.uint32) >> 16).astype("<u2").tobytes()
            header[tensor_key(module, ab)] = {
                "dtype": "BF16",
                "shape": list(shape),
                "data_offsets": [offset, offset + len(raw)],
            }
            blobs.append(raw)
            offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    (run / "output" / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    report = verify_run(run)
    assert failed(report) == {"lora_b_nonzero"}
    assert "layers.3.self_attn.v_proj" in report.check("lora_b_nonzero").evidence
    assert "(BF16)" in report.check("adapter").evidence


def test_missing_model_config_says_how_to_point_at_it(tmp_path):
    run = make_run(tmp_path)
    (tmp_path / "model" / "config.json").rename(tmp_path / "config.json")
    report = verify_run(run)
    assert failed(report) == {"lora_count"}
    assert "model config.json not found" in report.check("lora_count").evidence
    assert "--model" in report.check("lora_count").fix
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "config.json").rename(tmp_path / "elsewhere" / "config.json")
    assert verify_run(run, model_dir=tmp_path / "elsewhere").passed


def test_cli_verify_by_run_id_prints_pass_fail_lines_and_exit_codes(tmp_path, capsys):
    run = make_run(tmp_path)
    root = str(tmp_path / "runs")
    assert main(["verify", run.name, "--root", root]) == 0
    out = capsys.readouterr().out
    assert "PASS  steps" in out and "INFO  coverage" in out and "result: PASS (7 of 7 checks passed)" in out
    _zero_b(run)
    assert main(["verify", str(run)]) == 1
    out = capsys.readouterr().out
    assert "FAIL  lora_b_nonzero" in out and "fix: an all-zero B" in out and "result: FAIL (6 of 7" in out
    assert main(["verify", "no-such-run", "--root", root]) == 2
    err = capsys.readouterr().err
    assert "run 'no-such-run' not found" in err and run.name in err  # names the runs that do exist


def test_verify_and_report_work_without_torch(tmp_path):
    """The host has no torch: block torch, transformers and peft imports and run both verbs."""
    run = make_run(tmp_path)
    code = (
        "import sys\n"
        "for name in ('torch', 'transformers', 'peft', 'llamafactory'):\n"
        "    sys.modules[name] = None  # any import of them now raises ImportError\n"
        "from launcher.cli import main\n"
        f"assert main(['verify', {str(run)!r}]) == 0\n"
        f"assert main(['report', {str(run)!r}]) == 0\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (run / "verify.json").is_file() and (run / "report.md").is_file() and (run / "loss.png").is_file()


@pytest.mark.slow
def test_real_demo_run_passes_verify(tmp_path_factory, demo_assets):
    run = real_demo_run(tmp_path_factory, demo_assets)
    proc = subprocess.run(
        [sys.executable, "-m", "launcher", "verify", str(run)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("steps", "exit_code", "adapter", "finite", "lora_count", "lora_b_nonzero", "metrics"):
        assert f"PASS  {name}" in proc.stdout
    record = json.loads((run / VERIFY_FILE).read_text())
    assert record["passed"] is True
    assert record["coverage"]["verdict"] == "full-attention projections only"
    checks = {c["name"]: c["evidence"] for c in record["checks"]}
    assert "expected 8 tensors" in checks["lora_count"] and "4 of 4 targeted modules" in checks["lora_b_nonzero"]


@pytest.mark.slow
def test_real_demo_run_is_recorded_succeeded_after_acceptance(tmp_path_factory, demo_assets):
    """The supervisor runs the checklist when the job exits 0: SUCCEEDED only if it passes."""
    run = real_demo_run(tmp_path_factory, demo_assets)
    status = json.loads((run / "status.json").read_text())
    assert status["exit_code"] == 0
    assert status["state"] == "SUCCEEDED", (status.get("acceptance"), json.loads((run / VERIFY_FILE).read_text()))
    assert status["acceptance"]["passed"] is True
