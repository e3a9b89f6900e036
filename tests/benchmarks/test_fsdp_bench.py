"""The FSDP2 benchmark's plumbing on the CPU: configs, the arithmetic, and (slow) one run over 2 gloo processes.

The measurement itself (27B shape, 2 x H200) is described in docs/lab/2026-12-01-fsdp2-two-gpus-plan.md and not run
here; the tiny shape goes through the same ``launcher run`` path with real FSDP2 sharding over gloo, so a broken path
fails before anyone spends GPU time on it.
"""

from __future__ import annotations

import pytest
import yaml

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from benchmarks import bench_assets, fsdp_bench  # noqa: E402
from benchmarks.results_schema import Results  # noqa: E402
from launcher.config.run_config import load_run_config  # noqa: E402
from patches import fsdp2_frozen_dtype  # noqa: E402


@pytest.mark.parametrize(
    ("devices", "single", "distribution"), [(1, "fsdp2", "fsdp2"), (1, "ddp", "ddp"), (2, "ddp", "fsdp2")]
)
def test_configs_are_the_on_variant_on_n_devices(tmp_path, devices, single, distribution):
    bench_assets.write_model_dir(tmp_path / "model", "tiny")
    config = fsdp_bench.bench_config(tmp_path, "27b", "cuda", 6, devices, "full-loss", single)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    loaded = load_run_config(path)
    assert (loaded.launcher.nproc_per_node, loaded.launcher.distribution) == (devices, distribution)
    assert loaded.launcher.fsdp.wrap_classes == ["Qwen3_5DecoderLayer", "Qwen3_5VisionBlock"]
    assert loaded.launcher.fsdp.reshard_after_forward and not loaded.launcher.fsdp.offload_params
    lf = loaded.llamafactory
    assert (lf["cutoff_len"], lf["per_device_train_batch_size"], lf["lora_rank"], lf["bf16"]) == (4096, 1, 8, True)
    assert loaded.patches["chunked_loss"]["enabled"] is False and loaded.patches["checkpoint_all_layers"]["enabled"]


def test_memory_bound_and_scaling_show_their_arithmetic():
    counts, units = {"total": 10 * 2**30}, {"decoder_layer_max": 2**29}  # 20 GiB of bf16, 1 GiB a layer
    single = {
        "peak_allocated_gib_max": 60.0,
        "tokens_per_s_total": 1000.0,
        "ranks": [{"model_build": {"bytes_materialized": 40 * 2**30}}],
    }  # fp32 shards: 40 GiB held
    multi = {
        "peak_allocated_gib_max": 31.9,
        "tokens_per_s_total": 1890.0,
        "ranks": [{"model_build": {"bytes_materialized": 20 * 2**30}}] * 2,
    }
    bound = fsdp_bench.memory_bound(counts, units, single, multi, 2, param_bytes=2)
    assert (bound["weights_gib"], bound["one_device_activation_gib"], bound["bound_gib"]) == (20.0, 20.0, 32.0)
    assert bound["arithmetic"] == "20.00 / 2 + (60.00 - 40.00) + 2 x 1.000 = 32.00 GiB" and bound["met"]
    assert bound["weights_held_per_rank_gib"] == [20.0, 20.0]
    assert not fsdp_bench.memory_bound(counts, units, single, {**multi, "peak_allocated_gib_max": 32.1}, 2, 2)["met"]
    assert (
        fsdp_bench.memory_bound(counts, units, single, {**multi, "peak_allocated_gib_max": None}, 2, 2)["met"] is None
    )
    scaled = fsdp_bench.scaling(single, multi, 2)
    assert (scaled["ratio"], scaled["minimum"], scaled["met"]) == (1.89, 1.9, False)


def test_devices_and_options_are_checked(tmp_path):
    for bad in (
        ["--devices", "2"],
        ["--devices", "2,1"],
        ["--options", "on,budget120"],
        ["--variants", "budget"],
        ["--devices", "1,2", "--variants", "fsdp2"],
        ["--devices", "1", "--variants", "fsdp2-profile", "--steps", "2", "--warmup", "2"],
        ["--devices", "1", "--variants", "single,single-budget120"],  # tiny: the CPU, no allocator peak
    ):
        with pytest.raises(SystemExit):
            fsdp_bench.main(["--out", str(tmp_path), "--shape", "tiny", *bad])


