"""``launcher evaluate`` end to end on the tiny model: a real run (LLaMA-Factory training, two checkpoints) on
data prepared with a held-out test split, then evaluated in a real child process; and its bad inputs."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from launcher.data.prepare import Options, prepare
from launcher.state.runs import EVALUATE_JSON, EVALUATE_MD
from tests.support import soulchat_fixtures as sf
from tests.support.common import REPO, launcher_cmd, make_config, only_run_dir

pytest_plugins = ["tests.support.patch_fixtures"]

_RUN: dict[str, Path] = {}


def _prepared_run(tmp_path_factory, demo_assets) -> Path:
    """Prepare SoulChat-shaped data with a test split, train the demo model on it (6 steps, checkpoints 3 and 6)."""
    if "run" not in _RUN:
        folder = tmp_path_factory.mktemp("evaluate-run")
        src = sf.write_json(folder / "src" / "catch_mdpcot.json", sf.mdpcot_records(dialogues=16))
        result = prepare(src, folder / "data", Options(), val_size=0.2, test_size=0.2, seed=3, name="counsel")
        config = make_config(
            folder,
            {"model": demo_assets["model"], "data": folder / "data"},
            dataset=result.name,
            eval_dataset=f"{result.name}_val",
        )
        proc = launcher_cmd("run", config, "--quiet")
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        _RUN["run"] = only_run_dir(folder / "runs")
        _RUN["data"] = folder / "data"
    return _RUN["run"]


@pytest.fixture
def prepared_run(tmp_path_factory, demo_assets) -> Path:
    return _prepared_run(tmp_path_factory, demo_assets)


def _records(path: Path) -> list[str]:
    return [json.dumps(r, sort_keys=True) for r in json.loads(path.read_text())]


@pytest.mark.slow
def test_two_checkpoints_evaluated_on_the_held_out_split_and_shown_in_the_report(prepared_run):
    data = _RUN["data"]
    test, train, val = (_records(data / f"counsel{s}.json") for s in ("_test", "", "_val"))
    firsts = {
        json.loads(r)["history"][0][0] if json.loads(r)["history"] else json.loads(r)["instruction"] for r in test
    }
    assert test and not set(test) & (set(train) | set(val))  # the test split is disjoint from train and validation

    proc = launcher_cmd(
        "evaluate", prepared_run, "--checkpoints", "3,last", "--max-new-tokens", "8", "--batch-size", "4"
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((prepared_run / EVALUATE_JSON).read_text())
    total = len(doc["prompts"])
    for name in ("checkpoint-3", "checkpoint-6"):  # progress per batch of 4: prompts done of all, tokens/s
        done = re.findall(
            rf"^evaluate: {name}: (\d+)/{total} answers, (\d+) tokens in [\d.]+ s \(([\d.]+) tokens/s\)$",
            proc.stdout,
            re.MULTILINE,
        )
        assert [int(d) for d, _, _ in done] == [min(total, n) for n in range(4, total + 4, 4)], proc.stdout
    assert doc["generation"]["batch_size"] == 4
    for ckpt in doc["checkpoints"]:
        assert ckpt["decoding"]["batch_size"] == 4 and 0 < ckpt["decoding"]["generated_tokens"] <= 8 * total
    assert [c["name"] for c in doc["checkpoints"]] == ["checkpoint-3", "checkpoint-6"]
    losses = [c["test_loss"] for c in doc["checkpoints"]]
    assert all(loss > 0 for loss in losses) and losses[0] != losses[1]  # two different adapters were attached
    assert doc["test_split"]["file"] == "counsel_test.json"
    assert all(c["test_samples"] == len(test) for c in doc["checkpoints"])
    kinds = [p["kind"] for p in doc["prompts"]]
    assert kinds.count("crisis") == 6 and kinds.count("test") == len(firsts)
    assert {p["prompt"] for p in doc["prompts"] if p["kind"] == "test"} == firsts
    assert doc["kernels"]["first_decode_call"]["kernel"].endswith("torch_recurrent_gated_delta_rule")
    assert doc["kernels"]["first_decode_call"]["shape"][1] == 1
    assert doc["kernels"]["deltanet_layers"] == doc["kernels"]["routed_decode_layers"] == 3  # the tiny model's
    assert doc["kernels"]["fused_ops"] == {
        "status": "applied",
        **dict.fromkeys(("conv", "rms_norm", "gated_norm", "swiglu"), "transformers (unfused torch ops)"),
    }  # torch stays on the CPU
    answers = [a["text"] for p in doc["prompts"] for a in p["answers"].values()]
    assert len(answers) == 2 * len(kinds) and any(answers)
    markdown = (prepared_run / EVALUATE_MD).read_text()
    assert "not a clinical judgement" in markdown and "checkpoint-3" in markdown and "checkpoint-6" in markdown
    assert "random weights" in markdown and "meaningless by construction" in markdown  # the demo model says so

    # generated text only in evaluate.json/md: not in the terminal, not in any log of the run
    shown = proc.stdout + proc.stderr
    logs = "".join(p.read_text(errors="replace") for p in prepared_run.rglob("*.log"))
    long_answers = [a for a in answers if len(a) >= 12]
    assert long_answers and not [a for a in long_answers if a in shown or a in logs]

    report = launcher_cmd("report", prepared_run, "--no-plot")
    assert report.returncode == 0, report.stdout + report.stderr
    md = (prepared_run / "report.md").read_text()
    assert "## Evaluation" in md and "test loss" in md
    assert f"{losses[0]:.4f}" in md and f"{losses[1]:.4f}" in md
    summary = json.loads((prepared_run / "report.json").read_text())["evaluation"]
    assert set(summary["checkpoints"]) == {"checkpoint-3", "checkpoint-6"}


# ---- bad input: one message (what, which value, the fix), a non-zero exit, nothing on disk lost ------------


@pytest.fixture
def crafted(tmp_path) -> Path:
    """A crafted run (checkpoints 3 and 6, no real model) trained on prepared data with a test split."""
    from launcher.run.rundir import data_fingerprint
    from tests.support.run_fixtures import make_run

    src = sf.write_json(tmp_path / "src" / "catch_mdpcot.json", sf.mdpcot_records(dialogues=10))
    prepare(src, tmp_path / "data", Options(), val_size=0.2, test_size=0.2, seed=3, name="counsel")
    lf = {"dataset": "counsel", "dataset_dir": str(tmp_path / "data")}
    run = make_run(tmp_path, lf_extra=lf)
    manifest = json.loads((run / "manifest.json").read_text())
    (run / "manifest.json").write_text(json.dumps({**manifest, "data": data_fingerprint(lf)}))  # as a run records it
    return run


def test_a_test_split_of_data_prepared_again_after_the_run_is_refused(crafted, tmp_path):
    """Prepared again with another seed, the test split on disk may hold what the run trained on."""
    src = tmp_path / "src" / "catch_mdpcot.json"
    prepare(src, tmp_path / "data", Options(), val_size=0.2, test_size=0.2, seed=7, name="counsel", force=True)
    message = _refused(crafted)
    assert "changed since the run (the data was prepared again)" in message and "may overlap it" in message


def test_a_run_still_going_is_refused(crafted):
    status = json.loads((crafted / "status.json").read_text())
    (crafted / "status.json").write_text(json.dumps({**status, "state": "RUNNING"}))
    message = _refused(crafted)
    assert "is RUNNING: evaluating it would load a second model" in message and "launcher stop" in message


def _refused(*args, code: int = 2) -> str:
    proc = launcher_cmd("evaluate", *args)
    assert proc.returncode == code, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr
    assert code == 1 or "Traceback" not in proc.stderr  # a failed child's log tail is shown; bad input is not
    return errors[0]


@pytest.mark.parametrize(
    ("checkpoints", "fragment"),
    [("9", "no complete checkpoint-9"), ("best,nope", "'nope': not best, last, final or a step number")],
)
def test_unknown_checkpoint_names_what_exists(crafted, checkpoints, fragment):
    message = _refused(crafted, "--checkpoints", checkpoints)
    assert fragment in message and "checkpoint-3, checkpoint-6" in message
    assert not (crafted / EVALUATE_JSON).exists()


@pytest.mark.parametrize("size", ["0", "-3", "2.5", "many"])
def test_a_batch_size_below_one_is_refused(crafted, size):
    message = _refused(crafted, "--batch-size", size)
    assert f"--batch-size {size}:" in message and "positive integer" in message and "--batch-size 16" in message
    assert "auto (the default" in message


def test_unknown_run(tmp_path):
    message = _refused("no-such-run", "--root", tmp_path)
    assert "run 'no-such-run' not found" in message


def test_a_run_without_a_test_split_is_refused_with_the_prepare_command(tmp_path):
    from tests.support.run_fixtures import make_run

    message = _refused(make_run(tmp_path))
    assert "no held-out test split" in message and "--test-size" in message


def test_a_changed_test_split_and_an_unreadable_prompts_file_are_refused(crafted, tmp_path):
    message = _refused(crafted, "--prompts", tmp_path / "missing.json")
    assert "--prompts" in message and "missing.json" in message and "JSON list" in message
    (tmp_path / "bad.json").write_text('[{"reference": "no prompt"}]')
    assert 'entry 0 has no non-empty "prompt"' in _refused(crafted, "--prompts", tmp_path / "bad.json")
    for entries, fragment in (
        ('[{"prompt": "p", "crisis": "no"}]', '"crisis" is not true or false'),
        ('[{"prompt": "p", "refrence": "r"}]', "unknown key(s) refrence"),
        ('[{"prompt": "p", "id": "a"}, {"prompt": "q", "id": "a"}]', "id 'a' is used twice"),
    ):
        (tmp_path / "bad.json").write_text(entries)
        assert fragment in _refused(crafted, "--prompts", tmp_path / "bad.json")
    test_file = tmp_path / "data" / "counsel_test.json"
    test_file.write_text(test_file.read_text() + "\n")  # any change to the held-out file
    assert "changed since `launcher data prepare`" in _refused(crafted)


def test_a_failing_evaluation_keeps_the_earlier_files(crafted):
    """The crafted run's model folder holds a config only, so the child fails loading it."""
    earlier = {name: f"earlier {name}\n" for name in (EVALUATE_JSON, EVALUATE_MD)}
    for name, text in earlier.items():
        (crafted / name).write_text(text)
    message = _refused(crafted, "--checkpoints", "last", code=1)
    assert "evaluation of crafted-run failed" in message and "were left as they were" in message
    assert {name: (crafted / name).read_text() for name in earlier} == earlier
    assert (crafted / "evaluate.log").is_file() and not list(crafted.glob(".evaluate-*"))


