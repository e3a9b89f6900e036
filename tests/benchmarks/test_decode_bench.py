"""The decode benchmark end to end on the CPU with the tiny shape (the H200 run uses the same code, 27B shape)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from benchmarks import decode_bench  # noqa: E402

pytest_plugins = ["tests.support.patch_fixtures"]


@pytest.mark.usefixtures("restore_patches")
def test_decode_bench_times_both_routes_and_names_the_recurrent_kernel_that_ran(tmp_path):
    assert decode_bench.main(["--out", str(tmp_path), "--shape", "tiny", "--backend", "cpu", "--new-tokens", "4",
                              "--prompt-tokens", "16", "--repeats", "1", "--batch-sizes", "1,3"]) == 0  # fmt: skip
    result = json.loads((tmp_path / "decode.json").read_text())
    assert (result["shape"], result["new_tokens"], result["prompt_tokens"]) == ("tiny", 4, 16)
    assert result["batch_sizes"] == [1, 3]
    assert set(result["routes"]) == {"routed", "torch"}
    for name, route in result["routes"].items():
        assert route["generate_s"] > 0 and route["prefill_s"] > 0, name
        assert route["recurrent_kernel"].endswith("torch_recurrent_gated_delta_rule")  # CPU: torch on both routes
        assert route["first_decode_call"]["shape"][1] == 1 and route["first_decode_call"]["device"] == "cpu"
        assert [(b, route["batches"][b]["batch"]) for b in route["batches"]] == [("1", 1), ("3", 3)], name
        assert all(route["batches"][b]["decode_tokens_per_s"] > 0 for b in ("1", "3")), name
    assert result["routes"]["torch"]["route"]["reason"].startswith("the config chose kernel: torch")


def test_decode_bench_refuses_too_few_tokens(tmp_path, capsys):
    with pytest.raises(SystemExit):
        decode_bench.main(["--out", str(tmp_path), "--new-tokens", "1"])
    assert "--new-tokens must be at least 2" in capsys.readouterr().err


@pytest.mark.parametrize("sizes", ["0", "8,x", ""])
def test_decode_bench_refuses_batch_sizes_that_are_not_positive_integers(tmp_path, capsys, sizes):
    with pytest.raises(SystemExit):
        decode_bench.main(["--out", str(tmp_path), "--batch-sizes", sizes])
    assert f"--batch-sizes {sizes!r}: give positive integers" in capsys.readouterr().err
