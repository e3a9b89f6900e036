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


@pytest.mark.usefixtures("restore_patches")
def test_decode_bench_compares_a_batch_with_one_at_a_time_and_runs_only_the_routes_asked(tmp_path):
    """On the CPU in fp32 a left-padded batch of prompts of different lengths gives every answer of one-at-a-time
    decoding token for token (the H200 run in bf16 reports its own count)."""
    assert decode_bench.main(["--out", str(tmp_path), "--shape", "tiny", "--backend", "cpu", "--new-tokens", "3",
                              "--prompt-tokens", "12", "--repeats", "1", "--routes", "routed",
                              "--compare", "4", "--compare-tokens", "6"]) == 0  # fmt: skip
    result = json.loads((tmp_path / "decode.json").read_text())
    assert set(result["routes"]) == {"routed"} and result["speedup_decode"] is None
    compare = result["routes"]["routed"]["compare"]
    assert compare["rows"] == 4 and len(set(compare["prompt_lengths"])) > 1
    assert compare["exact_matches"] == 4 and compare["first_difference_at"] == [None] * 4, compare


@pytest.mark.parametrize(("args", "message"), [(["--routes", "fast"], "--routes 'fast'"),
                                               (["--compare", "-1"], "--compare -1"),
                                               (["--compare", "4", "--routes", "torch"], "add routed to --routes")])
def test_decode_bench_refuses_a_bad_route_or_compare(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as ended:
        decode_bench.main(["--out", str(tmp_path / "out"), *args])
    assert ended.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing written
