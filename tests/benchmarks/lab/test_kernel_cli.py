"""The command-line frame the one-device benchmarks share (``benchmarks.lab.kernel_cli``), through each benchmark's own
``main``: a bad argument ends in one message and writes nothing, an earlier results file is never overwritten, and
the CUDA benchmarks say so where no CUDA device is."""

from __future__ import annotations

import pytest

from benchmarks.lab import attention_bench, collate_bench, deltanet_bench, loss_bench

RESULTS = {
    loss_bench: "loss.json",
    deltanet_bench: "deltanet.json",
    attention_bench: "attention.json",
    collate_bench: "collate.json",
}
NEEDS_CUDA = (loss_bench, deltanet_bench, attention_bench)


@pytest.mark.parametrize(
    ("bench", "argv", "said"),
    [
        (loss_bench, ["--supervised", "2048,most"], "--supervised '2048,most': write whole token counts separated"),
        (loss_bench, ["--supervised", "4096"], "each from 1 to 4095 (--tokens less one"),
        (loss_bench, ["--supervised", "0"], "each from 1 to 4095"),
        (loss_bench, ["--chunk-tokens", "0"], "--chunk-tokens 0, --repeats 6: give 1 or more of each"),
        (deltanet_bench, ["--kernels", "conv,fastest"], "--kernels: unknown fastest; choose from conv, conv-per-"),
        (deltanet_bench, ["--samples", "2482,lots"], "--samples '2482,lots': write whole token counts separated"),
        (deltanet_bench, ["--samples", "4096"], "give two segments or more (one is the plain call)"),
        (deltanet_bench, ["--samples", "3000,2000"], "4096 tokens in all at most (--tokens)"),
        (deltanet_bench, ["--samples", "2482,0"], "each of 1 token or more"),
        (deltanet_bench, ["--repeats", "0"], "--repeats 0: give 1 or more timed calls"),
        (attention_bench, ["--routes", "sdpa,fastest"], "--routes: unknown fastest; choose from sdpa, sdpa-flash"),
        (attention_bench, ["--samples", "1200,lots"], "--samples '1200,lots': write whole token counts separated"),
        (attention_bench, ["--samples", "3000,2000"], "4096 tokens in all at most (--tokens)"),
        (attention_bench, ["--samples", "0"], "each of 1 token or more"),
        (attention_bench, ["--padding-piece", "-1"], "--padding-piece -1: give 0 (padding as one segment) or a"),
        (attention_bench, ["--bucket", "0"], "--bucket 0: give the per-sample windows' rounding in tokens, 1 or more"),
        (collate_bench, ["--rows", "-1"], "--rows -1, --repeats 3: give 0 (every row) or more rows, and 1 or more"),
        (collate_bench, ["--cutoff", "100"], "--cutoff 100: give 256 tokens or more"),
    ],
)
def test_bad_arguments_end_in_one_message_and_write_nothing(tmp_path, capsys, bench, argv, said):
    out = tmp_path / "out"
    assert bench.main(["--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1 and not out.exists()


@pytest.mark.parametrize("bench", list(RESULTS), ids=lambda bench: bench.__name__.rsplit(".")[-1])
def test_an_earlier_result_is_not_overwritten(tmp_path, capsys, bench):
    (tmp_path / RESULTS[bench]).write_text('{"kept": true}\n')
    assert bench.main(["--out", str(tmp_path)]) == 2
    assert f"{RESULTS[bench]} exists; choose another --out" in capsys.readouterr().err
    assert (tmp_path / RESULTS[bench]).read_text() == '{"kept": true}\n'


@pytest.mark.parametrize("bench", NEEDS_CUDA, ids=lambda bench: bench.__name__.rsplit(".")[-1])
def test_without_cuda_it_says_so_and_writes_nothing(tmp_path, capsys, bench):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the benchmark would run")
    out = tmp_path / "out"
    assert bench.main(["--out", str(out)]) == 2
    assert "no CUDA device here: run it on a machine with an NVIDIA GPU" in capsys.readouterr().err
    assert not out.exists()


def test_sigterm_ends_a_benchmark_as_ctrl_c_does_keeping_its_readings(tmp_path):
    """``kernel_cli.run`` in a real process: SIGTERM (what ``timeout`` and ``kill`` send) reaches ``main`` as a
    Ctrl-C, which keeps the readings done, names where it stopped and exits 130."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import textwrap
    import time
    from pathlib import Path

    script = tmp_path / "bench.py"
    script.write_text(
        textwrap.dedent("""
        import sys, time
        from pathlib import Path
        from benchmarks.lab.kernel_cli import Results, run

        def main():
            results = Results("probe", Path(sys.argv[1]), "probe.json", {"readings": [1.5]})
            results.save()
            try:
                (Path(sys.argv[1]) / "ready").write_text("")
                while True:
                    time.sleep(0.05)
            except KeyboardInterrupt:
                return results.interrupted("the second reading", "the second reading")

        run(main)
    """)
    )
    repo = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(repo), os.environ.get("PYTHONPATH"))))}
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env, stderr=subprocess.PIPE, text=True)
    try:
        while not (tmp_path / "ready").exists():
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 130
    finally:
        proc.kill()
    kept = json.loads((tmp_path / "probe.json").read_text())
    assert kept == {"readings": [1.5], "interrupted_in": "the second reading"}
    assert "probe: interrupted in the second reading; the readings done are in" in proc.stderr.read()
