"""`launcher data stats`: token statistics that match LLaMA-Factory's own tokenized datasets, and a
training log that carries no training text unless asked."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from launcher.config.run_config import load_run_config
from launcher.data.lfdata import StatsError, load_lf_data, load_splits
from launcher.data.prepare import prepare
from launcher.data.soulchat import Options
from launcher.data.stats import CUT_LEN, CUT_SUP, FULL_LEN, FULL_SUP, compute_stats, measure_samples, short_stats
from tests.support.common import launcher_cmd, make_config, only_run_dir
from tests.support.soulchat_fixtures import HANDBOOK, SENTINEL, dialogue_records, mdpcot_records, write_json

IGNORE_INDEX = -100
UNLIMITED = 1 << 20


def prepared(tmp_path: Path, kind: str = "mdpcot", reasoning: str = "drop", **options) -> tuple[Path, str]:
    """Our synthetic SoulChat-R1 file converted by `prepare`; returns (dataset_dir, dataset name)."""
    records = mdpcot_records() if kind == "mdpcot" else dialogue_records()
    src = write_json(tmp_path / f"{kind}.json", records)
    result = prepare(src, tmp_path / f"data-{kind}-{reasoning}", Options(reasoning=reasoning, **options), val_size=0.25)
    return result.out, result.name


def config_for(tmp_path: Path, assets, data_dir: Path, name: str, **lf):
    lf.setdefault("eval_dataset", f"{name}_val")
    path = make_config(
        tmp_path,
        assets,
        dataset_dir=str(data_dir),
        dataset=name,
        name=f"run-{len(list(tmp_path.glob('run-*.yaml')))}.yaml",
        **lf,
    )
    return load_run_config(path)


def lf_reference(config, tmp_path: Path, **override) -> dict[str, list[tuple[list[int], list[int]]]]:
    """LLaMA-Factory's own tokenized train/eval datasets (get_train_args + get_dataset, as run_sft does)."""
    from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_tokenizer

    args = dict(config.llamafactory, **override)
    args.update(
        output_dir=str(tmp_path / "lf-out"),
        use_cpu=True,
        report_to="none",
        overwrite_cache=True,
        cache_dir=str(tmp_path / "hf-cache"),
    )
    model_args, data_args, training_args, _, _ = get_train_args(args)
    module = load_tokenizer(model_args)
    template = get_template_and_fix_tokenizer(module["tokenizer"], data_args)
    data = get_dataset(template, model_args, data_args, training_args, stage="sft", **module)
    return {
        split: [(row["input_ids"], row["labels"]) for row in data[key]]
        for split, key in (("train", "train_dataset"), ("validation", "eval_dataset"))
    }


def supervised(labels: list[int]) -> int:
    return sum(1 for t in labels if t != IGNORE_INDEX)


# --- the fast path gives LLaMA-Factory's numbers -----------------------------------------------------


@pytest.mark.parametrize(
    "kind, reasoning, lf",
    [
        ("mdpcot", "drop", {"template": "qwen3_5_nothink"}),
        ("mdpcot", "drop", {"template": "qwen3_5_nothink", "mask_history": True}),
        ("mdpcot", "keep", {"template": "qwen3_5"}),
        ("dialogue", "drop", {"template": "qwen3_5_nothink"}),
    ],
    ids=["mdpcot-nothink", "mask-history", "mdpcot-think", "dialogue"],
)
def test_lengths_and_labels_match_llamafactory(tmp_path, demo_assets, kind, reasoning, lf):
    data_dir, name = prepared(tmp_path, kind, reasoning, system="Be kind." if kind == "dialogue" else None)
    config = config_for(tmp_path, demo_assets, data_dir, name, cutoff_len=200, **lf)
    cut = lf_reference(config, tmp_path)
    full = lf_reference(config, tmp_path, cutoff_len=UNLIMITED)
    lfd = load_lf_data(config.llamafactory)
    truncated = 0
    for split, samples in load_splits(lfd).items():
        rows = measure_samples(lfd, samples)
        assert [(r[CUT_LEN], r[CUT_SUP]) for r in rows] == [(len(i), supervised(la)) for i, la in cut[split]]
        assert [(r[FULL_LEN], r[FULL_SUP]) for r in rows] == [(len(i), supervised(la)) for i, la in full[split]]
        truncated += int((rows[:, FULL_LEN] > rows[:, CUT_LEN]).sum())
    assert 0 < truncated < sum(len(v) for v in cut.values())  # both paths (truncated or not) are exercised


