"""What the training loss costs per supervised token at the 27B shape, on one CUDA device.

    python -m benchmarks.loss_bench --out DIR [--supervised 2048,2457,2857] [--tokens 4096] [--chunk-tokens 512]
                                    [--repeats 6]

The product's loss (``patches.chunked_loss.chunked_causal_lm_loss``: the output projection and the cross-entropy
over the supervised positions only, in chunks of ``--chunk-tokens``, each chunk recomputed in the backward) on a
row of ``--tokens`` final hidden states (Qwen3.5-27B: hidden 5120, vocabulary 248,320, bf16, the projection frozen
as under LoRA), forward and backward under bf16 autocast, for each count of supervised tokens of ``--supervised``
(the last positions of the row but one). Per count: one untimed call, then the median ms of ``R`` timed calls
(CUDA events). A packed row and an unpacked step of the same length differ in how many of their tokens are
supervised; this prices that difference (docs/benchmarks.md, "Eighteenth invocation").

Results go to ``DIR/loss.json``, rewritten after every count. Measurement only: nothing of the product's state is
changed.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Any

from benchmarks.attention_bench import cuda_median_ms
from launcher.files import write_json_atomic

HIDDEN, VOCAB = 5120, 248320  # Qwen3.5-27B (benchmarks.bench_assets.QWEN3_5_27B and its text extras)


def measure(torch, head, tokens: int, supervised: int, chunk_tokens: int, repeats: int, device: str = "cuda",
            timer=cuda_median_ms) -> dict[str, Any]:  # fmt: skip
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


def counts_of(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def input_problem(args) -> str | None:
    """What is wrong with the arguments (which value, how to fix), or None; checked before anything is written."""
    try:
        counts = counts_of(args.supervised)
    except ValueError:
        return f"--supervised {args.supervised!r}: write whole token counts separated by commas, such as 2048,2857"
    if not counts or min(counts) < 1 or max(counts) > args.tokens - 1:
        return (f"--supervised {args.supervised!r}: give one count or more, each from 1 to {args.tokens - 1} "
                "(--tokens less one: the last position has no next token)")  # fmt: skip
    if args.chunk_tokens < 1 or args.repeats < 1:
        return f"--chunk-tokens {args.chunk_tokens}, --repeats {args.repeats}: give 1 or more of each"
    if (args.out / "loss.json").exists():
        return f"{args.out / 'loss.json'} exists; choose another --out, or move that file away"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for loss.json")
    parser.add_argument("--supervised", default="2048,2457,2857",
                        help="supervised tokens per reading, comma separated (default 2048,2457,2857)")  # fmt: skip
    parser.add_argument("--tokens", type=int, default=4096, help="row length (default 4096)")
    parser.add_argument("--chunk-tokens", type=int, default=512, help="chunked_loss's chunk_tokens (default 512)")
    parser.add_argument("--repeats", type=int, default=6, help="timed calls per reading (default 6)")
    args = parser.parse_args(argv)
    why = input_problem(args)
    import torch

    if why is None and not torch.cuda.is_available():
        why = "no CUDA device here: run it on a machine with an NVIDIA GPU"
    if why:
        print(f"loss_bench: {why}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    results: dict[str, Any] = {"torch": torch.__version__, "device": torch.cuda.get_device_name(),
                               "tokens": args.tokens, "chunk_tokens": args.chunk_tokens, "readings": []}  # fmt: skip
    for supervised in counts_of(args.supervised):
        try:
            found = measure(torch, head, args.tokens, supervised, args.chunk_tokens, args.repeats)
        except KeyboardInterrupt:
            results["interrupted_in"] = supervised
            write_json_atomic(args.out / "loss.json", results)
            print(f"loss_bench: interrupted at {supervised} supervised tokens; the readings done are in "
                  f"{args.out / 'loss.json'}", file=sys.stderr)  # fmt: skip
            return 130
        results["readings"].append(found)
        print(json.dumps(found), flush=True)
        write_json_atomic(args.out / "loss.json", results)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `timeout` and `kill` end it as Ctrl-C does
    sys.exit(main())