def test_checkpoint_names_resolve_once_each_in_order(crafted):
    from launcher.run.evaluate import choose_checkpoints

    chosen = choose_checkpoints(crafted, "best,last,final,3")
    assert [(c["name"], c["step"]) for c in chosen] == [("checkpoint-6", 6), ("final", 6), ("checkpoint-3", 3)]
    assert chosen[1]["path"] == str(crafted / "output")


def test_report_names_the_checkpoint_each_criterion_prefers_when_they_disagree(crafted):
    """Validation loss prefers checkpoint-6 (the crafted curve falls); the answers of checkpoint-6 loop."""
    from launcher.results.evaluate import build_document
    from launcher.results.report import build_report

    looped, varied = "I hear you. I hear you. I hear you. I hear you.", "What has helped you before, and who knows?"
    raw = {
        "checkpoints": [
            {"name": "checkpoint-3", "step": 3, "test_loss": 1.9},
            {"name": "checkpoint-6", "step": 6, "test_loss": 2.2},
        ],
        "prompts": [
            {
                "id": "crisis-en-1",
                "kind": "crisis",
                "prompt": "p",
                "reference": None,
                "answers": {"checkpoint-3": varied + " Please call 988 now.", "checkpoint-6": looped},
            },
            {
                "id": "test-1",
                "kind": "test",
                "prompt": "q",
                "reference": "who knows what helped",
                "answers": {"checkpoint-3": varied, "checkpoint-6": looped},
            },
        ],
    }
    request = {
        "run_id": "crafted-run",
        "backend": "cpu",
        "max_new_tokens": 8,
        "test_split": {"file": "counsel_test.json", "sha256": "0" * 64, "samples": 2},
    }
    doc = build_document(request, raw)
    assert "meaningless" not in doc["note"]  # a real base model: only the screening note
    assert "meaningless by construction" in build_document({**request, "demo_model": True}, raw)["note"]
    assert doc["preferred"] == {
        "test_loss": "checkpoint-3",
        "repetition": "checkpoint-3",
        "distinct_2": "checkpoint-3",
        "stock_opening": None,
        "reference_overlap": "checkpoint-3",
        "crisis_help": "checkpoint-3",
    }  # (both open the same way: a tie)
    assert doc["prompts"][0]["answers"]["checkpoint-6"]["repetition"] > 0.5  # the looping answer scores as repeated
    (crafted / EVALUATE_JSON).write_text(json.dumps(doc))
    report = build_report(crafted, plot=True)
    md = (crafted / "report.md").read_text()
    assert "The criteria prefer different checkpoints" in md
    assert "- validation eval_loss: checkpoint-6" in md and "- held-out test loss: checkpoint-3" in md
    assert "1 of 1" in md and "0 of 1" in md  # crisis answers pointing to help, per checkpoint
    assert report.to_dict()["evaluation"]["criteria_disagree"] and report.plot is not None


