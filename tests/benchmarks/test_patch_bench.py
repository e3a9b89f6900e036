"""The patch benchmark's plumbing on the CPU: assets, configs, the rank entry's hooks, and (slow) a whole run.

The H200 measurement itself (27B shape, CUDA) is in docs/performance.md; here the same code runs with the tiny
shape through ``launcher run``, so a broken path fails before anyone spends GPU time on it.
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from benchmarks import bench_assets, bench_entry, fla_guard, patch_bench  # noqa: E402
from benchmarks.results_schema import Results  # noqa: E402
from launcher.config.run_config import load_run_config  # noqa: E402
from launcher.state.runs import JOB_LOG  # noqa: E402


@pytest.fixture(scope="module")
def model_27b(tmp_path_factory):
    return bench_assets.write_model_dir(tmp_path_factory.mktemp("b27") / "model", "27b")


def test_27b_folder_has_the_design_shape_and_no_weights(model_27b):
    config = json.loads((model_27b / "config.json").read_text())
    text, vision = config["text_config"], config["vision_config"]
    assert text["num_hidden_layers"] == 64
    assert [i for i, t in enumerate(text["layer_types"]) if t == "full_attention"] == list(range(3, 64, 4))
    assert (text["hidden_size"], text["intermediate_size"], text["vocab_size"]) == (5120, 17408, 248320)
    assert (text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]) == (24, 4, 256)
    assert (text["linear_num_key_heads"], text["linear_num_value_heads"]) == (16, 48)
    assert (vision["depth"], vision["hidden_size"], vision["intermediate_size"], vision["out_hidden_size"]) == (
        27,
        1152,
        4304,
        5120,
    )
    assert max(config[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id")) < 248320
    assert config["dtype"] == "bfloat16"
    assert (model_27b / bench_assets.MARKER).is_file() and not list(model_27b.glob("*.safetensors"))
    processor = json.loads((model_27b / "processor_config.json").read_text())
    assert processor["image_processor"]["patch_size"] == vision["patch_size"] == 16


def test_27b_parameter_count_matches_51_gib_of_bf16_weights(model_27b):
    counts = bench_assets.count_parameters(model_27b)
    assert counts["total"] == 27_356_728_560
    assert round(counts["total"] * 2 / 2**30, 1) == 51.0


def test_dataset_samples_exceed_the_cutoff_on_both_sides(tmp_path):
    model = bench_assets.write_model_dir(tmp_path / "model", "tiny")
    data = bench_assets.write_dataset(tmp_path / "data", model, cutoff_len=300, samples=2)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    records = json.loads((data / "bench_long.json").read_text())
    assert len(records) == 2
    for record in records:
        assert len(tokenizer(record["instruction"])["input_ids"]) >= 300
        assert len(tokenizer(record["output"])["input_ids"]) >= 300
    assert json.loads((data / "dataset_info.json").read_text())["bench_long"]["file_name"] == "bench_long.json"


def test_a_reply_share_keeps_the_cutoff_and_gives_the_response_its_share_after_llamafactorys_truncation(tmp_path):
    """``write_dataset``'s samples through LLaMA-Factory's own truncation (``infer_seqlen``, on the lengths the
    template's encoding gives): the cutoff in all, the response about its share of it (the system prompt and the
    template's tokens count on the prompt's side)."""
    from llamafactory.data.processor.processor_utils import infer_seqlen
    from transformers import AutoTokenizer

    model = bench_assets.write_model_dir(tmp_path / "model", "tiny")
    tokenizer = AutoTokenizer.from_pretrained(model)
    kept = {}
    for share in (0.5, bench_assets.SPREAD_REPLY_SHARE):
        data = bench_assets.write_dataset(
            tmp_path / f"data-{share}", model, cutoff_len=300, samples=2, reply_share=share
        )
        records = json.loads((data / "bench_long.json").read_text())
        for record in records:
            source = len(tokenizer(record["system"] + record["instruction"])["input_ids"])
            target = len(tokenizer(record["output"])["input_ids"])
            assert min(source, target) * 2 >= 300  # both sides are truncated, in proportion
            kept_source, kept_target = infer_seqlen(source, target, 300)
            assert kept_source + kept_target == 300
            kept.setdefault(share, []).append(kept_target)
    assert all(140 <= n <= 150 for n in kept[0.5]), kept  # about half: the system prompt is the prompt's
    assert all(200 <= n <= 210 for n in kept[0.7]), kept  # about 70 %
    with pytest.raises(ValueError, match="reply_share 0.9 is outside 0.3 to 0.7"):
        bench_assets.write_dataset(tmp_path / "bad", model, cutoff_len=300, reply_share=0.9)
    assert not (tmp_path / "bad").exists()


DEFAULT_ON = {
    "deltanet_routing": True,
    "checkpoint_all_layers": True,
    "chunked_loss": True,
    "text_only_batches": True,
    "final_eval_once": True,
    "pad_lengths": False,
    "packed_rows": True,
    "fused_ops": True,
    "lora_input_cast": True,
    "fsdp2_frozen_dtype": True,
    "fsdp2_resume_adapter": True,
    "gc_freeze": True,
}


@pytest.mark.parametrize(
    "variant",
    [
        "on",
        "off",
        "budget120",
        "spread-pad256",
        "ctx64k",
        "spread-packed",
        "short-packed",
        "glue-off",
        "forecast-oom",
        "gc-off",
        "heads-repeated",
        "on-reply70",
    ],
)
def test_variant_configs_pass_the_launchers_validation(tmp_path, variant):
    bench_assets.write_model_dir(tmp_path / "model", "tiny")
    config = patch_bench.run_config(tmp_path, variant, "27b", "cuda", steps=6)
    path = tmp_path / f"{variant}.yaml"
    import yaml

    path.write_text(yaml.safe_dump(config))
    loaded = load_run_config(path)
    assert loaded.launcher.entry == "benchmarks.bench_entry" and not loaded.launcher.smoke
    lf = loaded.llamafactory
    cutoff = {"ctx64k": 65536, "forecast-oom": 131072}.get(variant, 4096)
    assert (lf["cutoff_len"], lf["per_device_train_batch_size"], lf["lora_rank"], lf["bf16"]) == (cutoff, 1, 8, True)
    assert lf["lora_target"] == "q_proj,k_proj,v_proj,o_proj" and lf["gradient_checkpointing"] is True
    assert lf["dataset"] == ("bench_spread" if variant.startswith(("spread", "short")) else "bench_long")
    assert Path(lf["dataset_dir"]).name == (
        "data-short"
        if variant.startswith("short")
        else "data-spread"
        if variant.startswith("spread")
        else f"data-{cutoff}-reply70"
        if variant == "on-reply70"
        else f"data-{cutoff}"
    )
    enabled = {name: options["enabled"] for name, options in loaded.patches.items()}
    if variant == "off":
        assert not any(enabled.values())
    elif variant == "glue-off":
        assert enabled == {**DEFAULT_ON, "fused_ops": False, "lora_input_cast": False}
    elif variant == "gc-off":
        assert enabled == {**DEFAULT_ON, "gc_freeze": False}
    else:
        assert enabled == {**DEFAULT_ON, "pad_lengths": variant == "spread-pad256"}
    if variant == "budget120":
        assert loaded.patches["checkpoint_all_layers"]["memory_budget_gib"] == 120.0
    assert loaded.patches["packed_rows"]["unpacked_forward"] is (variant != "heads-repeated")
    assert lf.get("packing", False) is variant.endswith("-packed")


def test_spread_samples_span_the_asked_lengths(tmp_path):
    model = bench_assets.write_model_dir(tmp_path / "model", "tiny")
    data = bench_assets.write_spread_dataset(tmp_path / "data", model, 100, 400, samples=12)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    records = json.loads((data / "bench_spread.json").read_text())
    totals = [len(tokenizer(r["instruction"] + " " + r["output"])["input_ids"]) for r in records]
    assert min(totals) >= 100 * 0.7 and max(totals) <= 400 * 1.1 and max(totals) - min(totals) > 100


def test_the_robust_line_ignores_a_stray_point_that_least_squares_follows():
    points = [(x, 1.0 + 2e-4 * x) for x in (1000, 2000, 3000, 4000, 2500, 3500)] + [(2000, 130.0)]
    slope, intercept = patch_bench.robust_line(points)
    assert slope == pytest.approx(2e-4) and intercept == pytest.approx(1.0)
    import statistics

    xs, ys = [x for x, _ in points], [y for _, y in points]
    assert statistics.linear_regression(xs, ys).slope < 0  # what the benchmark read before
    with pytest.raises(ValueError, match="two distinct x"):
        patch_bench.robust_line([(4096, 1.0), (4096, 1.2)])


def test_a_seen_length_that_compiles_is_fitted_without_its_compile_seconds():
    """A stray at a length met rarely outweighs the robust line alone (in 3 of its 5 pairs); its own compile
    seconds, recorded by bench_entry, are taken out before the fit."""
    steps = [{"seq_len": 1000, "seconds": 30.0, "compile_autotune_s": 29.0}]
    steps += [{"seq_len": n, "seconds": n / 1000, "compile_autotune_s": 0.0} for n in (1000, 1000, 2000, 2000)]
    steps += [{"seq_len": 3000, "seconds": 3.0 + 9.0, "compile_autotune_s": 9.0}]  # new: 9 s lost
    steps += [{"seq_len": 3000, "seconds": 3.0 + 120.0, "compile_autotune_s": 120.0}]  # seen, and compiling
    assert patch_bench.lengths_summary(steps, warmup=1)["seconds_lost_to_new_lengths"] == pytest.approx(9.0)


def test_lengths_summary_counts_new_lengths_and_the_time_they_lost():
    steps = [{"seq_len": 1000, "seconds": 30.0, "supervised_tokens": 500}]  # the first step, on its own
    seen = (1000, 2000, 1000, 2000, 1000, 2000)
    steps += [{"seq_len": n, "seconds": n / 1000, "supervised_tokens": n // 2} for n in seen]
    # a length seen before that compiles all the same (the first row of two samples): no part of the line
    steps += [{"seq_len": 2000, "seconds": 2.0 + 120.0, "supervised_tokens": 1000}]
    steps += [{"seq_len": 3000, "seconds": 3.0 + 9.0, "supervised_tokens": 1500}]  # a new length: 9 s compile
    summary = patch_bench.lengths_summary(steps, warmup=1)
    assert summary["distinct_seq_lens"] == 3 and summary["new_length_steps"] == 2
    assert summary["seconds_lost_to_new_lengths"] == pytest.approx(9.0)
    assert summary["supervised_tokens_per_s"] == pytest.approx(7000 / 143.0, rel=1e-3)
    assert summary["supervised_tokens_per_s_minus_compile"] is None  # these steps carry no compile time


def test_the_steady_state_takes_triton_compile_time_out_of_the_steps():
    steps = [{"seq_len": 1000, "seconds": 30.0, "supervised_tokens": 500, "compiles": 40, "compile_autotune_s": 28.0}]
    steps += [
        {"seq_len": n, "seconds": n / 1000, "supervised_tokens": n // 2, "compiles": 0, "compile_autotune_s": 0.0}
        for n in (1000, 2000, 1500)
    ]
    steps += [{"seq_len": 1500, "seconds": 1.51, "supervised_tokens": 750, "compiles": 2, "compile_autotune_s": 0.01}]
    steps += [{"seq_len": 3000, "seconds": 12.0, "supervised_tokens": 1500, "compiles": 3, "compile_autotune_s": 9.0}]
    summary = patch_bench.lengths_summary(steps, warmup=1)
    assert summary["supervised_tokens_per_s_minus_compile"] == pytest.approx(4500 / 9.0)  # 18.01 s less 9.01 s
    assert summary["compile_autotune_s_after_warmup"] == pytest.approx(9.01)
    assert summary["compile_autotune_s"] == pytest.approx(37.01)
    assert summary["supervised_tokens_per_s"] == pytest.approx(4500 / 18.01, rel=1e-3)


def test_a_step_counts_the_tokens_of_every_kind_of_mask():
    """A packed row reaches the model as LLaMA-Factory's sample numbers (``packed_rows.device_mask``): its tokens are
    the non-zero numbers, not their sum (which counted a row's second sample twice, its third three times)."""
    import torch

    from patches.packing.masks import block_causal_mask

    numbers = torch.tensor([[1, 1, 2, 2, 2, 3, 0, 0]], dtype=torch.int32)
    assert bench_entry.real_tokens(numbers, None) == 6
    assert bench_entry.real_tokens(block_causal_mask(numbers, torch.float32), None) == 6
    assert bench_entry.real_tokens(torch.tensor([[1, 1, 1, 0]]), None) == 3
    assert bench_entry.real_tokens(None, torch.zeros(2, 5)) == 10


def test_a_step_counts_its_samples_from_a_packed_rows_numbers_or_one_a_row():
    import torch

    from patches.packing.masks import block_causal_mask

    numbers = torch.tensor([[1, 1, 2, 2, 2, 3, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0]], dtype=torch.int32)
    assert bench_entry.row_samples(numbers) == 4  # three in the first row, one in the second
    assert bench_entry.row_samples(torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])) == 2  # unpacked: one a row
    assert bench_entry.row_samples(block_causal_mask(numbers, torch.float32)) is None  # a 4D mask: not counted
    assert bench_entry.row_samples(None) is None


