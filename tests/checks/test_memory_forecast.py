"""The memory forecast (``launcher.checks.memory``) against every measured peak, on known configs, and in ``check``.

The table of measured points is docs/lab/2026-12-02-memory-forecast.md: every point within 10 %. A real CPU training
step against the forecast (allocated bytes and resident set) is test_memory_forecast_cpu.py.
"""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest

from benchmarks.results_schema import Results
from launcher.checks import memory
from tests.support.common import REPO, make_config
from tests.support.fake_runs import launcher


@pytest.fixture(scope="module")
def model_27b(tmp_path_factory) -> Path:
    """A config-only Qwen3.5-27B folder (the benchmark's: no weights)."""
    from benchmarks.bench_assets import write_model_dir

    return write_model_dir(tmp_path_factory.mktemp("m27") / "model", "27b")


def _config(model: Path, tmp_path: Path, **settings):
    """A real run config (read and validated as ``launcher check`` does)."""
    from launcher.config.run_config import read_run_config

    launcher_section = {
        "backend": settings.pop("backend", "cuda"),
        "nproc_per_node": settings.pop("ranks", 1),
        "distribution": settings.pop("distribution", "ddp"),
        "patches": settings.pop("patches", {}),
        **({"smoke": True} if settings.pop("smoke", False) else {}),  # a short cutoff_len
    }
    lf = {
        "model_name_or_path": str(model),
        "stage": "sft",
        "do_train": True,
        "finetuning_type": "lora",
        "lora_rank": 8,
        "lora_target": "q_proj,k_proj,v_proj,o_proj",
        "cutoff_len": 4096,
        "bf16": True,
        "per_device_train_batch_size": 1,
        "gradient_checkpointing": True,
        "launcher": launcher_section,
        **settings,
    }
    import yaml

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(lf))
    config, problems = read_run_config(path)
    assert not problems, problems
    return config


def _forecast(model: Path, tmp_path: Path, **settings) -> memory.Forecast:
    """The forecast of a real run config (read and validated as ``launcher check`` does)."""
    device_gib = settings.pop("device_gib", None)
    config = _config(model, tmp_path, **settings)
    return memory.forecast_run(config, config.llamafactory, device_gib)


def test_backend_auto_in_check_names_no_device_so_no_verdict_without_device_memory(model_27b, tmp_path):
    """`check` runs where the devices may not be (a laptop): `backend: auto` is not this machine's RAM. The
    forecast is shown without a verdict, and `--device-memory` gives one."""
    from launcher.checks.config_check import ERROR
    from launcher.checks.config_rules import memory_finding

    config = _config(model_27b, tmp_path, backend="auto")
    shown = memory_finding(config, None)
    assert shown.level != ERROR and "forecast peak" in shown.message
    assert not any(word in shown.message for word in ("FITS", "TIGHT", "WILL NOT FIT")), shown.message
    assert memory_finding(config, 16.0).level == ERROR  # 51 GiB of weights on a 16 GiB device


# (name, run settings, measured peak GiB, where it was measured); docs/lab/2026-12-02-memory-forecast.md
MEASURED = [
    ("4k, every layer checkpointed, chunked loss", {}, 55.14, "perf-h200-run4.json on"),
    ("8k", {"cutoff_len": 8192}, 59.6, "seed's H200 measurement"),
    ("16k", {"cutoff_len": 16384}, 68.1, "seed's H200 measurement"),
    (
        "32k, chunks of 1024",
        {"cutoff_len": 32768, "patches": {"chunked_loss": {"chunk_tokens": 1024}}},
        83.52,
        "perf-h200-run3.json ctx32k",
    ),
    (
        "64k, chunks of 1024",
        {"cutoff_len": 65536, "patches": {"chunked_loss": {"chunk_tokens": 1024}}},
        115.94,
        "perf-h200-run3.json ctx64k",
    ),
    ("4k, chunks of 1024", {"patches": {"chunked_loss": {"chunk_tokens": 1024}}}, 56.55, "perf-h200-run2.json on"),
    (
        "FSDP2, one process, accelerate 1.11 upcast",
        {"distribution": "fsdp2", "patches": {"fsdp2_frozen_dtype": False}},
        111.85,
        "fsdp_bench before the patch",
    ),
    (
        "FSDP2, one process, fsdp2_frozen_dtype, embeddings in the root unit",
        {"distribution": "fsdp2", "patches": {"fsdp2_frozen_dtype": {"embedding_units": False}}},
        60.36,
        "fsdp2-one-device-h200.json",
    ),
    (
        "FSDP2, one process, fsdp2_frozen_dtype",
        {"distribution": "fsdp2"},
        57.55,
        "fsdp2-embedding-units-h200.json",
    ),
    (
        "budget 120 GiB plan, fused glue",
        {"patches": {"checkpoint_all_layers": {"memory_budget_gib": 120}}},
        99.0,
        "glue-budget-h200.json budget120",
    ),
    (
        "budget 120 GiB plan, no fused glue",
        {
            "patches": {
                "checkpoint_all_layers": {"memory_budget_gib": 120},
                "fused_ops": False,
                "lora_input_cast": False,
            }
        },
        117.21,
        "perf-h200-run4.json budget120",
    ),
    (
        "patches off (LLaMA-Factory's checkpointing, whole logits)",
        {
            "patches": {
                "checkpoint_all_layers": False,
                "chunked_loss": False,
                "fused_ops": False,
                "lora_input_cast": False,
            }
        },
        110.03,
        "patch_bench off",
    ),
    (
        "8 x 910B, FSDP2, accelerate's upcast, whole logits (the seed's run)",
        {
            "distribution": "fsdp2",
            "ranks": 8,
            "patches": {
                "fsdp2_frozen_dtype": False,
                "chunked_loss": False,
                "fused_ops": False,
                "lora_input_cast": False,
            },
        },
        32.6,
        "the seed's 910B figure",
    ),
]


