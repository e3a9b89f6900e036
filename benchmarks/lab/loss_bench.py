"""What the training loss costs per supervised token at the 27B shape, on one CUDA device.

    python -m benchmarks.lab.loss_bench --out DIR [--supervised 2048,2457,2857] [--tokens 4096] [--chunk-tokens 512]
                                    [--repeats 6]

The product's loss (``patches.chunked_loss.chunked_causal_lm_loss``: the output projection and the cross-entropy
over the supervised positions only, in chunks of ``--chunk-tokens``, each chunk recomputed in the backward) on a
row of ``--tokens`` final hidden states (Qwen3.5-27B: hidden 5120, vocabulary 248,320, bf16, the projection frozen
as under LoRA), forward and backward under bf16 autocast, for each count of supervised tokens of ``--supervised``
(the last positions of the row but one). Per count: one untimed call, then the median ms of ``R`` timed calls
(CUDA events). A packed row and an unpacked step of the same length differ in how many of their tokens are
supervised; this prices that difference (docs/lab/2026-12-06-unrepeated-key-heads.md).

Results go to ``DIR/loss.json``, rewritten after every count. Measurement only: nothing of the product's state is
changed.
"""

from __future__ import annotations

import json
from typing import Any

from benchmarks.lab import kernel_cli
from benchmarks.lab.attention_bench import cuda_median_ms
from benchmarks.lab.kernel_cli import Results, counts_of, run

HIDDEN, VOCAB = 5120, 248320  # Qwen3.5-27B (benchmarks.bench_assets.QWEN3_5_27B and its text extras)


def measure(
    torch,
    head,
    tokens: int,
    supervised: int,
    chunk_tokens: int,
    repeats: int,
    device: str = "cuda",
    timer=cuda_median_ms,
) -> dict[str, Any]:
    """One reading: ``supervised`` of the row's last positions labelled, the loss's forward+backward timed."""
    from patches.chunked_loss import chunked_causal_lm_loss

    hidden = torch.randn(1, tokens, head.in_features, device=device, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.full((1, tokens), -100, device=device)
    labels[0, tokens - supervised - 1 : tokens - 1] = torch.randint(0, head.out_features, (supervised,))
    counted: dict[str, int] = {}

    def forward_backward():
        hidden.grad = None
        with torch.autocast(device, dtype=torch.bfloat16):
            loss, counted["supervised"], counted["chunks"] = chunked_causal_lm_loss(hidden, labels, head, chunk_tokens)
        loss.backward()

    forward_backward()
    ms = timer(torch, forward_backward, repeats)
    return {"supervised": counted["supervised"], "chunks": counted["chunks"], "forward_backward_ms": round(ms, 3)}


def input_problem(args) -> str | None:
    """What is wrong with the arguments (which value, how to fix), or None; checked before anything is written."""
    try:
        counts = counts_of(args.supervised)
    except ValueError:
        return f"--supervised {args.supervised!r}: write whole token counts separated by commas, such as 2048,2857"
    if not counts or min(counts) < 1 or max(counts) > args.tokens - 1:
        return (
            f"--supervised {args.supervised!r}: give one count or more, each from 1 to {args.tokens - 1} "
            "(--tokens less one: the last position has no next token)"
        )
    if args.chunk_tokens < 1 or args.repeats < 1:
        return f"--chunk-tokens {args.chunk_tokens}, --repeats {args.repeats}: give 1 or more of each"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = kernel_cli.parser(__doc__, "loss.json")
    parser.add_argument(
        "--supervised",
        default="2048,2457,2857",
        help="supervised tokens per reading, comma separated (default 2048,2457,2857)",
    )
    parser.add_argument("--tokens", type=int, default=4096, help="row length (default 4096)")
    parser.add_argument("--chunk-tokens", type=int, default=512, help="chunked_loss's chunk_tokens (default 512)")
    parser.add_argument("--repeats", type=int, default=6, help="timed calls per reading (default 6)")
    args = kernel_cli.parse("loss_bench", parser, argv, "loss.json", input_problem)
    if args is None:
        return 2
    import torch

    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    results = Results(
        "loss_bench",
        args.out,
        "loss.json",
        {
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(),
            "tokens": args.tokens,
            "chunk_tokens": args.chunk_tokens,
            "readings": [],
        },
    )
    for supervised in counts_of(args.supervised):
        try:
            found = measure(torch, head, args.tokens, supervised, args.chunk_tokens, args.repeats)
        except KeyboardInterrupt:
            return results.interrupted(supervised, f"the reading at {supervised} supervised tokens")
        results.data["readings"].append(found)
        print(json.dumps(found), flush=True)
        results.save()
    return 0


if __name__ == "__main__":
    run(main)
