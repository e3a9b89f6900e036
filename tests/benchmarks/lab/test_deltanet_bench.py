"""The DeltaNet kernel benchmark's arguments and bounds (the measurement needs CUDA and FLA's Triton kernels: its
results and commands are in docs/lab/2026-12-06-packed-attention-alone.md and docs/lab/2026-12-06-joined-bounds.md)."""

from __future__ import annotations

import itertools
import json
import sys
import types

from benchmarks.lab import deltanet_bench


def test_the_varlen_bounds_run_the_last_segment_to_the_end_of_the_row():
    assert deltanet_bench.bounds_of([2482, 1614], 4096) == [0, 2482, 4096]
    assert deltanet_bench.bounds_of([1200, 1700, 1100], 4096) == [0, 1200, 2900, 4096]  # the rest joined to the last


def test_an_interrupted_run_keeps_the_calls_done_and_names_the_one_it_was_in(tmp_path, monkeypatch, capsys):
    """The measurement needs CUDA, which this machine may not have: ``torch.cuda``'s two queries and ``measure`` are
    stood in (the first call measured, the second interrupted as a time limit would during a cold compile)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "stand-in")
    calls = []

    def measure(torch, kernel, cut, tokens, repeats):
        calls.append((kernel, cut))
        if len(calls) == 2:  # the first call is on disk already, not only once the run is cut off
            assert len(json.loads((tmp_path / "deltanet.json").read_text())["calls"]) == 1
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


def test_the_per_sample_convolution_starts_each_segment_afresh(monkeypatch):
    """FLA's Triton convolution cannot run here: a stand-in ``fla.modules.causal_conv1d`` (torch's depthwise
    convolution, causal, SiLU, the same call) checks the slicing and joining around it. Each segment's first tokens
    must not read the segment before; the whole row through the stand-in must differ there."""
    import torch
    import torch.nn.functional as F

    def causal_conv1d(x, weight, bias=None, activation=None, **kwargs):  # [B, T, D], [D, W]
        assert not kwargs.get("cu_seqlens") and x.is_contiguous()
        width = weight.shape[1]
        out = F.conv1d(F.pad(x.transpose(1, 2), (width - 1, 0)), weight.unsqueeze(1), bias, groups=x.shape[-1])
        return F.silu(out).transpose(1, 2), None

    module = types.ModuleType("fla.modules.causal_conv1d")
    module.causal_conv1d = causal_conv1d
    for name, found in (
        ("fla", types.ModuleType("fla")),
        ("fla.modules", types.ModuleType("fla.modules")),
        ("fla.modules.causal_conv1d", module),
    ):
        monkeypatch.setitem(sys.modules, name, found)
    torch.manual_seed(0)
    leaves = {"x": torch.randn(1, 20, 6), "weight": torch.randn(6, deltanet_bench.CONV_WIDTH)}
    bounds = [0, 7, 15, 20]
    joined = deltanet_bench.kernel_call(torch, "conv-per-sample", bounds)(leaves)
    alone = [causal_conv1d(leaves["x"][:, a:b], leaves["weight"])[0] for a, b in itertools.pairwise(bounds)]
    assert joined.shape == leaves["x"].shape
    assert torch.equal(joined, torch.cat(alone, dim=1))
    whole = causal_conv1d(leaves["x"], leaves["weight"])[0]
    assert not torch.allclose(joined[:, 7:10], whole[:, 7:10])  # the row as one sequence reads across the bound
    assert torch.allclose(joined[:, 10:15], whole[:, 10:15])  # past the first width-1 tokens they agree


def test_each_kernel_runs_the_calls_it_has(tmp_path, monkeypatch):
    """Stand-ins for CUDA and ``measure``, as above: the per-sample convolution runs on the segments only, the
    repeated chunk kernel plain only, the others both ways."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "stand-in")
    calls = []
    monkeypatch.setattr(deltanet_bench, "measure", lambda torch, kernel, cut, *_: calls.append((kernel, cut)) or {})
    assert deltanet_bench.main(["--out", str(tmp_path), "--kernels", "conv-per-sample,chunk-repeated,conv"]) == 0
    bounds = [0, 2482, 4096]
    assert calls == [("conv-per-sample", bounds), ("chunk-repeated", None), ("conv", None), ("conv", bounds)]
