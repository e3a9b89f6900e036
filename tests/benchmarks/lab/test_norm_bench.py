"""The norm benchmark's arguments and its reading (the timing needs CUDA and FLA: its results and command are in
docs/lab/2026-12-07-narrow-norms.md; here the reading runs transformers' arithmetic on the CPU with a
stand-in timer)."""

from __future__ import annotations

import pytest

from benchmarks.lab import norm_bench


def test_a_reading_names_the_rows_and_the_bucket_fla_tunes_by():
    """q at 8 tokens: 24 heads of 256, so 192 rows in bucket 1 of 2,048; the hidden norm (5,120 wide) has no bucket
    (FLA's row kernel); the gated norm's buckets are 65,536 rows of 48 heads and it gets a gate; each call ran forward
    and backward once before the timer's calls."""
    import torch

    calls, seen = [], []

    def kernel(x, weight, eps, gate):
        seen.append((tuple(x.shape), gate is not None))
        return norm_bench.kernel_of("torch")(x, weight, eps, gate)

    def timer(torch, fn, repeats):
        calls.append(repeats)
        fn()
        return 0.25

    found = norm_bench.measure(torch, kernel, "q", 8, 3, device="cpu", timer=timer)
    assert found["rows"] == 8 * 24 and found["bucket"] == 1 and found["forward_backward_ms"] == 0.25
    assert seen == [((1, 8, 24, 256), False)] * 2 and calls == [3] and found["first_call_s"] >= 0
    hidden = norm_bench.measure(torch, kernel, "hidden", 8, 1, device="cpu", timer=timer)
    assert hidden["bucket"] is None and hidden["rows"] == 8 and hidden["width"] == 5120
    gated = norm_bench.measure(torch, kernel, "gated", 1400, 1, device="cpu", timer=timer)
    assert gated["rows"] == 1400 * 48 and gated["bucket"] == 2 and seen[-1] == ((1, 1400, 48, 128), True)
    heads, _, per_bucket = norm_bench.NORMS["q"]
    assert -(-3072 * heads // per_bucket) == 36


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--lengths", "3072,a"], "--lengths '3072,a': write whole token counts"),
        (["--lengths", "0"], "--lengths '0': give one length or more, each 1 or more"),
        (["--norms", "q,v"], "--norms 'q,v': 'v' is not one of q, k, hidden, gated"),
        (["--kernels", ""], "--kernels '': '' is not one of fla, fla-own, torch"),
        (["--repeats", "0"], "--repeats 0: give 1 or more"),
    ],
)
def test_bad_arguments_end_in_one_line_and_write_nothing(tmp_path, capsys, argv, says):
    assert norm_bench.main(["--out", str(tmp_path / "out"), *argv]) == 2
    assert says in capsys.readouterr().err and not (tmp_path / "out").exists()