def test_val_size_split_matches_llamafactory(tmp_path, demo_assets):
    data_dir, name = prepared(tmp_path)
    config = config_for(tmp_path, demo_assets, data_dir, name, cutoff_len=200, eval_dataset=None, val_size=0.3)
    reference = lf_reference(config, tmp_path)
    lfd = load_lf_data(config.llamafactory)
    for split, samples in load_splits(lfd).items():
        rows = measure_samples(lfd, samples)
        assert [(r[CUT_LEN], r[CUT_SUP]) for r in rows] == [(len(i), supervised(la)) for i, la in reference[split]]


def test_worker_processes_give_the_same_rows(tmp_path, demo_assets):
    src = write_json(tmp_path / "m.json", mdpcot_records(dialogues=150))
    result = prepare(src, tmp_path / "data", Options(), val_size=0)
    config = config_for(tmp_path, demo_assets, result.out, result.name, cutoff_len=200, eval_dataset=None)
    lfd = load_lf_data(config.llamafactory)
    samples = load_splits(lfd)["train"]
    assert len(samples) > 256  # large enough for the forked path
    np.testing.assert_array_equal(measure_samples(lfd, samples, workers=2), measure_samples(lfd, samples, workers=1))


def test_drop_with_nothink_template_leaves_no_think_token_in_any_label(tmp_path, demo_assets):
    data_dir, name = prepared(tmp_path, "mdpcot", "drop")
    config = config_for(tmp_path, demo_assets, data_dir, name, template="qwen3_5_nothink", cutoff_len=4096)
    tokenizer = load_lf_data(config.llamafactory).tokenizer
    think = {tokenizer.convert_tokens_to_ids("<think>"), tokenizer.convert_tokens_to_ids("</think>")}
    assert tokenizer.unk_token_id not in think
    data = lf_reference(config, tmp_path)
    assert sum(len(v) for v in data.values()) == len(mdpcot_records())
    for samples in data.values():
        for ids, labels in samples:
            assert not think & set(labels) and not think & set(ids)

    # the control: kept reasoning with a thinking template does reach the labels
    data_dir, name = prepared(tmp_path, "mdpcot", "keep")
    config = config_for(tmp_path, demo_assets, data_dir, name, template="qwen3_5", cutoff_len=4096)
    kept = lf_reference(config, tmp_path)
    assert all(think <= set(labels) for samples in kept.values() for _, labels in samples)


# --- the statistics ---------------------------------------------------------------------------------


def test_stats_agree_with_llamafactory_datasets(tmp_path, demo_assets):
    data_dir, name = prepared(tmp_path)
    config = config_for(tmp_path, demo_assets, data_dir, name, cutoff_len=200)
    result = compute_stats(config, workers=1)
    cut, full = lf_reference(config, tmp_path), lf_reference(config, tmp_path, cutoff_len=UNLIMITED)
    for split in ("train", "validation"):
        s = result["splits"][split]
        lengths = np.array([len(i) for i, _ in full[split]])
        assert s["samples"] == len(lengths) and s["dropped_invalid"] == 0
        assert s["length"]["max"] == lengths.max() and s["length"]["mean"] == round(float(lengths.mean()), 1)
        assert s["length"]["p90"] == int(np.percentile(lengths, 90, method="inverted_cdf"))
        assert (lengths <= s["length"]["p90"]).mean() >= 0.9  # at least that share is no longer
        assert s["truncated"]["count"] == int((lengths > 200).sum()) > 0
        assert s["supervised_tokens"]["before"] == sum(supervised(la) for _, la in full[split])
        assert s["supervised_tokens"]["after"] == sum(supervised(la) for _, la in cut[split])
        assert s["tokens"]["after"] == sum(len(i) for i, _ in cut[split])
    assert any("get truncated" in w for w in result["warnings"])


