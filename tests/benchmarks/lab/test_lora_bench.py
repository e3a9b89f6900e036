"""The LoRA cast benchmark's arguments and its reading (the timing needs CUDA: its results and command are in
docs/lab/2026-12-07-lora-input-cast.md; here the reading runs on the CPU under CPU autocast with a stand-in timer and a
small input, through real PEFT and the real ``lora_input_cast``)."""

from __future__ import annotations

import pytest

from benchmarks.lab import lora_bench

pytest_plugins = ["tests.support.patch_fixtures"]


@pytest.mark.usefixtures("restore_patches")
def test_a_reading_runs_both_ways_and_the_skip_leaves_the_update_as_it_was(tmp_path):
    """k_proj at 8 tokens: the cast way skips nothing, the skip way skips PEFT's cast in every call; with dropout 0
    the two agree to the bit (bf16 either way under autocast), and the patch is gone after the reading."""
    import torch

    from patches import lora_input_cast

    calls = []

    def timer(torch, fn, repeats):
        calls.append(repeats)
        fn()
        return 0.5

    found = lora_bench.measure(torch, "k_proj", 8, 4, 0.0, 3, tmp_path, device="cpu", timer=timer)
    assert found["features"] == [5120, 1024] and calls == [3, 3, 3, 3]
    assert found["cast"]["casts_skipped"] == 0
    # the first call, a timed forward and a timed forward+backward: one skipped cast each
    assert found["skip"]["casts_skipped"] == 3
    assert found["gap"] == 0.0
    assert lora_input_cast._state == {}  # restored: PEFT as it ships
    from patches.core import trainer_hook

    assert not trainer_hook.is_installed()


@pytest.mark.usefixtures("restore_patches")
def test_with_dropout_no_gap_is_read_and_the_step_counts_every_attention_layer(tmp_path):
    import torch

    found = lora_bench.measure(torch, "o_proj", 4, 2, 0.5, 1, tmp_path, device="cpu", timer=lambda t, fn, r: 1.0)
    assert "gap" not in found and found["features"] == [6144, 5120]
    readings = [
        found,
        {
            "cast": {"forward_ms": 2.0, "forward_backward_ms": 3.0},
            "skip": {"forward_ms": 1.0, "forward_backward_ms": 2.0},
        },
    ]
    assert lora_bench.ATTENTION_LAYERS == 16
    assert lora_bench.step_ms(readings, "cast") == 16 * (2.0 + 5.0)
    assert lora_bench.step_ms(readings, "skip") == 16 * (2.0 + 3.0)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--tokens", "0"], "--tokens 0: give 1 or more"),
        (["--rank", "0"], "--rank 0: give 1 or more"),
        (["--dropout", "1"], "--dropout 1.0: give a probability from 0 up to, not including, 1"),
        (["--repeats", "0"], "--repeats 0: give 1 or more"),
    ],
)
def test_bad_arguments_end_in_one_line_and_write_nothing(tmp_path, capsys, argv, says):
    assert lora_bench.main(["--out", str(tmp_path / "out"), *argv]) == 2
    assert says in capsys.readouterr().err and not (tmp_path / "out").exists()
