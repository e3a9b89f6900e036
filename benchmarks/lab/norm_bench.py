"""What a Qwen3.5 RMSNorm costs at a length met for the first time and after, FLA's fused norm against transformers'
ops, on one CUDA device.

    python -m benchmarks.lab.norm_bench --out DIR [--lengths 3072,3328,3584,3072] [--norms q,k,hidden,gated]
                                    [--kernels fla,fla-own,torch] [--repeats 10]

For each norm of the 27B shape (``q``: the attention's query norm over ``[1, T, 24, 256]``; ``k``: its key norm over
``[1, T, 4, 256]``; ``hidden``: a decoder layer's norm over ``[1, T, 5120]``; ``gated``: the DeltaNet's gated norm
over ``[1, T, 48, 128]`` with its gate), each kernel and each length T of
``--lengths`` in order: the seconds of the first call (forward and the input's backward; the weight frozen, as under
LoRA), then the median ms of R timed calls (CUDA events). ``fla`` is FLA's ``rms_norm`` as training binds it: through
the product's adapter (``patches.kernels.fused_kernels.rms_norm``), its narrow kernels tuned once per width
(``fused_kernels.tune_by_width``), and FLA's ``rms_norm_gated`` likewise; ``fla-own`` the same kernels with FLA's
own autotune keys, which tune them again at every bucket of rows for widths of 512 or fewer (2,048 rows, 65,536 for
the gated norm); ``torch`` transformers' arithmetic
(``launcher.checks.kernels.glue``). Kernels run in the order given (``fla`` before ``fla-own``: the compiled kernels
stay in the process, so the first pays each compile). A length given twice (the defaults end with a repeat) shows
what a length met before costs. Run it with an empty ``TRITON_CACHE_DIR`` to see what a fresh machine pays.

Results go to ``DIR/norm.json``, rewritten after every reading.
"""

from __future__ import annotations

import json
import time
from typing import Any

from benchmarks.bench_assets import QWEN3_5_27B as SHAPE
from benchmarks.lab import kernel_cli
from benchmarks.lab.attention_bench import cuda_median_ms
from benchmarks.lab.kernel_cli import Results, counts_of, names_of, run

# norm -> (heads, width, FLA's rows per tuning bucket on CUDA or None) of Qwen3.5-27B: 24 query and 4 key heads of
# 256, hidden 5120, 48 DeltaNet value heads of 128; fla-core 0.6.0 NB = cdiv(rows, 2048) in
# fla/modules/norm/layernorm.py for widths <= 512 (wider ones: a row kernel, no bucket), cdiv(rows, 65536) in
# fused_norm_gate.py
NORMS = {
    "q": (SHAPE.num_attention_heads, SHAPE.head_dim, 2048),
    "k": (SHAPE.num_key_value_heads, SHAPE.head_dim, 2048),
    "hidden": (1, SHAPE.hidden_size, None),
    "gated": (SHAPE.linear_num_value_heads, SHAPE.linear_value_head_dim, 65536),
}
KERNELS = ("fla", "fla-own", "torch")
EPS = 1e-6


def kernel_of(name: str):
    """``(x, weight, eps, gate) -> y`` for ``name`` (the gated norm where ``gate`` is given): the product's FLA
    adapters (``fla``: tuned by width, ``fla-own``: FLA's own tuning; this process's FLA kernels keep that choice
    until the next call), or transformers' arithmetic."""
    from launcher.checks.kernels import glue as glue_kernels

    if name == "torch":
        ops = glue_kernels.torch_ops()
        return lambda x, weight, eps, gate: (
            ops["rms_norm"](x, weight, eps) if gate is None else ops["gated_norm"](x, gate, weight, eps)
        )
    from patches.kernels import fused_kernels

    fla_norm, fla_gated = fused_kernels.load("rms_norm", "fla"), fused_kernels.load("gated_norm", "fla")
    fused_kernels.restore_tuning()
    if name == "fla":
        fused_kernels.tune_by_width()
    return lambda x, weight, eps, gate: (
        fused_kernels.rms_norm("fla", fla_norm, x, weight, eps)
        if gate is None
        else fused_kernels.gated_norm(fla_gated, x, gate, weight, eps)
    )


