"""The full-attention kernels of a packed row against the unpacked step's, at the 27B shape, on one CUDA device.

    python -m benchmarks.lab.attention_bench --out DIR [--tokens 4096] [--samples 1200,1700,1100] [--repeats 20]
                                         [--padding-piece 128] [--bucket 256]
                                         [--routes sdpa,sdpa-flash,sdpa-cudnn,varlen,aten-flash,per-sample,masked]

One layer's attention (24 query heads, 4 key heads, head dim 256, bf16: Qwen3.5-27B, docs/upstream.md) on one
row of ``--tokens`` tokens, forward and backward, for every route of ``--routes``:

- ``sdpa``: the unpacked step as transformers calls it (``scaled_dot_product_attention``, ``is_causal``,
  ``enable_gqa``; torch picks the backend), and ``sdpa-flash`` / ``sdpa-cudnn``: the same call held to one
  backend;
- ``varlen``: a packed row (the samples of ``--samples``, padding up to ``--tokens``) through
  ``patches.packing.varlen.varlen_attention`` with ``TORCH_VARLEN`` (``torch.nn.attention.varlen.varlen_attn``,
  FlashAttention 2 with the row's ``cu_seqlens``, key heads repeated where it cannot share them), the padding cut
  into segments of ``--padding-piece`` tokens (``patches.packing.varlen.PADDING_PIECE`` by default; 0: the padding one
  segment, the product before that cut);
- ``aten-flash``: the packed row through the product's CUDA route (``ATEN_FLASH``: ``aten._flash_attention_forward``,
  the operator ``varlen_attn`` wraps, key heads shared);
- ``per-sample``: the packed row as SDPA causal on each sample alone, without a mask (torch picks the backend, which
  the kernels below name), each call on a window of the row from the sample's first token, its length rounded up to
  ``--bucket`` tokens (zeros after the row's end), so that cuDNN, which builds a graph for every new shape, meets
  few: a route the product tried and dropped (docs/lab/2026-12-06-one-sample-route.md);
- ``masked``: SDPA with the 4D block-diagonal mask (the packed row's route where no varlen kernel is).

Per route: the first forward+backward timed alone (``first_call_ms``: with the graphs cuDNN builds for shapes new
to the process), 3 untimed calls, then ``R`` timed forwards and ``R`` timed forward+backward calls (CUDA events),
medians in ms (a checkpointed layer runs the forward twice and the backward once: their sum); the kernels of one
forward+backward by device time (``torch.profiler``), which tells the backend torch picked; and the relative L2
difference of the output and of the q and k gradients against an fp32 reference (each sample alone, causal) on
the real tokens. A route that fails records its error and the others go on.

Also timed (``mask``): LLaMA-Factory's ``prepare_4d_attention_mask`` of the row on the CPU (what its collator
does for every packed batch unless ``packed_rows.device_mask``) and its copy to the device, against
``patches.packing.masks.block_causal_mask`` on the device.

Results go to ``DIR/attention.json``, rewritten after every route; interrupted (Ctrl-C, ``timeout``, SIGTERM), it
keeps the routes done and names the one it was in (``interrupted_in``). Measurement only: nothing of the product's
state is changed.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

from benchmarks.lab import kernel_cli
from benchmarks.lab.kernel_cli import Results, counts_of, names_of, run

ROUTES = ("sdpa", "sdpa-flash", "sdpa-cudnn", "varlen", "aten-flash", "per-sample", "masked")
HEADS, KEY_HEADS, HEAD_DIM = 24, 4, 256  # Qwen3.5-27B full attention (benchmarks.bench_assets.QWEN3_5_27B)


def numbered_row(torch, tokens: int, samples: list[int]):
    """``[1, tokens]`` LLaMA-Factory's packed numbering: 1 for the first sample's tokens, 2 for the next, 0 padding."""
    row = torch.zeros(1, tokens, dtype=torch.long)
    start = 0
    for number, length in enumerate(samples, 1):
        row[0, start : start + length] = number
        start += length
    return row


def cuda_median_ms(torch, fn, repeats: int) -> float:
    """The median milliseconds of ``repeats`` calls of ``fn`` on the current CUDA stream (events, synchronised)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def sample_windows(samples: list[int], bucket: int) -> list[tuple[int, int, int]]:
    """``(start, length, window)`` of every sample laid end to end from token 0, ``window`` the length rounded up to
    ``bucket`` tokens."""
    starts = [sum(samples[:i]) for i in range(len(samples))]
    return [(start, length, -(-length // bucket) * bucket) for start, length in zip(starts, samples, strict=True)]


def per_sample_call(torch, samples: list[int], bucket: int):
    """The ``per-sample`` route: a function of ``(q, k, v)`` in ``[1, H, T, D]`` returning ``[T, H, D]``, the padding's
    outputs zero."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    def window_of(t, start: int, window: int):
        part = t[:, :, start : start + window]
        short = window - part.shape[2]
        return torch.cat([part, part.new_zeros(1, part.shape[1], short, part.shape[3])], dim=2) if short else part

    def call(q, k, v):
        pieces = []
        for start, length, window in sample_windows(samples, bucket):
            q_, k_, v_ = (window_of(t, start, window) for t in (q, k, v))
            pieces.append(sdpa(q_, k_, v_, is_causal=True, scale=HEAD_DIM**-0.5, enable_gqa=True)[0, :, :length])
        padding = q.shape[2] - sum(samples)
        pieces.append(q.new_zeros(q.shape[1], padding, q.shape[3]))
        return torch.cat(pieces, dim=1).transpose(0, 1)

    return call


def route_call(torch, route: str, mask4d, piece: int, samples: list[int] | None = None, bucket: int = 256):
    """A function of ``(q, k, v)`` in ``[1, H, T, D]`` returning ``[T, H, D]`` for ``route``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from patches.packing import masks, varlen

    scale = HEAD_DIM**-0.5
    if route.startswith("sdpa"):
        backend = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}.get(route)

        def call(q, k, v):
            if backend is None:
                out = sdpa(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            else:
                with sdpa_kernel(backend):
                    out = sdpa(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            return out[0].transpose(0, 1)

        return call
    if route == "per-sample":
        return per_sample_call(torch, samples or [], bucket)
    found = masks.segments(mask4d)
    if route == "masked":
        return lambda q, k, v: sdpa(q, k, v, attn_mask=mask4d, scale=scale, enable_gqa=True)[0].transpose(0, 1)
    kernel = varlen.ATEN_FLASH if route == "aten-flash" else varlen.TORCH_VARLEN
    return lambda q, k, v: varlen.varlen_attention(kernel, q, k, v, found, scale, piece)[0]


def reference(torch, q, k, v, numbered) -> Any:
    """fp32 causal attention of every sample alone, ``[T, H, D]``, zeros on padding."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    out = torch.zeros(q.shape[2], HEADS, HEAD_DIM, dtype=torch.float32, device=q.device)
    rows = numbered[0].tolist()
    for number in sorted(set(rows) - {0}):
        index = torch.tensor([i for i, n in enumerate(rows) if n == number], device=q.device)
        qs, ks, vs = (t[:, :, index].float() for t in (q, k, v))
        out[index] = sdpa(qs, ks, vs, is_causal=True, scale=HEAD_DIM**-0.5, enable_gqa=True)[0].transpose(0, 1)
    return out


def relative(a, b, real) -> float:
    a, b = a[real].float(), b[real].float()
    return round(float((a - b).norm() / b.norm().clamp_min(1e-12)), 6)


def measure_route(
    torch, route: str, tokens: int, samples: list[int], repeats: int, piece: int, bucket: int = 256
) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    from patches.packing import masks

    device = "cuda"
    torch.manual_seed(0)
    q = torch.randn(1, HEADS, tokens, HEAD_DIM, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(1, KEY_HEADS, tokens, HEAD_DIM, device=device, dtype=torch.bfloat16) for _ in range(2))
    packed = not route.startswith("sdpa")
    numbered = numbered_row(torch, tokens, samples if packed else [tokens]).to(device)
    mask4d = masks.block_causal_mask(numbered, torch.bfloat16)
    call = route_call(torch, route, mask4d, piece, samples, bucket)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    grad = torch.randn(tokens, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)

    def forward():
        with torch.no_grad():
            call(q, k, v)

    def forward_backward():
        for t in leaves:
            t.grad = None
        call(*leaves).backward(grad)

    found: dict[str, Any] = {"route": route, "samples": samples if packed else [tokens]}
    if route == "per-sample":
        found["windows"] = [window for *_, window in sample_windows(samples, bucket)]
    elif packed and route != "masked":
        found["padding_piece"] = piece
    found["first_call_ms"] = round(cuda_median_ms(torch, forward_backward, 1), 3)  # shapes new to this process: graphs
    for _ in range(3):
        forward_backward()
    found["forward_ms"] = round(cuda_median_ms(torch, forward, repeats), 3)
    found["forward_backward_ms"] = round(cuda_median_ms(torch, forward_backward, repeats), 3)
    # a checkpointed layer runs the forward twice (forward, recompute) and the backward once
    found["checkpointed_layer_ms"] = round(found["forward_ms"] + found["forward_backward_ms"], 3)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        forward_backward()
        torch.cuda.synchronize()
    kernels = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)
    found["kernels"] = [{"name": e.key[:120], "ms": round(e.device_time_total / 1000, 3)} for e in kernels[:4]]
    leaves_ref = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    expected = reference(torch, *leaves_ref, numbered)
    expected.backward(grad.float())
    for t in leaves:
        t.grad = None
    got = call(*leaves)
    got.backward(grad)
    real = numbered[0] != 0
    found["out_rel_l2"] = relative(got.detach(), expected.detach(), real)
    found["dq_rel_l2"] = relative(leaves[0].grad[0].transpose(0, 1), leaves_ref[0].grad[0].transpose(0, 1), real)
    found["dk_rel_l2"] = relative(leaves[1].grad[0].transpose(0, 1), leaves_ref[1].grad[0].transpose(0, 1), real)
    return found


def measure_mask(torch, tokens: int, samples: list[int], repeats: int) -> dict[str, Any]:
    """LLaMA-Factory's CPU mask and its copy to the device, against the mask built on the device."""
    from llamafactory.data.collator import prepare_4d_attention_mask

    from patches.packing.masks import block_causal_mask

    numbered = numbered_row(torch, tokens, samples)
    cpu, copy = [], []
    for _ in range(repeats):
        began = time.perf_counter()
        mask = prepare_4d_attention_mask(numbered, torch.bfloat16)
        built = time.perf_counter()
        mask.to("cuda")
        torch.cuda.synchronize()
        cpu.append(built - began)
        copy.append(time.perf_counter() - built)
    on_device = numbered.to("cuda")
    same = bool(torch.equal(block_causal_mask(on_device, torch.bfloat16).cpu(), mask))
    ms = cuda_median_ms(torch, lambda: block_causal_mask(on_device, torch.bfloat16), repeats)
    return {
        "cpu_build_ms": round(statistics.median(cpu) * 1000, 3),
        "copy_ms": round(statistics.median(copy) * 1000, 3),
        "device_build_ms": round(ms, 3),
        "same_mask": same,
        "torch_threads": torch.get_num_threads(),
    }


def input_problem(args) -> str | None:
    """What is wrong with the arguments (which value, how to fix), or None; checked before anything is written."""
    unknown = sorted(set(names_of(args.routes)) - set(ROUTES))
    if unknown:
        return f"--routes: unknown {', '.join(unknown)}; choose from {', '.join(ROUTES)}"
    try:
        samples = counts_of(args.samples)
    except ValueError:
        return f"--samples {args.samples!r}: write whole token counts separated by commas, such as 1200,1700,1100"
    if not samples or min(samples) < 1 or sum(samples) > args.tokens:
        return (
            f"--samples {args.samples!r}: give at least one sample, each of 1 token or more, {args.tokens} "
            "tokens in all at most (--tokens)"
        )
    if args.padding_piece is not None and args.padding_piece < 0:
        return f"--padding-piece {args.padding_piece}: give 0 (padding as one segment) or a positive token count"
    if args.bucket < 1:
        return f"--bucket {args.bucket}: give the per-sample windows' rounding in tokens, 1 or more (such as 256)"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = kernel_cli.parser(__doc__, "attention.json")
    parser.add_argument("--tokens", type=int, default=4096, help="row length (default 4096)")
    parser.add_argument(
        "--samples",
        default="1200,1700,1100",
        help="sample lengths of the packed row, comma separated; padding fills the rest",
    )
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per route (default 20)")
    parser.add_argument("--routes", default=",".join(ROUTES), help=f"comma separated, of {', '.join(ROUTES)}")
    parser.add_argument(
        "--padding-piece",
        type=int,
        default=None,
        metavar="N",
        help="the varlen routes take the padding as segments of at most N tokens (default: the "
        "product's PADDING_PIECE; 0: one segment); for example --samples 2482 "
        "--padding-piece 0 against --padding-piece 128",
    )
    parser.add_argument(
        "--bucket",
        type=int,
        default=256,
        metavar="N",
        help="the per-sample route's windows are the samples' lengths rounded up to N tokens "
        "(default 256; --bucket 4096 at --tokens 4096: every window the whole row)",
    )
    args = kernel_cli.parse("attention_bench", parser, argv, "attention.json", input_problem)
    if args is None:
        return 2
    import torch

    from patches.packing.varlen import PADDING_PIECE

    samples = counts_of(args.samples)
    piece = PADDING_PIECE if args.padding_piece is None else args.padding_piece
    results = Results(
        "attention_bench",
        args.out,
        "attention.json",
        {
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(),
            "cudnn": torch.backends.cudnn.version(),
            "tokens": args.tokens,
            "shape": {"heads": HEADS, "key_heads": KEY_HEADS, "head_dim": HEAD_DIM},
            "routes": {},
        },
    )
    for route in names_of(args.routes):
        try:
            results.data["routes"][route] = measure_route(
                torch, route, args.tokens, samples, args.repeats, piece, args.bucket
            )
        except KeyboardInterrupt:
            return results.interrupted(route, f"the route {route}")
        except Exception as error:  # noqa: BLE001 - a failing route is a result too
            results.data["routes"][route] = {"route": route, "error": f"{type(error).__name__}: {error}"[:600]}
        print(json.dumps(results.data["routes"][route]), flush=True)
        results.save()  # after every route: a cut-off run keeps them
    try:
        results.data["mask"] = measure_mask(torch, args.tokens, samples, args.repeats)
    except KeyboardInterrupt:
        return results.interrupted("mask", "the mask's timing")
    except Exception as error:  # noqa: BLE001
        results.data["mask"] = {"error": f"{type(error).__name__}: {error}"[:600]}
    print(json.dumps(results.data["mask"]), flush=True)
    results.save()
    return 0


if __name__ == "__main__":
    run(main)
