"""The decode benchmark end to end on the CPU with the tiny shape (the H200 run uses the same code, 27B shape)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from benchmarks.lab import decode_bench  # noqa: E402

pytest_plugins = ["tests.support.patch_fixtures"]


@pytest.mark.usefixtures("restore_patches")
def test_decode_bench_times_both_routes_and_names_the_recurrent_kernel_that_ran(tmp_path):
    assert (
        decode_bench.main(
            [
                "--out",
                str(tmp_path),
                "--shape",
                "tiny",
                "--backend",
                "cpu",
                "--new-tokens",
                "4",
                "--prompt-tokens",
                "16",
                "--repeats",
                "1",
                "--batch-sizes",
                "1,3",
            ]
        )
        == 0
    )
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
    assert (
        decode_bench.main(
            [
                "--out",
                str(tmp_path),
                "--shape",
                "tiny",
                "--backend",
                "cpu",
                "--new-tokens",
                "3",
                "--prompt-tokens",
                "12",
                "--repeats",
                "1",
                "--routes",
                "routed",
                "--compare",
                "4",
                "--compare-tokens",
                "6",
            ]
        )
        == 0
    )
    result = json.loads((tmp_path / "decode.json").read_text())
    assert set(result["routes"]) == {"routed"} and result["speedup_decode"] is None
    compare = result["routes"]["routed"]["compare"]
    assert compare["rows"] == 4 and len(set(compare["prompt_lengths"])) > 1
    assert compare["exact_matches"] == 4 and compare["first_difference_at"] == [None] * 4, compare
    assert compare["first_difference_margins"] == [None] * 4 and compare["differences_at_a_near_tie"] == 0


@pytest.mark.parametrize("value", [1.0, 3.0, 0.37, 12.5, -5.3, 300.0])
def test_bf16_step_is_the_spacing_of_bfloat16_numbers(value):
    import torch

    here = torch.tensor(value, dtype=torch.bfloat16)
    up = torch.nextafter(here, torch.tensor(float("inf"), dtype=torch.bfloat16))
    assert decode_bench.bf16_step(value) == float(up - here)


def test_a_first_difference_is_measured_on_the_one_at_a_time_logits(tmp_path):
    """What the H200's bf16 comparison records where a batched answer leaves the one-at-a-time answer: the logits
    after the shared context, their top-2 margin in bf16 steps and the rank of the batch's token there. Planted on
    the tiny model in fp32 (whose answers never differ): the batch's token is said to be the runner-up."""
    import torch

    from benchmarks.bench_assets import write_model_dir
    from launcher.checks.kernels.cases import Device

    model = decode_bench.build_model(torch, write_model_dir(tmp_path / "model", "tiny"), "cpu", torch.float32)
    context = list(range(10, 30))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([context])).logits[0, -1]
    (first, second), (best, runner_up) = torch.topk(logits, 2)
    found = decode_bench.difference_margin(torch, model, Device(torch, "cpu"), context, int(runner_up), int(best))
    assert found["top_tokens"] == [int(best), int(runner_up)] and found["batched_token_rank"] == 2
    assert found["top2_margin"] == pytest.approx(float(first - second), abs=1e-5)
    assert found["margin_in_bf16_steps"] == pytest.approx(
        found["top2_margin"] / decode_bench.bf16_step(float(first)), abs=0.01
    )
    assert found["near_tie"] == (found["top2_margin"] <= decode_bench.NEAR_TIE_STEPS * found["bf16_step"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--routes", "fast"], "--routes 'fast'"),
        (["--compare", "-1"], "--compare -1"),
        (["--compare", "4", "--routes", "torch"], "add routed to --routes"),
    ],
)
def test_decode_bench_refuses_a_bad_route_or_compare(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as ended:
        decode_bench.main(["--out", str(tmp_path / "out"), *args])
    assert ended.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing written


def test_compare_measures_the_margin_where_a_planted_batched_answer_differs(tmp_path, monkeypatch):
    """``--compare``'s plumbing where answers differ (they never do on the CPU in fp32): the batched decoding is
    wrapped to change one token of the first answer; that row alone counts as different, at that token, with
    its margin measured after the prompt and the two shared tokens."""
    import torch

    from benchmarks.bench_assets import write_model_dir
    from launcher.checks.kernels.cases import Device
    from launcher.rank import evaluate_decode

    real = evaluate_decode.greedy_batched

    def planted(torch_, model, prompts, batch_size, **kwargs):
        answers = real(torch_, model, prompts, batch_size=batch_size, **kwargs)
        if batch_size > 1:
            answers[0] = [*answers[0][:2], answers[0][2] + 1, *answers[0][3:]]
        return answers

    monkeypatch.setattr(evaluate_decode, "greedy_batched", planted)
    model = decode_bench.build_model(torch, write_model_dir(tmp_path / "model", "tiny"), "cpu", torch.float32)
    model.generation_config.eos_token_id = None  # every answer runs its 6 tokens
    found = decode_bench.compare_batched(torch, model, Device(torch, "cpu"), 3, 12, 6)
    assert found["exact_matches"] == 2 and found["first_difference_at"] == [2, None, None], found
    margin = found["first_difference_margins"][0]
    assert found["first_difference_margins"][1:] == [None, None]
    assert margin["at_context_tokens"] == found["prompt_lengths"][0] + 2
    assert margin["batched_token"] == margin["single_token"] + 1 and margin["top_tokens"][0] == margin["single_token"]
    assert margin["batched_token_rank"] > 1