def measure(
    torch, kernel, norm: str, tokens: int, repeats: int, device: str = "cuda", timer=cuda_median_ms
) -> dict[str, Any]:
    """One reading: the first call's seconds, then the median ms of ``repeats`` calls, forward and backward."""
    heads, width, per_bucket = NORMS[norm]
    shape = (1, tokens, width) if norm == "hidden" else (1, tokens, heads, width)
    x = torch.randn(*shape, device=device, dtype=torch.bfloat16, requires_grad=True)
    gate = torch.randn(*shape, device=device, dtype=torch.bfloat16, requires_grad=True) if norm == "gated" else None
    weight = (torch.randn(width, device=device) * 0.1).to(torch.bfloat16)  # frozen (zero-centred but the gated one's)
    grad = torch.randn(*shape, device=device, dtype=torch.bfloat16)

    def forward_backward():
        x.grad = None
        if gate is not None:
            gate.grad = None
        kernel(x, weight, EPS, gate).backward(grad)

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    forward_backward()
    sync()
    first = time.perf_counter() - start
    rows = tokens * heads
    return {
        "norm": norm,
        "tokens": tokens,
        "rows": rows,
        "width": width,
        "bucket": -(-rows // per_bucket) if per_bucket else None,
        "first_call_s": round(first, 3),
        "forward_backward_ms": round(timer(torch, forward_backward, repeats), 3),
    }


def input_problem(args) -> str | None:
    """What is wrong with the arguments (which value, how to fix), or None; checked before anything is written."""
    try:
        lengths = counts_of(args.lengths)
    except ValueError:
        return f"--lengths {args.lengths!r}: write whole token counts separated by commas, such as 3072,3328"
    if not lengths or min(lengths) < 1:
        return f"--lengths {args.lengths!r}: give one length or more, each 1 or more"
    for flag, given, known in (("--norms", args.norms, NORMS), ("--kernels", args.kernels, KERNELS)):
        unknown = [n for n in names_of(given) if n not in known] or ([] if names_of(given) else [""])
        if unknown:
            return f"{flag} {given!r}: {unknown[0]!r} is not one of {', '.join(known)}"
    return kernel_cli.below_one(args, "repeats")


def main(argv: list[str] | None = None) -> int:
    parser = kernel_cli.parser(__doc__, "norm.json")
    parser.add_argument(
        "--lengths",
        default="3072,3328,3584,3072",
        help="lengths in the order met, comma separated (default 3072,3328,3584,3072)",
    )
    parser.add_argument("--norms", default="q,k,hidden,gated", help="of q, k, hidden, gated (default all four)")
    parser.add_argument("--kernels", default="fla,fla-own,torch", help="of fla, fla-own, torch (default all three)")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per reading (default 10)")
    args = kernel_cli.parse("norm_bench", parser, argv, "norm.json", input_problem)
    if args is None:
        return 2
    import os

    import torch

    results = Results(
        "norm_bench",
        args.out,
        "norm.json",
        {
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(),
            "triton_cache_dir": "set" if os.environ.get("TRITON_CACHE_DIR") else "default",
            "readings": [],
        },
    )
    for name in names_of(args.kernels):
        kernel = kernel_of(name)
        for norm in names_of(args.norms):
            for tokens in counts_of(args.lengths):
                try:
                    found = {"kernel": name, **measure(torch, kernel, norm, tokens, args.repeats)}
                except KeyboardInterrupt:
                    return results.interrupted([name, norm, tokens], f"the {name} {norm} norm at {tokens} tokens")
                results.data["readings"].append(found)
                print(json.dumps(found), flush=True)
                results.save()
    return 0


if __name__ == "__main__":
    run(main)