@pytest.mark.slow
@pytest.mark.usefixtures("restore_patches")
def test_several_checkpoints_load_the_base_model_once(prepared_run, monkeypatch, tmp_path):
    """In process, the child's own ``evaluate``: every base-model load goes through
    ``PreTrainedModel.from_pretrained``, every adapter through ``PeftModel.load_adapter`` (PEFT's
    ``PeftModel.from_pretrained`` calls it too). The batch size is the default, ``auto``, with the free memory
    read as 2.5 forecast rows beyond what is kept free: 2 rows a batch for every checkpoint. (The host's real free
    memory would take every prompt in one batch; the fake is the only way to see the forecast decide.)"""
    from peft import PeftModel
    from transformers import PreTrainedModel

    from launcher.checks import memory
    from launcher.rank import evaluate as evaluate_entry
    from launcher.rank import evaluate_decode
    from launcher.run.evaluate import build_request

    rows_priced, price = [], memory.decode_row_bytes

    def priced(*args, **kwargs):
        rows_priced.append(price(*args, **kwargs))
        return rows_priced[-1]

    monkeypatch.setattr(memory, "decode_row_bytes", priced)
    total = 8 * memory.GIB
    kept = int(memory.SLACK_GIB * memory.GIB + memory.SLACK_SHARE * total)
    monkeypatch.setattr(evaluate_decode, "free_memory", lambda torch_, device: (kept + 5 * rows_priced[-1] // 2, total))

    bases, adapters = [], []
    load_base = PreTrainedModel.from_pretrained.__func__
    load_more = PeftModel.load_adapter

    def counted_base(cls, *args, **kwargs):
        bases.append(cls.__name__)
        return load_base(cls, *args, **kwargs)

    def counted_more(self, path, *args, **kwargs):
        adapters.append(Path(path).name)
        return load_more(self, path, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(counted_base))
    monkeypatch.setattr(PeftModel, "load_adapter", counted_more)
    request = build_request(
        prepared_run, checkpoints="3,last,final", prompts_file=None, max_new_tokens=2, max_prompts=2
    )
    assert request["batch_size"] == "auto"
    levers = json.loads((prepared_run / "manifest.json").read_text())["tuning"]
    assert request["environment"] == {name: lever["value"] for name, lever in levers.items()}
    assert "TRITON_CACHE_DIR" in request["environment"]  # the run's Triton cache, for the child too
    work = tmp_path / "work"
    work.mkdir()
    raw = evaluate_entry.evaluate({**request, "work_dir": str(work), "result_file": str(work / "result.json")})
    assert [c["name"] for c in raw["checkpoints"]] == ["checkpoint-3", "checkpoint-6", "final"]
    assert len(rows_priced) == 1  # one choice, made once for every checkpoint
    for ckpt in raw["checkpoints"]:
        assert ckpt["decoding"]["batch_size"] == 2 and ckpt["decoding"]["batch_size_basis"]["rows_that_fit"] == 2
        assert ckpt["decoding"]["batch_size_basis"]["setting"] == "auto" and ckpt["test_loss_seconds"] >= 0
    assert adapters == ["checkpoint-3", "checkpoint-6", "output"]
    assert len(bases) == 1, bases


def test_the_child_gets_the_runs_levers_where_the_caller_has_none(tmp_path, monkeypatch):
    """The evaluation's child (a real process) gets the environment levers of the run's job, the caller's own value
    of a variable winning; its whole output goes to the log."""
    from launcher.config.backend import BACKENDS
    from launcher.run.evaluate import _run_child

    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "0")
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    shows = "import os; print(os.environ['TRITON_CACHE_DIR'], os.environ['TRITON_CACHE_AUTOTUNING'])"
    levers = {"TRITON_CACHE_DIR": str(tmp_path / "cache"), "TRITON_CACHE_AUTOTUNING": "1"}
    code = _run_child(
        [sys.executable, "-c", shows], BACKENDS["cpu"], tmp_path / "evaluate.log", tmp_path / "scratch.log", levers
    )
    assert code == 0 and (tmp_path / "evaluate.log").read_text() == f"{tmp_path / 'cache'} 0\n"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_an_interrupted_evaluation_stops_its_child_and_keeps_the_earlier_log(tmp_path, signum):
    """A stop signal to the evaluating process alone (``kill -INT``, ``kill``, a closed terminal; a terminal's Ctrl-C
    reaches the child as well) stops the child it started before the interrupt goes on: real processes, real
    signals. The child is a stand-in that prints a progress line and waits, because the real one finishes on the tiny
    model before a signal can be aimed inside it without waiting on time."""
    parent_py = tmp_path / "parent.py"
    parent_py.write_text(
        textwrap.dedent("""
        import sys
        from pathlib import Path
        from launcher.config.backend import BACKENDS
        from launcher.run.evaluate import _run_child
        folder = Path(sys.argv[1])
        waits = "import time; print('evaluate: started', flush=True); time.sleep(600)"
        try:
            _run_child([sys.executable, "-c", waits], BACKENDS["cpu"], folder / "evaluate.log",
                       folder / "scratch.log")
        except KeyboardInterrupt as stop:
            print("stopped by", getattr(stop, "signum", None), file=sys.stderr)
            raise
    """)
    )
    (tmp_path / "evaluate.log").write_text("earlier\n")
    parent = subprocess.Popen(
        [sys.executable, str(parent_py), str(tmp_path)],
        cwd=REPO,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    children: list[psutil.Process] = []
    try:
        assert parent.stdout.readline() == "evaluate: started\n"  # the child runs and its progress is shown
        children = psutil.Process(parent.pid).children()
        assert len(children) == 1
        parent.send_signal(signum)
        _, err = parent.communicate(timeout=120)
        assert parent.returncode != 0 and f"stopped by {int(signum)}" in err  # the interrupt went on, named
        assert not children[0].is_running()  # and the child did not outlive it
        assert (tmp_path / "evaluate.log").read_text() == "earlier\n"
    finally:
        for proc in [*children, psutil.Process(parent.pid)] if parent.poll() is None else children:
            if proc.is_running():
                proc.kill()


# ---- a run that ran in a container, evaluated from the host (the real engine: tests/containers/) ------------


@pytest.fixture
def container_run(crafted) -> Path:
    """``crafted`` as a run of compose's cpu service records itself: its container, and its model and data at the
    image's paths, which do not exist here."""
    status = json.loads((crafted / "status.json").read_text())
    status.update(container={"name": "deltanet-train-cpu", "id": "0" * 64}, run_dir=f"/outputs/runs/{crafted.name}")
    (crafted / "status.json").write_text(json.dumps(status))
    manifest = json.loads((crafted / "manifest.json").read_text())
    manifest["model"]["path"] = "/opt/launcher/demo/model"
    manifest["data"]["dataset_dir"] = "/opt/launcher/demo/data"
    (crafted / "manifest.json").write_text(json.dumps(manifest))
    return crafted


def test_a_container_run_without_its_inputs_here_names_the_options_and_the_compose_command(
    container_run, tmp_path, monkeypatch
):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")
    message = _refused(container_run, "--checkpoints", "last", "--max-prompts", "4")
    assert message.startswith(
        f"error: {container_run.name} ran in container deltanet-train-cpu: its model "
        "/opt/launcher/demo/model and data /opt/launcher/demo/data are not on this machine and "
        "no Docker engine answers here to tell its mounts"
    ), message
    assert "give the host's copy with --model DIR --data-dir DIR" in message, message
    assert message.endswith(
        f": docker compose --profile cpu run --rm train-cpu launcher evaluate /outputs/runs/"
        f"{container_run.name} --checkpoints=last --max-prompts=4"
    ), message
    # the data given here: only the model is missing, and the message names only it
    message = _refused(container_run, "--data-dir", tmp_path / "data")
    assert "its model /opt/launcher/demo/model is not on this machine and no Docker engine answers" in message
    assert "--model DIR," in message and "--data-dir DIR" not in message
    message = _refused(container_run, "--model", tmp_path / "nowhere", "--data-dir", tmp_path / "data")
    assert f"--model {tmp_path / 'nowhere'}: no config.json there" in message, message
    assert not (container_run / EVALUATE_JSON).exists()
