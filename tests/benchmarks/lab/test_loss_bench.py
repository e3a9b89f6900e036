"""The loss benchmark's arguments and its reading (the timing needs CUDA: its results and command are in
docs/lab/2026-12-06-unrepeated-key-heads.md; here the reading runs on the CPU with a small output projection and a
stand-in timer)."""

from __future__ import annotations

from benchmarks.lab import loss_bench


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
