"""The loss benchmark's arguments and its reading (the timing needs CUDA: its results and command are in
docs/benchmarks.md, "Eighteenth invocation"; here the reading runs on the CPU with a small output projection and a
stand-in timer)."""

from __future__ import annotations

import pytest

from benchmarks import loss_bench


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--supervised", "2048,most"], "--supervised '2048,most': write whole token counts separated by commas"),
        (["--supervised", "4096"], "each from 1 to 4095 (--tokens less one"),
        (["--supervised", "0"], "each from 1 to 4095"),
        (["--chunk-tokens", "0"], "--chunk-tokens 0, --repeats 6: give 1 or more of each"),
    ],
)
def test_bad_arguments_end_in_one_message_and_write_nothing(tmp_path, capsys, argv, said):
    out = tmp_path / "out"
    assert loss_bench.main(["--out", str(out), *argv]) == 2
    assert said in capsys.readouterr().err and not out.exists()


def test_an_earlier_result_is_not_overwritten(tmp_path, capsys):
    (tmp_path / "loss.json").write_text('{"kept": true}\n')
    assert loss_bench.main(["--out", str(tmp_path)]) == 2
    assert "loss.json exists; choose another --out" in capsys.readouterr().err
    assert (tmp_path / "loss.json").read_text() == '{"kept": true}\n'


def test_without_cuda_it_says_so_and_writes_nothing(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the benchmark would run")
    out = tmp_path / "out"
    assert loss_bench.main(["--out", str(out)]) == 2
    assert "no CUDA device here: run it on a machine with an NVIDIA GPU" in capsys.readouterr().err
    assert not out.exists()


def test_a_reading_labels_the_asked_count_and_runs_the_loss_in_chunks():
    """On the CPU, a projection of 32 to 50 and a timer that runs the call once: the loss sees exactly the asked
    supervised tokens (the row's last positions but one), in chunks of ``chunk_tokens``."""
    import torch

    head = torch.nn.Linear(32, 50, bias=False).to(torch.bfloat16).requires_grad_(False)
    calls = []

    def timer(torch, fn, repeats):
        calls.append(repeats)
        fn()
        return 1.5

    found = loss_bench.measure(torch, head, 64, 21, 8, 3, device="cpu", timer=timer)
    assert found == {"supervised": 21, "chunks": 3, "forward_backward_ms": 1.5} and calls == [3]