def test_one_device_targets_compare_fsdp2_with_the_single_device_path(tmp_path):
    runs = {
        "single": {"state": "SUCCEEDED", "tokens_per_s_total": 2851.0, "peak_allocated_gib_max": 55.14},
        "fsdp2": {"state": "SUCCEEDED", "tokens_per_s_total": 2709.0, "peak_allocated_gib_max": 57.9},
    }
    met = fsdp_bench.one_device_targets(runs)
    assert (met["speed_ratio"], met["speed_met"], met["peak_met"]) == (0.95, True, True)
    slow = fsdp_bench.one_device_targets(
        {**runs, "fsdp2": {**runs["fsdp2"], "tokens_per_s_total": 2700.0, "peak_allocated_gib_max": 111.85}}
    )
    assert (slow["speed_met"], slow["peak_met"]) == (False, False)
    config = fsdp_bench.bench_config(tmp_path, "tiny", "cuda", 6, 1, "on", variant="fsdp2-budget120")
    assert config["launcher"]["distribution"] == "fsdp2"
    assert config["launcher"]["patches"]["checkpoint_all_layers"] == {"memory_budget_gib": 120}
    assert (
        fsdp_bench.bench_config(tmp_path, "tiny", "cuda", 6, 1, "on", variant="single")["launcher"]["distribution"]
        == "ddp"
    )
    both = {"single-budget120": "ddp", "fsdp2-budget120-profile": "fsdp2"}  # one budget, both paths, one invocation
    for variant, distribution in both.items():
        launcher = fsdp_bench.bench_config(tmp_path, "tiny", "cuda", 6, 1, "on", variant=variant)["launcher"]
        assert launcher["distribution"] == distribution
        assert launcher["patches"]["checkpoint_all_layers"] == {"memory_budget_gib": 120}
    assert "fsdp2-budget120-profile" in fsdp_bench.PROFILED
    paired = fsdp_bench.one_device_targets({**runs, "single-budget120": {"tokens_per_s_total": 4830.0}})
    assert paired["single_budget120_tokens_per_s"] == 4830.0
    bench_assets.write_model_dir(tmp_path / "model", "tiny")
    rooted = tmp_path / "rooted.yaml"  # the option the patch validates, against its default in one invocation
    rooted.write_text(
        yaml.safe_dump(fsdp_bench.bench_config(tmp_path, "tiny", "cuda", 6, 1, "on", variant="fsdp2-root-embeddings"))
    )
    loaded = load_run_config(rooted)
    assert loaded.launcher.distribution == "fsdp2"
    assert loaded.patches["fsdp2_frozen_dtype"]["embedding_units"] is False


@pytest.mark.slow
def test_tiny_benchmark_shards_over_two_gloo_processes(tmp_path):
    out = tmp_path / "bench"
    fsdp_bench.main(
        [
            "--out",
            str(out),
            "--shape",
            "tiny",
            "--backend",
            "cpu",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--samples",
            "3",
            "--timeout",
            "500",
        ]
    )
    written = Results.read(out / "results.json")  # the results schema, validated
    assert written.bench == "benchmarks.fsdp_bench" and written.commit and written.converted is None
    results = written.raw("runs")
    assert written.figures["on.2.tokens_per_s_total"] == results["runs"]["on"]["2"]["tokens_per_s_total"]
    assert results["environment_passed"]["NCCL_NVLS_ENABLE"] == "0"
    one, two = results["runs"]["on"]["1"], results["runs"]["on"]["2"]
    for run, world in ((one, 1), (two, 2)):
        assert run["distribution"] == "fsdp2" and run["world_size"] == world and run["steps_all_ranks"] == 3
        assert run["state"] == "SUCCEEDED", run["reason"]  # the CPU FSDP2 job saves (patches/fsdp2_frozen_dtype.py)
        assert run["tokens_per_step_total"] == 256 * world and run["tokens_per_s_total"] > 0
        for rank in run["ranks"]:
            assert rank["environment"] | fsdp_bench.MULTICAST_OFF == rank["environment"]  # the rank saw all three
            assert rank["environment"]["WORLD_SIZE"] == str(world)
            build = rank["model_build"]
            assert build["how"].startswith("built on the meta device, sharded by accelerate")
            # 4 decoder layers, 1 vision block, the root, and the input and output embeddings
            # (fsdp2_frozen_dtype.embedding_units); before torch 2.8 also the layers' 8 LoRA modules in units of
            # their own (trainable_units auto: own there, shared in the layers' units from 2.8 on)
            lora_units = 8 if fsdp2_frozen_dtype.trainable_units_mode("auto", torch.__version__) == "own" else 0
            assert build["fsdp_units"] == 4 + 1 + 1 + lora_units + 2 and not build["left_on_meta"]
            assert build["lora_layers_reset"] == 4
            assert build["bytes_full_model"] >= results["model_parameters"]["total"] * 4
            assert build["bytes_materialized"] <= build["bytes_full_model"] * (1.0 if world == 1 else 0.55)
    assert (
        sum(r["model_build"]["bytes_materialized"] for r in two["ranks"])
        >= one["ranks"][0]["model_build"]["bytes_materialized"]
    )  # (the two shards together hold the whole model)
    target = results["targets"]["on:2dev"]
    assert target["scaling"]["minimum"] == 1.9 and target["scaling"]["ratio"] > 0
    assert target["memory"]["met"] is None and target["memory"]["weights_gib"] > 0  # no peak counter on the CPU
