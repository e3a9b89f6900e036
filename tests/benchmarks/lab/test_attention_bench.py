"""The attention benchmark's arguments and its CPU-runnable parts (the measurement itself needs CUDA: its results
and command are in docs/lab/2026-12-05-packed-attention-mask.md)."""

from __future__ import annotations

from benchmarks.lab import attention_bench


def test_the_routes_agree_with_the_per_sample_reference_on_the_cpu(monkeypatch):
    """The routes that run on the CPU (SDPA's math kernel; the varlen kernel needs CUDA), at a small shape: the
    packed row under the block mask, and each sample's window alone (``per-sample``: the first window runs into the
    second sample, the second past the row's end), equal each sample alone; the unpacked call over the whole row does
    not (it is the unpacked step)."""
    import torch

    from patches.packing import masks, varlen

    monkeypatch.setattr(attention_bench, "HEADS", 6)
    monkeypatch.setattr(attention_bench, "KEY_HEADS", 2)
    monkeypatch.setattr(attention_bench, "HEAD_DIM", 16)
    numbered = attention_bench.numbered_row(torch, 64, [20, 30])
    assert attention_bench.sample_windows([20, 30], 48) == [(0, 20, 48), (20, 30, 48)]
    q, k, v = torch.randn(1, 6, 64, 16), torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
    mask = masks.block_causal_mask(numbered, torch.float32)
    expected = attention_bench.reference(torch, q, k, v, numbered)
    real = numbered[0] != 0
    masked, whole_row, per_sample = (
        attention_bench.route_call(torch, route, mask, varlen.PADDING_PIECE, [20, 30], 48)
        for route in ("masked", "sdpa", "per-sample")
    )
    assert attention_bench.relative(masked(q, k, v), expected, real) < 1e-5
    assert attention_bench.relative(per_sample(q, k, v), expected, real) < 1e-5
    assert attention_bench.relative(whole_row(q, k, v), expected, real) > 0.1


def test_an_interrupted_run_keeps_the_routes_done_and_names_the_one_it_was_in(tmp_path, monkeypatch, capsys):
    """The file is rewritten after every route, so a time limit inside a cold cuDNN graph keeps the routes before it
    (two of three files were once lost so, written only at the end). The measurement needs CUDA, which this machine
    may not have: ``torch.cuda``'s two queries, cuDNN's version and ``measure_route`` are stood in."""
    import json

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "stand-in")
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: None)
    calls = []

    def measure_route(torch, route, tokens, samples, repeats, piece, bucket):
        calls.append(route)
        if route == "per-sample":  # the routes before it are on disk already, not only once it is cut off
            assert list(json.loads((tmp_path / "attention.json").read_text())["routes"]) == ["sdpa", "varlen"]
            raise KeyboardInterrupt
        if route == "varlen":
            raise RuntimeError("no varlen kernel in this torch")
        return {"route": route, "forward_ms": 0.4}

    monkeypatch.setattr(attention_bench, "measure_route", measure_route)
    argv = ["--out", str(tmp_path), "--routes", "sdpa,varlen,per-sample,masked"]
    assert attention_bench.main(argv) == 130
    kept = json.loads((tmp_path / "attention.json").read_text())
    assert kept["routes"]["sdpa"] == {"route": "sdpa", "forward_ms": 0.4}
    assert kept["routes"]["varlen"]["error"] == "RuntimeError: no varlen kernel in this torch"
    assert kept["interrupted_in"] == "per-sample" and calls == ["sdpa", "varlen", "per-sample"]
    assert "interrupted in the route per-sample" in capsys.readouterr().err
    assert attention_bench.main(argv) == 2  # and a second run does not overwrite it
