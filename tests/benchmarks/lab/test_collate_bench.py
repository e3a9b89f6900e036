"""The collation benchmark, run for real on the CPU at a short cutoff: LLaMA-Factory's data path and collator with
the product's collator patches, applied and removed around each case."""

from __future__ import annotations

import json

from benchmarks.lab import collate_bench


def test_every_case_collates_its_rows_and_the_patches_are_removed_after(tmp_path, capsys):
    from llamafactory.data.collator import SFTDataCollatorWith4DAttentionMask

    upstream = SFTDataCollatorWith4DAttentionMask.__call__
    assert collate_bench.main(["--out", str(tmp_path), "--repeats", "1", "--cutoff", "512"]) == 0
    found = json.loads((tmp_path / "collate.json").read_text())
    assert list(found["cases"]) == list(collate_bench.CASES) and found["cutoff"] == 512
    assert found["host"]["llamafactory"] == "0.9.5" and found["host"]["cpus"] >= 1
    for name, case in found["cases"].items():
        assert case["calls"] == case["rows"] and 0 < case["median_ms"] <= case["p90_ms"], name
    assert found["cases"]["unpacked"]["samples_per_row"] == {"1": found["cases"]["unpacked"]["rows"]}
    packed = found["cases"]["packed"]["samples_per_row"]
    assert packed == found["cases"]["packed-cpu-mask"]["samples_per_row"]  # the same rows, either mask
    assert max(map(int, packed)) >= 2  # LLaMA-Factory packs the longest first: the later rows hold several samples
    assert SFTDataCollatorWith4DAttentionMask.__call__ is upstream
    capsys.readouterr()
    assert collate_bench.main(["--out", str(tmp_path)]) == 2  # the results are never overwritten
    assert "collate.json exists; choose another --out" in capsys.readouterr().err