def test_the_gc_clock_counts_a_full_collection_and_its_seconds():
    import gc

    clock = bench_entry.GcClock()
    enabled = gc.isenabled()
    gc.disable()  # no automatic collection in between: only the two below
    gc.callbacks.append(clock)
    try:
        gc.collect(0)
        assert clock.read()[1] == 0  # a young generation's collection is no full one
        gc.collect()
    finally:
        gc.callbacks.remove(clock)
        if enabled:
            gc.enable()
    seconds, full = clock.read()
    assert full == 1 and seconds > 0


def test_the_summary_splits_the_measured_steps_by_their_samples_and_sums_the_collectors_seconds(tmp_path):
    """Steps as the rank records them (written here): the warm-up left out, each sample count its own medians, the
    garbage collector's seconds summed over the measured periods."""
    from launcher.files import write_json_atomic

    def step(seconds, samples, period, gc_s, full):
        return {
            "seconds": seconds,
            "samples": samples,
            "period_s": period,
            "period_gc_s": gc_s,
            "period_full_gcs": full,
            "tokens": 4000,
            "seq_len": 4096,
            "peak_allocated_gib": 55.0,
        }

    steps = [
        step(9.0, 2, 9.5, 0.5, 1),
        step(1.10, 1, 1.15, 0.001, 0),
        step(1.20, 2, 1.25, 0.0, 0),
        step(1.12, 1, 1.60, 0.4, 1),
        step(1.22, 2, 1.27, 0.002, 0),
        step(1.14, 1, None, None, None),
    ]
    run_dir = tmp_path / "run"
    (run_dir / "bench").mkdir(parents=True)
    write_json_atomic(run_dir / "bench" / "rank0.json", {"steps": steps})
    write_json_atomic(run_dir / "status.json", {"state": "SUCCEEDED"})
    found = patch_bench.summarize(run_dir, warmup=1)
    assert found["step_samples"] == [2, 1, 2, 1, 2, 1]
    assert found["by_samples"] == {
        "1": {"steps": 3, "median_fwd_bwd_s": 1.12, "median_period_s": 1.375},
        "2": {"steps": 2, "median_fwd_bwd_s": 1.21, "median_period_s": 1.26},
    }
    assert found["gc_s_measured"] == pytest.approx(0.403) and found["full_gcs_measured"] == 1
    assert found["gc_s_longest_period"] == 0.4


