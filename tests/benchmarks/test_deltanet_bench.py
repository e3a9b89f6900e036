"""The DeltaNet kernel benchmark's arguments and bounds (the measurement needs CUDA and FLA's Triton kernels: its
results and command are in docs/benchmarks.md, "Fourteenth invocation")."""

from __future__ import annotations

import pytest

from benchmarks import deltanet_bench


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--kernels", "conv,fastest"], "--kernels: unknown fastest; choose from conv, chunk, chunk-repeated"),
        (["--samples", "2482,lots"], "--samples '2482,lots': write whole token counts separated by commas"),
        (["--samples", "4096"], "give two segments or more (one is the plain call)"),
        (["--samples", "3000,2000"], "4096 tokens in all at most (--tokens)"),
        (["--samples", "2482,0"], "each of 1 token or more"),
        (["--repeats", "0"], "--repeats 0: give 1 or more timed calls"),
    ],
)
def test_bad_arguments_end_in_one_message_and_write_nothing(tmp_path, capsys, argv, said):
    out = tmp_path / "out"
    assert deltanet_bench.main(["--out", str(out), *argv]) == 2
    assert said in capsys.readouterr().err and not out.exists()


def test_an_earlier_result_is_not_overwritten(tmp_path, capsys):
    (tmp_path / "deltanet.json").write_text('{"kept": true}\n')
    assert deltanet_bench.main(["--out", str(tmp_path)]) == 2
    assert "deltanet.json exists; choose another --out" in capsys.readouterr().err
    assert (tmp_path / "deltanet.json").read_text() == '{"kept": true}\n'


def test_the_varlen_bounds_run_the_last_segment_to_the_end_of_the_row():
    assert deltanet_bench.bounds_of([2482, 1614], 4096) == [0, 2482, 4096]
    assert deltanet_bench.bounds_of([1200, 1700, 1100], 4096) == [0, 1200, 2900, 4096]  # the rest joined to the last


def test_without_cuda_it_says_so_and_writes_nothing(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the benchmark would run")
    out = tmp_path / "out"
    assert deltanet_bench.main(["--out", str(out)]) == 2
    assert "no CUDA device here: run it on a machine with an NVIDIA GPU" in capsys.readouterr().err
    assert not out.exists()
