"""The DeltaNet kernel benchmark's arguments and bounds (the measurement needs CUDA and FLA's Triton kernels: its
results and commands are in docs/benchmarks.md, "Fourteenth invocation" and "Fifteenth invocation")."""

from __future__ import annotations

import json

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


def test_an_interrupted_run_keeps_the_calls_done_and_names_the_one_it_was_in(tmp_path, monkeypatch, capsys):
    """The measurement needs CUDA, which this machine may not have: ``torch.cuda``'s two queries and ``measure`` are
    stood in (the first call measured, the second interrupted as a time limit would during a cold compile)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "stand-in")
    calls = []

    def measure(torch, kernel, cut, tokens, repeats):
        calls.append((kernel, cut))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return {"kernel": kernel, "cu_seqlens": cut, "forward_ms": 0.2}

    monkeypatch.setattr(deltanet_bench, "measure", measure)
    assert deltanet_bench.main(["--out", str(tmp_path), "--kernels", "conv,chunk"]) == 130
    kept = json.loads((tmp_path / "deltanet.json").read_text())
    assert kept["calls"] == [{"kernel": "conv", "cu_seqlens": None, "forward_ms": 0.2}]
    assert kept["interrupted_in"] == {"kernel": "conv", "cu_seqlens": [0, 2482, 4096]}
    assert "interrupted in conv (varlen)" in capsys.readouterr().err and calls == [
        ("conv", None),
        ("conv", [0, 2482, 4096]),
    ]