def test_random_init_builds_a_marked_folder_without_weights(tmp_path, monkeypatch):
    import torch
    from transformers import AutoModelForImageTextToText, PreTrainedModel

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", PreTrainedModel.__dict__["from_pretrained"])
    model_dir = bench_assets.write_model_dir(tmp_path / "model", "tiny")
    recorder = bench_entry.Recorder(tmp_path)
    bench_entry.install_random_init("cpu", recorder)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.bfloat16)
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration"
    assert next(model.parameters()).dtype == torch.bfloat16 and not model.training
    built = json.loads((tmp_path / "bench" / "rank0.json").read_text())["model_build"]
    assert built["parameters"] == sum(p.numel() for p in model.parameters()) and "random init" in built["how"]
    (model_dir / bench_assets.MARKER).unlink()  # an unmarked folder takes the normal path, which needs weights
    with pytest.raises(OSError):
        AutoModelForImageTextToText.from_pretrained(model_dir)


def test_fla_guard_is_lifted_only_where_it_would_fire(monkeypatch):
    chunk_o = types.ModuleType("fla.ops.common.chunk_o")
    chunk_o.IS_NVIDIA_HOPPER, chunk_o.TRITON_ABOVE_3_4_0, chunk_o.TRITON_ABOVE_3_7_1 = True, True, False
    for name in ("fla", "fla.ops", "fla.ops.common"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.common.chunk_o", chunk_o)
    record = fla_guard.lift_hopper_guard()
    assert record["lifted"] and chunk_o.TRITON_ABOVE_3_7_1 is True
    assert record["flags_before"]["TRITON_ABOVE_3_7_1"] is False
    chunk_o.IS_NVIDIA_HOPPER = False
    assert not fla_guard.lift_hopper_guard()["lifted"]


def test_targets_compare_with_the_documented_ones():
    ok = {"state": "SUCCEEDED"}
    profile = {"report": {"ranks": [{"parts_s": {"other_compute": 0.31}}]}}
    found = patch_bench.targets(
        {
            "on": {**ok, "peak_allocated_gib": 55.1, "tokens_per_s": 3419.0},
            "budget120": {**ok, "peak_allocated_gib": 121.0, "tokens_per_s": 4500.0},
            "ctx64k": {"state": "FAILED", "peak_allocated_gib": 90.0},
            "profile": {**ok, "profile": profile},
        }
    )
    assert found["on"]["peak_allocated_gib"]["met"] and found["on"]["tokens_per_s"]["met"]
    assert not found["budget120"]["peak_allocated_gib"]["met"] and not found["budget120"]["tokens_per_s"]["met"]
    assert found["budget120"]["tokens_per_s"]["shortfall"] == pytest.approx(1 - 4500 / 4600, abs=1e-4)
    assert found["profile"]["other_compute_s"] == {"value": 0.31, "limit": 0.25, "met": False}
    assert found["ctx64k"]["peak_allocated_gib"]["met"] and not found["ctx64k"]["succeeded"]
    assert "ctx32k" not in found


def test_the_packed_row_target_pools_the_rounds_after_the_warm_up_and_says_whether_the_noise_decides_it():
    """A packed variant against its unpacked pair: every succeeded round's steps after the warm-up pooled, the
    difference of the medians of the period (the target) and of forward+backward, with a seeded bootstrap interval
    over step positions (a position's rounds resampled together)."""

    def run(seconds, periods, state="SUCCEEDED"):
        return {"state": state, "warmup_steps": 1, "step_seconds": [9.0, *seconds], "step_periods": [9.5, *periods]}

    variants = {
        "on": run([1.20, 1.21, 1.19], [1.25, 1.26, 1.24]),
        "spread-packed": run([1.18, 1.19, 1.17], [1.22, 1.23, 1.21]),
        "on#2": run([5.0, 5.0], [5.0, 5.0], state="TERMINATED"),  # a round that did not succeed: left out
        "spread-packed#2": run([1.185, 1.175, 1.18], [1.225, 1.215, 1.22]),
    }
    row = patch_bench.targets(variants)["spread-packed-row"]
    assert row["against"] == "on" and row["met"] and row["resolved"]
    assert row["period"]["steps"] == [6, 3] and row["period"]["positions"] == [3, 3]
    assert row["period"]["unpacked_s"] == 1.25 and row["decided_by"] == "period"
    assert row["period"]["difference_s"] == pytest.approx(1.22 - 1.25)
    assert row["fwd_bwd"]["difference_s"] == pytest.approx(1.18 - 1.20)
    low, high = row["period"]["ci95_s"]
    assert low <= row["period"]["difference_s"] <= high < 0
    assert row["period"]["ci95_s"] == [-0.0425, -0.0175]  # seeded: the same file gives the same interval
    variants["spread-packed"] = run([1.18, 1.22, 1.21], [1.20, 1.27, 1.26])  # straddles the unpacked steps
    variants["spread-packed#2"] = run([1.2], [1.24])
    row = patch_bench.targets(variants)["spread-packed-row"]
    assert not row["resolved"] and row["period"]["ci95_s"][0] < 0 < row["period"]["ci95_s"][1]
    assert "spread-packed-workers-row" not in patch_bench.targets(variants)  # no workers variant ran
    assert "spread-packed-row-reply70" not in patch_bench.targets(variants)  # nor on-reply70
    variants["on-reply70"] = run([1.23, 1.24, 1.22], [1.28, 1.29, 1.27])  # the like pair: same rows, other steps
    like = patch_bench.targets(variants)["spread-packed-row-reply70"]
    assert like["against"] == "on-reply70" and like["period"]["unpacked_s"] == 1.28 and like["met"]
    assert patch_bench.targets(variants)["spread-packed-row"]["period"] == row["period"]  # "on"'s, unchanged
    # the rounds replay the same rows in the same order: three rounds of the same steps are one observation of
    # each row, so they leave the interval as one round gives it (resampling steps would narrow it threefold)
    one = {
        "on": run([1.20, 1.18, 1.21, 1.19, 1.22], [1.25, 1.22, 1.26, 1.24, 1.23]),
        "spread-packed": run([1.15, 1.30, 1.17, 1.24, 1.19], [1.19, 1.33, 1.21, 1.28, 1.22]),
    }
    three = {**one, **{f"{name}#{r}": one[name] for name in one for r in (2, 3)}}
    once, thrice = (patch_bench.targets(v)["spread-packed-row"]["period"] for v in (one, three))
    assert thrice["steps"] == [15, 15] and once["steps"] == [5, 5] and thrice["positions"] == [5, 5]
    assert thrice["ci95_s"] == once["ci95_s"] and thrice["difference_s"] == once["difference_s"]
    assert once["ci95_s"][0] < 0 < once["ci95_s"][1]


def test_results_files_of_several_calls_pool_their_rounds(tmp_path):
    """Two calls' files, each with its own rounds 1 and 2: pooled, the second file's rounds follow the first's, so
    the packed-row target reads all four rounds of each side, as one file of four rounds would."""

    def run(seconds):
        return {"state": "SUCCEEDED", "warmup_steps": 0, "step_seconds": seconds, "step_periods": seconds}

    first = {
        "spread-packed": run([1.20, 1.30]),
        "on": run([1.25, 1.25]),
        "spread-packed#2": run([1.21, 1.31]),
        "on#2": run([1.26, 1.24]),
    }
    second = {
        "spread-packed": run([1.19, 1.29]),
        "on": run([1.25, 1.27]),
        "spread-packed#2": run([1.22, 1.32]),
        "on#2": run([1.23, 1.25]),
    }
    paths = []
    for name, variants in (("a", first), ("b", second)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps({"variants": variants}))
    one_file = {
        **first,
        **{f"{key.split('#')[0]}#{int((key.split('#') + ['1'])[1]) + 2}": run_ for key, run_ in second.items()},
    }
    assert sorted(one_file) == sorted([*first, "spread-packed#3", "spread-packed#4", "on#3", "on#4"])
    pooled = patch_bench.pooled_targets(*paths)["spread-packed-row"]
    assert pooled == patch_bench.targets(one_file)["spread-packed-row"]
    assert pooled["fwd_bwd"]["steps"] == [8, 8] and pooled["fwd_bwd"]["positions"] == [2, 2]
    assert patch_bench.pooled_targets(paths[0])["spread-packed-row"]["fwd_bwd"]["steps"] == [4, 4]


def test_the_packed_rows_are_also_read_at_the_unpacked_steps_supervised_tokens():
    """Beside the target, not deciding it: the robust line of the packed rows' forward+backward on their supervised
    tokens over every succeeded round after the warm-up, read at the unpacked steps' median supervised tokens; a
    row that compiled for two minutes does not move it; None for results without the steps' supervised tokens."""

    def run(seconds, supervised, state="SUCCEEDED"):
        return {
            "state": state,
            "warmup_steps": 1,
            "step_seconds": [9.0, *seconds],
            "step_periods": [9.5, *seconds],
            "step_supervised": [100, *supervised],
        }

    # packed: 1.0 s + 100 µs a supervised token, exactly; unpacked: 2,000 supervised tokens in 1.25 s
    variants = {
        "on": run([1.25, 1.26, 1.24], [2000, 2000, 2000]),
        "spread-packed": run([1.25, 1.3, 1.2], [2500, 3000, 2000]),
        "spread-packed#2": run([1.28, 121.0], [2800, 2600]),
        "spread-packed#3": run([5.0], [2000], state="TERMINATED"),
    }
    row = patch_bench.targets(variants)["spread-packed-row"]
    equal = row["at_equal_supervised"]
    assert equal["slope_us_per_token"] == pytest.approx(100.0) and equal["packed_at_it_s"] == pytest.approx(1.2)
    assert equal["unpacked_supervised"] == 2000 and equal["unpacked_s"] == 1.25 and equal["steps"] == 5
    assert equal["difference_s"] == pytest.approx(-0.05) and equal["packed_mean_supervised"] == 2580
    assert row["met"] is False  # the target itself compares the medians as they are: 1.28 against 1.25
    for v in variants.values():
        del v["step_supervised"]
    assert patch_bench.targets(variants)["spread-packed-row"]["at_equal_supervised"] is None


def run_tiny_bench(out, *args: str) -> dict:
    """``patch_bench`` with the tiny shape on the CPU; its results, once it exited 0."""
    code = patch_bench.main(["--out", str(out), "--shape", "tiny", "--samples", "3", "--timeout", "600", *args])
    written = Results.read(out / "results.json")  # the results schema, validated
    assert code == 0, written
    assert written.bench == "benchmarks.patch_bench" and written.command.startswith("python -m benchmarks.patch_bench")
    assert written.commit and written.versions["torch"] and written.device.startswith("cpu")
    assert written.converted is None and written.figures  # every variant's numbers, by path
    assert all(written.figures[f"{name}.tokens_per_s"] == v["tokens_per_s"] for name, v in written.variants.items())
    return written.raw()


def test_allocator_retries_are_counted_over_the_measured_steps_only():
    steps = [{"alloc_retries": n} for n in (3, 3, 5, 9)]  # cumulative, as the device's counter
    assert patch_bench._retries_in(steps, warmup=2) == 6  # steps 3 and 4: 9 - 3
    assert patch_bench._retries_in(steps, warmup=0) == 9
    assert patch_bench._retries_in(steps, warmup=4) == 9  # no step after the warm-up: all of them, as the medians
    assert patch_bench._retries_in([{"alloc_retries": None}], warmup=0) is None  # the CPU has no counter


def test_a_run_stopped_inside_the_kernel_check_says_which_case_and_ends_with_its_job_log(tmp_path):
    """What a variant stopped by ``--timeout`` before its first step leaves (written here as the rank and the job
    write them): the cases done with their seconds, the one running, and the last lines the job printed."""
    from launcher.files import write_json_atomic

    run_dir = tmp_path / "run"
    (run_dir / "bench").mkdir(parents=True)
    progress = {
        "done": [{"case": "varlen_grouped", "status": "pass", "seconds": 41.2}],
        "running": {"case": "qwen3_5_27b", "since": "2026-12-04T16:40:00.000Z"},
    }
    write_json_atomic(run_dir / "bench" / "rank0.json", {"steps": [], "kernel_check_progress": progress})
    write_json_atomic(run_dir / "status.json", {"state": "TERMINATED", "reason": "received SIGTERM"})
    lines = [f"line {i}" for i in range(patch_bench.LOG_TAIL_LINES + 5)]
    (run_dir / JOB_LOG).write_text("\n".join([*lines, "validate-kernels: [2/8] qwen3_5_27b ..."]) + "\n")
    found = patch_bench.summarize(run_dir, warmup=2)
    assert found["steps_recorded"] == 0 and found["kernel_check"] is None and found["kernel_check_progress"] == progress
    assert len(found["job_log_tail"]) == patch_bench.LOG_TAIL_LINES
    assert found["job_log_tail"][-1] == "validate-kernels: [2/8] qwen3_5_27b ..."


def test_the_job_log_tail_folds_tritons_reproducer_dumps(tmp_path):
    """Triton prints a failed ptxas run's PTX between two rules and a request to share it (its compiler.py); an
    autotune that skips such a config goes on, and the dump can fill the tail. Each dump folds to one line with its
    first line (the error); one whose start is before the window read folds too; the lines around stay."""
    rule, end = patch_bench.REPRODUCER_RULE, patch_bench.REPRODUCER_END
    ptx = [f"  ld.global.u32 %r{i}, [%rd{i}];" for i in range(2000)]
    first = ["step 0 begins", "", rule, "`ptxas` failed with error code 255", "", *ptx, rule, end]
    second = [rule, "`ptxas` failed again", *ptx[:50], rule, end]
    log = tmp_path / "job.log"
    log.write_text("\n".join([*first, "validate-kernels: [3/8] conv_27b ...", *second, "last line"]) + "\n")
    whole = patch_bench.readable_tail(log, 100)
    folded = "[a Triton reproducer dump of {} lines, folded; its first line: {}]"
    progress = "validate-kernels: [3/8] conv_27b ..."
    assert whole == [
        "step 0 begins",
        "",
        folded.format(2002, "`ptxas` failed with error code 255"),
        progress,
        folded.format(51, "`ptxas` failed again"),
        "last line",
    ]
    cut = patch_bench.readable_tail(log, 5)  # reads the last 1,000 lines: from inside the first dump
    assert cut[0].startswith("[a Triton reproducer dump of") and "ld.global" in cut[0] and cut[1:] == whole[3:]


def test_the_device_reads_the_allocators_retry_counter():
    """The CPU has no such counter; a CUDA/NPU module is stood in by its ``memory_stats`` (no accelerator here)."""
    import types

    import torch

    from launcher.checks.kernels.cases import Device

    dev = Device(torch, "cpu")
    assert dev.alloc_retries() is None
    dev.module = types.SimpleNamespace(memory_stats=lambda: {"num_alloc_retries": 3, "num_ooms": 0})
    assert dev.alloc_retries() == 3


@pytest.mark.slow
def test_tiny_benchmark_runs_both_variants_through_launcher_run(tmp_path):
    out = tmp_path / "bench"
    results = run_tiny_bench(out, "--steps", "3", "--warmup", "1")
    on, off = results["variants"]["on"], results["variants"]["off"]
    # the kernel check runs in the first variant's rank only (--kernel-check first), case by case on record
    assert results["kernel_check_in"] == ["on"] and on["kernel_check"]["ok"] and off["kernel_check"] is None
    assert on["kernel_check_progress"]["running"] is None
    assert [(c["case"], c["status"]) for c in on["kernel_check_progress"]["done"]] == [("layout", "pass")]
    assert "validate-kernels: [1/1] layout: pass in " in (out / "logs" / "on.job.log").read_text()
    for variant in (on, off):
        assert variant["state"] == "SUCCEEDED" and variant["steps_recorded"] == 3
        assert variant["tokens_per_step"] == [256]  # exactly cutoff_len
        assert variant["step_samples"] == [1, 1, 1] and variant["by_samples"]["1"]["steps"] == 2
        assert variant["gc_s_measured"] >= 0 and variant["full_gcs_measured"] >= 0
        assert variant["model_build"]["parameters"] > 0 and "job_log_tail" not in variant
        assert variant["tokens_per_s"] > 0 and variant["llamafactory"]["loss"]
        assert variant["alloc_retries_measured"] is None  # the CPU's allocator has no retry counter
    assert on["proof"]["checkpoint_all_layers"]["observed"] == {"non_reentrant": 4, "not_run": 1}  # no vision work
    assert on["proof"]["text_only_batches"]["dummy_image"] == "skipped" and on["seq_lens"] == [256]
    assert off["seq_lens"] != [256]  # LLaMA-Factory's dummy image adds positions
    assert on["proof"]["chunked_loss"]["first_call"]["supervised_tokens"] > 0
    assert on["proof"]["deltanet_routing"]["first_training_step"]["routed_layers"] == 3
    linear = off["proof"]["checkpoint_all_layers"]["by_layer_type"]["linear_attention"]
    assert linear["observed"] == {"not_checkpointed": 3}  # LLaMA-Factory's own rule: frozen layers run plain
    assert (out / "logs" / "on.job.log").is_file() and results["preflight_skipped"] == patch_bench.PREFLIGHT_SKIP


@pytest.mark.slow
def test_the_rank_freezes_the_collectors_objects_unless_gc_freeze_is_off(tmp_path):
    """``on`` (the product's default) froze the collector's objects before its second step (one micro-batch a step:
    the first after the first optimizer step), and the summary carries the proof's figures; ``gc-off`` froze none."""
    results = run_tiny_bench(
        tmp_path / "bench", "--variants", "on,gc-off", "--steps", "2", "--warmup", "1", "--kernel-check", "none"
    )
    on, off = results["variants"]["on"], results["variants"]["gc-off"]
    assert on["state"] == off["state"] == "SUCCEEDED"
    frozen = on["proof"]["gc_freeze"]
    assert frozen["status"] == "applied" and frozen["frozen_objects"] > 10_000
    assert frozen["before_training_step"] == 2 and "full_collection_s" in frozen
    assert off["proof"]["gc_freeze"]["status"] == "disabled" and "frozen_objects" not in off["proof"]["gc_freeze"]


@pytest.mark.slow
def test_rounds_run_the_variant_list_again_under_their_own_keys_with_the_kernel_check_once(tmp_path):
    out = tmp_path / "bench"
    results = run_tiny_bench(out, "--variants", "on", "--rounds", "2", "--steps", "3", "--warmup", "1")
    assert sorted(results["variants"]) == ["on", "on#2"] and results["kernel_check_in"] == ["on"]
    first, second = results["variants"]["on"], results["variants"]["on#2"]
    assert first["kernel_check"]["ok"] and second["kernel_check"] is None
    assert first["run_dir"] != second["run_dir"]
    for variant in (first, second):
        assert variant["state"] == "SUCCEEDED" and variant["steps_recorded"] == 3
        assert len(variant["step_periods"]) == 3 and variant["median_period_s"] > 0
    assert (out / "logs" / "on.job.log").is_file() and (out / "logs" / "on#2.job.log").is_file()


def test_profile_variant_runs_launcher_profile_on_the_on_config(tmp_path, capsys):
    bench_assets.write_model_dir(tmp_path / "model", "tiny")
    config, on = (
        patch_bench.run_config(tmp_path, v, "27b", "cuda", patch_bench.steps_of(v, 6)) for v in ("profile", "on")
    )
    same = {k: v for k, v in on.items() if k not in ("launcher", "max_steps")}
    assert {k: v for k, v in config.items() if k not in ("launcher", "max_steps")} == same
    assert config["launcher"] == {**on["launcher"], "run_name": "bench-27b"}  # `launcher profile` adds -profile
    assert (config["max_steps"], on["max_steps"]) == (5, 6)  # the variant's own, whatever --steps says
    assert patch_bench.steps_of("profile", 6, every=9) == patch_bench.steps_of("on", 6, every=9) == 9  # --all-steps
    path = tmp_path / "profile.yaml"
    assert patch_bench.launcher_args("profile", path, 5, 2) == [
        "profile",
        str(path),
        "--steps",
        "3",
        "--warmup",
        "2",
        "--quiet",
    ]
    assert patch_bench.launcher_args("on", path, 6, 2) == ["run", str(path), "--quiet"]
    # no step left to profile; a bad N; no variant at all; no round
    for args in (["--warmup", "5"], ["--all-steps", "2"], ["--all-steps", "0"], ["--variants", ","], ["--rounds", "0"]):
        with pytest.raises(SystemExit) as refused:
            patch_bench.main(["--out", str(tmp_path / "b"), "--shape", "tiny", "--variants", "profile", *args])
        assert refused.value.code == 2 and not (tmp_path / "b").exists()  # refused before anything is written
    assert "--rounds is 0; give at least 1" in capsys.readouterr().err


@pytest.mark.slow
def test_tiny_profile_variant_runs_through_launcher_profile(tmp_path):
    out = tmp_path / "bench"
    results = run_tiny_bench(out, "--variants", "profile", "--warmup", "2")
    variant = results["variants"]["profile"]
    assert variant["command"].startswith("python -m launcher profile ") and "--steps 3 --warmup 2" in variant["command"]
    assert variant["state"] == "SUCCEEDED" and variant["steps_recorded"] == 5 and variant["tokens_per_step"] == [256]
    assert "/bench-tiny-profile-" in variant["run_dir"] and variant["kernel_check"]["ok"]
    profile = variant["profile"]
    (rank,) = profile["report"]["ranks"]
    assert rank["profiled_steps"] == 3 and rank["adds_up"], rank
    assert rank["first_step"]["profiled_steps"]["steps"] == 3 and rank["first_step"]["warmup_after"]["steps"] == 1
    markdown = profile["markdown"]
    assert (out / "profile.md").read_text() == markdown and "## The first step against the later ones" in markdown
    ((trace, mib),) = profile["trace_mib"].items()
    assert trace.endswith("profile/rank0.trace.json") and mib > 0 and not list(out.glob("*.trace.json"))


def test_a_run_is_found_by_its_own_name_not_by_a_longer_one_that_starts_the_same(tmp_path):
    """``fsdp2`` and ``fsdp2-profile`` runs share a prefix; each lookup finds its own (and a retried id, ``-1``)."""
    from launcher.run.rundir import make_run_dir

    plain = make_run_dir(tmp_path, "bench-fsdp2").path
    again = make_run_dir(tmp_path, "bench-fsdp2").path  # same second: the launcher appends -1
    longer = make_run_dir(tmp_path, "bench-fsdp2-profile").path
    for folder in (plain, again, longer):
        (folder / "status.json").write_text("{}")
    assert patch_bench._newest_run(tmp_path, "bench-fsdp2") in (plain, again)
    assert patch_bench._newest_run(tmp_path, "bench-fsdp2-profile") == longer
    assert patch_bench._newest_run(tmp_path, "bench") is None


def test_the_rank_kernel_check_names_cases_the_suites_have():
    """``BENCH_KERNEL_CASES`` is read in the rank on the device; an unknown name would only show there."""
    from launcher.checks.kernels.validate import SUITES

    for shape, spec in patch_bench.KERNEL_CASES.items():
        suite, _, names = spec.partition(":")
        assert set(names.split(",")) <= {c.name for c in SUITES[suite]}, shape
    assert "varlen_grouped" in patch_bench.KERNEL_CASES["27b"]  # packed rows' call, checked where they train


@pytest.mark.slow
@pytest.mark.parametrize("signalled", ["group", "benchmark"])
def test_an_interrupted_benchmark_ends_its_run_before_it_exits(tmp_path, signalled):
    """Ctrl-C or ``timeout -s INT`` signals the benchmark's whole process group, ``launcher run`` (the supervisor)
    in it (``group``); ``kill -INT`` or ``kill`` signals the benchmark alone (``benchmark``, SIGINT here). The job runs
    in a session of its own, so neither signal reaches it, and the supervisor's graceful stop waits for its next
    step. The benchmark stops the run and waits for that end: once it has exited, no process of the job is alive and
    the run's record holds its end state."""
    import signal
    import subprocess

    import psutil

    from launcher.state.states import RunState
    from tests.support.fake_runs import read_status, wait_for, wait_for_run_dir

    out = tmp_path / "bench"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.patch_bench",
        "--out",
        str(out),
        "--shape",
        "tiny",
        "--samples",
        "3",
        "--variants",
        "on",
        "--steps",
        "100000",
        "--kernel-check",
        "none",
        "--timeout",
        "900",
    ]
    bench = subprocess.Popen(
        cmd, cwd=patch_bench.REPO, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    job: list[psutil.Process] = []
    try:
        run_dir = wait_for_run_dir(out / "runs", timeout=300)
        wait_for(
            "the run to train",
            lambda: read_status(run_dir).get("state") == RunState.RUNNING and read_status(run_dir).get("processes"),
            timeout=300,
        )
        job = [psutil.Process(p["pid"]) for p in read_status(run_dir)["processes"]]
        if signalled == "group":
            os.killpg(bench.pid, signal.SIGINT)
        else:
            bench.send_signal(signal.SIGINT)
        _, err = bench.communicate(timeout=300)
        assert [p.pid for p in job if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
        assert RunState(read_status(run_dir)["state"]).terminal, read_status(run_dir)["state"]
        assert bench.returncode == 130 and "stopping the run and waiting for it to end" in err
        assert "Traceback" not in err and "the variants run so far are in" in err
        kept = Results.read(out / "results.json").variants["on"]  # what the run recorded is kept
        assert kept["interrupted"] and not kept["timed_out"] and RunState(kept["state"]).terminal
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
        for process in job:
            if process.is_running():
                process.kill()