def test_samples_left_without_supervised_tokens_are_counted(tmp_path, demo_assets):
    # a system prompt far longer than cutoff_len: infer_seqlen leaves the reply a share that rounds to 0
    data_dir, name = prepared(tmp_path, system=HANDBOOK * 80)
    config = config_for(tmp_path, demo_assets, data_dir, name, cutoff_len=64)
    result = short_stats(config, sample=500)
    cut = lf_reference(config, tmp_path)
    for split in ("train", "validation"):
        expected = sum(1 for _, labels in cut[split] if supervised(labels) == 0)
        assert result["splits"][split]["no_supervised"]["after"] == expected > 0
        assert result["splits"][split]["no_supervised"]["before"] == 0
    assert any("keep no supervised token" in p for p in result["problems"])  # refuses a formal run


def test_short_stats_samples_and_thresholds(tmp_path, demo_assets):
    data_dir, name = prepared(tmp_path)
    long_enough = config_for(tmp_path, demo_assets, data_dir, name, cutoff_len=4096)
    result = short_stats(long_enough, sample=5)
    train = result["splits"]["train"]
    assert result["sampled"] == 5 and train["samples"] == 5 and train["records_total"] > 5
    assert train["truncated"]["count"] == 0 and result["warnings"] == []
    json.dumps(result)  # JSON-ready, for the run directory
    tight = config_for(tmp_path, demo_assets, data_dir, name, cutoff_len=200)
    share = max(s["truncated"]["share"] for s in short_stats(tight)["splits"].values())
    assert 0 < share < 1
    assert not any("get truncated" in w for w in short_stats(tight, warn_share=share)["warnings"])  # at the threshold
    assert any("get truncated" in w for w in short_stats(tight, warn_share=share / 2)["warnings"])


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_invalid_samples_are_counted_and_not_quoted(tmp_path, demo_assets):
    data_dir, name = prepared(tmp_path, "dialogue", system="Be kind.")
    path = data_dir / f"{name}.json"
    rows = json.loads(path.read_text())
    rows[0]["conversations"][1]["from"] = "human"  # two client turns in a row: LLaMA-Factory skips the sample
    path.write_text(json.dumps(rows))
    logger, seen = logging.getLogger("llamafactory"), _Collect()  # every LLaMA-Factory logger ends here
    logger.addHandler(seen)
    try:
        result = compute_stats(config_for(tmp_path, demo_assets, data_dir, name, cutoff_len=4096), workers=1)
    finally:
        logger.removeHandler(seen)
    assert result["splits"]["train"]["dropped_invalid"] == 1
    assert result["splits"]["train"]["samples"] == len(rows) - 1
    assert any("drops 1 sample" in w for w in result["warnings"])
    assert any(m.startswith("Invalid role tag in [record text withheld") for m in seen.messages)
    assert not any(SENTINEL in m for m in seen.messages)


def test_unregistered_dataset_is_a_clear_error(tmp_path, demo_assets):
    data_dir, _ = prepared(tmp_path)
    config = config_for(tmp_path, demo_assets, data_dir, "no_such_set", cutoff_len=4096)
    with pytest.raises(StatsError, match="no_such_set.*register it"):
        compute_stats(config)


def test_template_without_processor_is_a_clear_error(tmp_path, demo_assets):
    import shutil

    bare = tmp_path / "model-without-processor"
    bare.mkdir()
    for file in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_assets["model"] / file, bare / file)
    data_dir, name = prepared(tmp_path)
    config = load_run_config(
        make_config(tmp_path, {"model": bare, "data": data_dir}, dataset=name, eval_dataset=None, cutoff_len=4096)
    )
    with pytest.raises(StatsError, match="template 'qwen3_5_nothink'.*Processor was not found"):
        compute_stats(config, workers=1)


