"""The offload variants of ``benchmarks.patch_bench`` and their targets (``checkpoint_all_layers.offload_inputs``)."""

from __future__ import annotations

import pytest
import yaml

from benchmarks import bench_assets, patch_bench
from launcher.config.run_config import load_run_config

OFFLOAD = {
    "on": "auto",
    "on-nooffload": False,
    "ctx16k-nooffload": False,
    "ctx16k-offload": True,
    "ctx32k-nooffload": False,
    "ctx32k-offload": True,
    "ctx64k-offload": True,
    "ctx128k-offload": True,
}
CUTOFF = {"ctx16k": 16384, "ctx32k": 32768, "ctx64k": 65536, "ctx128k": 131072}


@pytest.mark.parametrize("variant", sorted(OFFLOAD))
def test_offload_variants_set_the_option_and_the_length(tmp_path, variant):
    bench_assets.write_model_dir(tmp_path / "model", "tiny")
    path = tmp_path / f"{variant}.yaml"
    path.write_text(yaml.safe_dump(patch_bench.run_config(tmp_path, variant, "27b", "cuda", steps=6)))
    loaded = load_run_config(path)
    assert loaded.patches["checkpoint_all_layers"]["offload_inputs"] == OFFLOAD[variant]
    assert loaded.patches["checkpoint_all_layers"]["enabled"] is True
    assert loaded.llamafactory["cutoff_len"] == CUTOFF.get(variant.split("-")[0], 4096)


def test_offload_targets_hold_on_against_off_in_the_same_invocation():
    ok = {"state": "SUCCEEDED"}
    auto_off = {"checkpoint_all_layers": {"offload_inputs": {"setting": "auto", "on": False, "reason": "fits"}}}
    found = patch_bench.targets(
        {
            "ctx16k-offload": {**ok, "tokens_per_s": 1850.0, "peak_allocated_gib": 58.0},
            "ctx16k-nooffload": {**ok, "tokens_per_s": 2000.0, "peak_allocated_gib": 67.3},
            "ctx64k-offload": {**ok, "peak_allocated_gib": 76.5},
            "on": {**ok, "tokens_per_s": 3400.0, "peak_allocated_gib": 55.10, "proof": auto_off},
            "on-nooffload": {**ok, "tokens_per_s": 3420.0, "peak_allocated_gib": 55.09},
        }
    )
    speed = found["ctx16k-offload-speed"]["tokens_per_s"]
    assert speed["ratio"] == pytest.approx(0.925) and speed["met"]
    assert not found["ctx64k-offload"]["peak_allocated_gib"]["met"]  # 76.5 > 76
    default = found["default-path"]
    assert default["met"] and default["auto_chose"] is False
    assert default["tokens_per_s"]["met"] and default["peak_allocated_gib"]["met"]
    slow = patch_bench.targets(
        {"ctx32k-offload": {**ok, "tokens_per_s": 800.0}, "ctx32k-nooffload": {**ok, "tokens_per_s": 1000.0}}
    )
    assert not slow["ctx32k-offload-speed"]["tokens_per_s"]["met"]
    assert "ctx16k-offload-speed" not in slow and "default-path" not in slow


def test_the_offloader_check_runs_on_cpu_and_writes_the_results_schema(tmp_path):
    """``benchmarks.offload_check`` on CPU (the plumbing: no pinned memory, no stream, no memory figure)."""
    from benchmarks import offload_check
    from benchmarks.results_schema import Results

    offload_check.main(["--out", str(tmp_path), "--tokens", "64", "--layers", "3", "--hidden", "32", "--repeats", "2"])
    found = Results.read(tmp_path / "results.json")
    assert found.bench == "benchmarks.offload_check" and found.targets["gradients_equal"]["met"] is True
    assert found.detail["offloader_stats"]["packed"] == 6 and found.detail["offloader_stats"]["prefetched"] == 4
    assert set(found.variants) == {"off", "offload"} and "memory_saved_gib" not in found.targets
