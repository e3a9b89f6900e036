"""The evaluate benchmark end to end on the CPU with the tiny shape: a real ``launcher run`` trains a checkpoint and
``launcher.run.evaluate`` evaluates it through the measuring child (the H200 run uses the same code, 27B shape)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from benchmarks import evaluate_bench  # noqa: E402
from benchmarks.results_schema import Results  # noqa: E402
from launcher.data.demo import OPENINGS  # noqa: E402
from launcher.state.runs import EVALUATE_JSON  # noqa: E402


def test_the_evaluation_is_not_padded_though_the_training_was():
    patches = {"pad_lengths": {"enabled": True, "multiple": 256}, "packed_rows": {"enabled": True}}
    assert evaluate_bench.unpadded(patches) == {**patches, "pad_lengths": {"enabled": False, "multiple": 256}}
    assert patches["pad_lengths"]["enabled"]  # the run's own record is left as it is


@pytest.mark.parametrize(
    "bad", [["--batch-size", "0"], ["--test", "0"], ["--steps", "0"], ["--max-prompts", "-1"], ["--repeats", "0"]]
)
def test_counts_must_be_positive(tmp_path, bad):
    with pytest.raises(SystemExit):
        evaluate_bench.main(["--out", str(tmp_path), "--shape", "tiny", *bad])
    assert not (tmp_path / "results.json").exists()


def test_more_test_conversations_than_distinct_openings_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        evaluate_bench.main(["--out", str(tmp_path), "--shape", "tiny", "--test", str(len(OPENINGS) + 1)])
    assert f"--test {len(OPENINGS) + 1}" in capsys.readouterr().err and not (tmp_path / "results.json").exists()


def test_reuse_without_an_earlier_run_is_refused_and_writes_nothing(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        evaluate_bench.main(["--out", str(tmp_path), "--shape", "tiny", "--reuse"])
    assert exc.value.code == 2
    assert "--reuse: no readable results.json" in capsys.readouterr().err and not any(tmp_path.iterdir())
    evaluate_bench.save_results(tmp_path, {"command": "earlier", "shape": "27b", "training": {"state": "SUCCEEDED"}})
    with pytest.raises(SystemExit):
        evaluate_bench.main(["--out", str(tmp_path), "--shape", "tiny", "--reuse"])
    assert "has the 27b shape, not tiny" in capsys.readouterr().err
    assert evaluate_bench.read_results(tmp_path / "results.json")["shape"] == "27b"  # left as it was
    evaluate_bench.save_results(tmp_path, {"command": "earlier", "shape": "tiny", "training": {"state": "TERMINATED"}})
    with pytest.raises(SystemExit):
        evaluate_bench.main(["--out", str(tmp_path), "--shape", "tiny", "--reuse"])
    assert "names no succeeded training run" in capsys.readouterr().err
    (tmp_path / "results.json").write_text("[]")
    with pytest.raises(SystemExit):
        evaluate_bench.main(["--out", str(tmp_path), "--shape", "tiny", "--reuse"])
    assert "no readable results.json" in capsys.readouterr().err


@pytest.mark.slow
def test_one_checkpoint_is_trained_then_evaluated_with_the_default_prompt_set(tmp_path, monkeypatch):
    out = tmp_path / "ev"
    recorded_before: list[dict] = []  # results.json as each evaluation starts
    real_evaluate = evaluate_bench.evaluate_checkpoint

    def noting(*args, **kwargs):
        recorded_before.append(evaluate_bench.read_results(out / "results.json"))
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(evaluate_bench, "evaluate_checkpoint", noting)
    # 10 test conversations: more than the demo's 8 client lines, so each must open differently to be a prompt
    assert (
        evaluate_bench.main(
            [
                "--out",
                str(out),
                "--shape",
                "tiny",
                "--test",
                "10",
                "--max-prompts",
                "10",
                "--max-new-tokens",
                "6",
                "--batch-size",
                "8",
                "--repeats",
                "2",
            ]
        )
        == 0
    )
    written = Results.read(out / "results.json")  # the results schema, validated
    assert written.bench == "benchmarks.evaluate_bench" and written.commit and written.converted is None
    assert written.figures["evaluation-2.wall_s"] == written.variants["evaluation-2"]["wall_s"]
    results = evaluate_bench.read_results(out / "results.json")
    assert results["training"]["state"] == "SUCCEEDED"
    # the trained run was on disk before the first evaluation began: a stopped evaluation leaves it for --reuse
    assert recorded_before[0]["training"] == results["training"] and "evaluations" not in recorded_before[0]
    run_dir = Path(results["training"]["run_dir"])
    # every training batch padded to the cutoff: one shape to compile
    launch = json.loads((run_dir / "launch.json").read_text())
    assert launch["patches"]["pad_lengths"] == {"enabled": True, "multiple": 256}
    # and no kernel check in the training rank: the evaluation is what is measured
    assert json.loads((run_dir / "bench" / "rank0.json").read_text())["kernel_check"] is None
    assert len(results["evaluations"]) == 2 and all(e["ok"] for e in results["evaluations"])
    found = results["evaluations"][0]
    assert found["ok"] and found["checkpoint"] == "checkpoint-2" and found["test_samples"] == 10
    assert found["prompts"] == 10 + 6  # the test conversations and the shipped crisis prompts
    assert found["decoding"]["batch_size"] == 8 and 0 < found["decoding"]["generated_tokens"] <= 16 * 6
    assert found["wall_s"] >= found["checkpoint_seconds"] > 0
    assert 0 <= found["test_loss_seconds"] <= found["checkpoint_seconds"]
    assert found["decoding"]["batch_size_basis"] == {"setting": 8}
    # the measuring child built the base from the marker and wrote its record beside the training rank's
    assert found["child"]["entry"] == "benchmarks.evaluate_entry" and found["child"]["device"] == "cpu"
    assert "random init" in found["child"]["model_build"]["how"]
    assert json.loads((run_dir / EVALUATE_JSON).read_text())["checkpoints"][0]["name"] == "checkpoint-2"
    assert not any("target" in e for e in results["evaluations"])  # the 3-minute target is the 27B shape's
    # a later invocation evaluates the same run again without training, adding to the same results.json
    trained = results["training"]
    assert (
        evaluate_bench.main(
            [
                "--out",
                str(out),
                "--shape",
                "tiny",
                "--max-prompts",
                "10",
                "--max-new-tokens",
                "6",
                "--batch-size",
                "8",
                "--reuse",
            ]
        )
        == 0
    )
    again = evaluate_bench.read_results(out / "results.json")
    assert again["training"] == trained and again["evaluations"][:2] == results["evaluations"]
    assert len(again["evaluations"]) == 3 and again["evaluations"][2]["ok"]
    assert again["evaluations"][2]["command"].endswith("--reuse") and again["evaluations"][2]["prompts"] == 16
    assert again["evaluations"][2]["settings"]["batch_size"] == 8 == again["evaluations"][0]["settings"]["batch_size"]
    assert len(list((out / "runs").glob("evaluate-bench-tiny-*"))) == 1  # no second run

    def interrupted(*args, **kwargs):  # as launcher.run.evaluate raises it once it has stopped its child
        raise KeyboardInterrupt  # (tests/results/test_evaluate.py stops a real child with a real SIGINT)

    monkeypatch.setattr(evaluate_bench, "evaluate_checkpoint", interrupted)
    assert evaluate_bench.main(["--out", str(out), "--shape", "tiny", "--max-prompts", "10", "--reuse"]) == 130
    stopped = evaluate_bench.read_results(out / "results.json")
    assert stopped["evaluations"][:3] == again["evaluations"]  # the evaluations done are kept
    assert stopped["evaluations"][3]["interrupted"] and not stopped["evaluations"][3]["ok"]