@pytest.mark.parametrize(("name", "settings", "measured", "source"), MEASURED, ids=[m[0] for m in MEASURED])
def test_the_forecast_is_within_10_percent_of_every_measured_peak(
    model_27b, tmp_path, name, settings, measured, source
):
    result = _forecast(model_27b, tmp_path, **json.loads(json.dumps(settings)))
    error = (result.peak - measured) / measured
    print(f"\n{name}: forecast {result.peak:.2f} GiB, measured {measured} GiB ({source}): {error:+.1%}")
    assert abs(error) <= 0.10, result.to_dict()


def test_the_parameter_arithmetic_counts_what_transformers_builds(model_27b, demo_assets):
    from benchmarks.bench_assets import count_parameters

    for folder in (model_27b, demo_assets["model"]):
        shape = memory.read_shape(json.loads((folder / "config.json").read_text()))
        assert memory.parameter_counts(shape)["total"] == count_parameters(folder)["total"]
    shape = memory.read_shape(json.loads((model_27b / "config.json").read_text()))
    # docs/lab/2026-12-01-fsdp2-two-gpus-plan.md: fsdp_bench.unit_sizes on the meta device
    counts = memory.parameter_counts(shape)
    assert (counts["root"], counts["largest_layer"]) == (2_592_065_408, 383_273_184)
    lf = {"finetuning_type": "lora", "lora_rank": 8, "lora_target": "q_proj,k_proj,v_proj,o_proj"}
    assert memory.lora_parameters(shape, json.loads((model_27b / "config.json").read_text()), lf) == 5_242_880


def test_the_verdict_names_the_largest_term_and_the_option_that_shrinks_it(model_27b, tmp_path):
    one_device = _forecast(model_27b, tmp_path, device_gib=48.0)  # a 48 GB card
    assert one_device.verdict == "will not fit" and one_device.largest == "weights"
    assert "launcher.distribution: fsdp2" in one_device.line() and "WILL NOT FIT" in one_device.line()
    upcast = _forecast(
        model_27b,
        tmp_path,
        distribution="fsdp2",
        ranks=8,
        device_gib=20.0,
        patches={"fsdp2_frozen_dtype": False, "chunked_loss": False},
    )
    assert upcast.verdict == "will not fit" and upcast.largest == "weights"
    assert "fsdp2_frozen_dtype: true" in upcast.fixes["weights"]
    formal = _forecast(model_27b, tmp_path, distribution="fsdp2", ranks=8, device_gib=59.6)
    # docs/lab/2026-12-02-memory-forecast.md: 12.8 projected bottom-up
    assert formal.verdict == "fits" and 12 < formal.peak < 14
    assert formal.largest == "weights" and "loss" in formal.terms  # lm_head gathered at the loss: its peak phase
    rooted = _forecast(
        model_27b,
        tmp_path,
        distribution="fsdp2",
        ranks=8,
        device_gib=59.6,
        patches={"fsdp2_frozen_dtype": {"embedding_units": False}},
    )
    assert rooted.terms["FSDP2 gathered units"] - formal.terms["FSDP2 gathered units"] > 3.5  # the root unit held
    assert "embedding_units: true" in rooted.fixes["FSDP2 gathered units"]
    tight = _forecast(model_27b, tmp_path, device_gib=formal.peak + 0.5, distribution="fsdp2", ranks=8)
    assert tight.verdict == "tight"
    long = _forecast(
        model_27b,
        tmp_path,
        cutoff_len=65536,
        device_gib=59.6,
        distribution="fsdp2",
        ranks=8,
        patches={"chunked_loss": False},
    )
    assert long.verdict == "will not fit" and long.largest == "loss"
    assert "chunked_loss: true" in long.fixes["loss"]


def test_check_prints_the_forecast_and_refuses_a_bad_device_memory(tmp_path, demo_assets):
    cfg = make_config(tmp_path, demo_assets)
    shown = launcher("check", cfg, "--device-memory", "64")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    (line,) = [ln for ln in shown.stdout.splitlines() if "memory:" in ln]
    assert line.startswith("ok") and "forecast peak" in line and "against 64.0 GiB: FITS" in line
    bad = launcher("check", cfg, "--device-memory", "lots")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip() == "error: --device-memory 'lots': give the device's memory in GiB, such as 64 or 139.8"


def test_a_greedy_rows_forecast_errs_high_against_the_h200s_measured_rows(model_27b):
    """``decode_row_bytes`` at the 27B shape against what one H200 measured per added row of a greedy batch
    (``benchmarks/results/decode-batched-h200.json``: 512-token prompts, 128 new tokens, peaks at 1, 8 and 32 rows):
    never below a measured row (``launcher evaluate --batch-size auto`` must not overfill), at most 30 % above."""
    found = Results.read(REPO / "benchmarks/results/decode-batched-h200.json").detail  # the schema's detail block
    batches = found["routes"]["routed"]["batches"]
    peaks = sorted((int(rows), b["peak_allocated_gib"]) for rows, b in batches.items())
    measured = [(b - a) / (rb - ra) for (ra, a), (rb, b) in pairwise(peaks)]
    shape = memory.read_shape(json.loads((model_27b / "config.json").read_text()))
    row = memory.decode_row_bytes(shape, found["prompt_tokens"], found["new_tokens"]) / memory.GIB
    assert measured and all(m <= row <= 1.3 * m for m in measured), (row, measured)