def test_cli_stats_writes_json_and_plot_without_printing_text(tmp_path, demo_assets):
    data_dir, name = prepared(tmp_path)
    config = config_for(tmp_path, demo_assets, data_dir, name, cutoff_len=200)
    proc = launcher_cmd("data", "stats", config.source)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "length p99" in proc.stdout and "over cutoff_len 200" in proc.stdout and "warning:" in proc.stdout
    assert SENTINEL not in proc.stdout + proc.stderr
    out = tmp_path / "runs" / "data-stats-demo-cpu"  # default: next to the runs, named after the run
    result = json.loads((out / "data_stats.json").read_text())
    assert set(result["splits"]) == {"train", "validation"} and result["cutoff_len"] == 200
    assert (out / "data_stats.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    shown = launcher_cmd("data", "stats", config.source, "--out", tmp_path / "s", "--no-plot", "--show-samples", "1")
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert SENTINEL in shown.stdout and not (tmp_path / "s" / "data_stats.png").exists()


def test_cli_stats_missing_config(tmp_path):
    proc = launcher_cmd("data", "stats", tmp_path / "nope.yaml")
    assert proc.returncode == 2 and "config file not found" in proc.stderr and "Traceback" not in proc.stderr


# --- privacy: no training text in the training log ---------------------------------------------------


def test_protect_training_log_replaces_the_example_dump(capsys, demo_assets):
    from llamafactory.data.processor import PackedSupervisedDatasetProcessor, SupervisedDatasetProcessor
    from transformers import AutoTokenizer

    from launcher.data.privacy import WITHHELD, protect_training_log, restore_training_log

    tokenizer = AutoTokenizer.from_pretrained(demo_assets["model"])
    restore_training_log()  # a known start: other tests in this process may have protected it
    ids = tokenizer.encode(f"hello {SENTINEL}", add_special_tokens=False)
    example = {"input_ids": ids, "labels": [IGNORE_INDEX, *ids[1:]]}
    processor = SupervisedDatasetProcessor(template=None, tokenizer=tokenizer, processor=None, data_args=None)
    processor.print_data_example(example)
    assert SENTINEL in capsys.readouterr().out  # the control: LLaMA-Factory prints the text

    try:
        assert "SupervisedDatasetProcessor" in protect_training_log()
        protect_training_log()  # idempotent
        processor.print_data_example(example)
        PackedSupervisedDatasetProcessor(None, tokenizer, None, None).print_data_example(example)
        out = capsys.readouterr().out
        assert SENTINEL not in out and f"input_ids: {len(ids)} tokens, {len(ids) - 1} supervised" in out

        seen = _Collect()
        logger = logging.getLogger("llamafactory.data.processor.supervised")
        logger.addHandler(seen)
        try:
            logger.warning("Dropped invalid example: [{'role': 'user', 'content': '%s'}]", SENTINEL)
        finally:
            logger.removeHandler(seen)
        assert seen.messages == [f"Dropped invalid example: [record {WITHHELD}]"]
    finally:
        restore_training_log()
    processor.print_data_example(example)
    assert SENTINEL in capsys.readouterr().out


def test_log_examples_wanted_reads_the_run_config(tmp_path):
    from launcher.data.privacy import log_examples_wanted

    assert not log_examples_wanted(tmp_path)
    (tmp_path / "config.yaml").write_text("launcher:\n  log_examples: true\n")
    assert log_examples_wanted(tmp_path)
    (tmp_path / "launch.json").write_text(json.dumps({"log_examples": False}))
    assert not log_examples_wanted(tmp_path)  # the launcher's own record wins once it carries the key


@pytest.mark.slow
def test_training_log_carries_no_training_text(tmp_path, demo_assets):
    data_dir, name = prepared(tmp_path)
    cfg = make_config(
        tmp_path,
        demo_assets,
        dataset_dir=str(data_dir),
        dataset=name,
        eval_dataset=f"{name}_val",
        max_steps=2,
        save_steps=2,
        eval_steps=2,
    )
    proc = launcher_cmd("run", cfg, "--quiet")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = only_run_dir(tmp_path / "runs")
    log = (run_dir / "launcher.log").read_text()
    assert "training example:" in log and "text withheld" in log  # the dump point was reached and replaced
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert SENTINEL.encode() not in path.read_bytes(), path

    # the control: with the dump asked for (launcher.log_examples: true), the same data does reach the log
    opt_in = {"log_examples": True}
    (tmp_path / "opt-in").mkdir()
    # two steps, as above: after one step of warmup the LoRA B matrices are still zero, which the acceptance
    # checklist fails (FAILED_ACCEPTANCE, exit code 4)
    cfg = make_config(
        tmp_path / "opt-in",
        demo_assets,
        launcher=opt_in,
        dataset_dir=str(data_dir),
        dataset=name,
        eval_dataset=f"{name}_val",
        max_steps=2,
        save_steps=2,
        eval_steps=2,
    )
    proc = launcher_cmd("run", cfg, "--quiet")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert SENTINEL in (only_run_dir(tmp_path / "opt-in" / "runs") / "launcher.log").read_text()
