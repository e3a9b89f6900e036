"""FLA's DeltaNet kernels at the 27B shape on one CUDA device, called as an unpacked step calls them and as a
packed row does (with ``cu_seqlens``).

    python -m benchmarks.lab.deltanet_bench --out DIR [--tokens 4096] [--samples 2482,1614] [--repeats 10]
                                        [--kernels conv,conv-per-sample,chunk,chunk-repeated]

One Gated DeltaNet layer of Qwen3.5-27B (16 key heads and 48 value heads of 128; the short convolution over the
10,240 channels of q, k and v, width 4, SiLU; docs/upstream.md), bf16, one row of ``--tokens`` tokens, forward
and backward:

- ``conv``: FLA's ``causal_conv1d`` (the kernel ``fused_ops`` binds on CUDA);
- ``conv-per-sample``: the same kernel without ``cu_seqlens``, called once on each segment's slice of the row
  and the outputs joined (``torch.cat``): another way for a packed row to keep its samples apart, priced
  against ``conv``'s varlen call (0.50 ms more than the plain one a checkpointed layer on an H100);
- ``chunk``: FLA's ``chunk_gated_delta_rule`` with the key heads as they are (``packing.deltanet.value_heads`` hands
  them so), q and k L2-normed in the kernel;
- ``chunk-repeated``: the same with the key heads first repeated for the value heads, as transformers' forward
  does in an unpacked step (the copies and their backward timed with the kernel).

Each is called ``plain``, without ``cu_seqlens`` (an unpacked step; a packed row of one sample since
``packing.masks.Segments.state_bounds``), and ``conv`` and ``chunk`` also ``varlen``, with the ``cu_seqlens`` of the
``--samples`` segments, the last running to the end of the row (``state_bounds`` joins a row's padding to the
sample before it): ``--samples 2482,1614`` is a row of one 2,482-token sample with its padding as a segment of its
own, the bounds the product gave such a row before ``state_bounds``; ``--samples 1200,1700,1196`` three samples.
``conv-per-sample`` runs on those segments only.

Per call: the first forward+backward timed alone (``first_call_s``: Triton's compile and autotune on a cold
cache), 3 untimed calls, then ``R`` timed forwards and ``R`` timed forward+backward calls (CUDA events, the device
idle before each, so the host's launch time is inside them where a training step would partly hide it), medians
in ms, and their sum (``checkpointed_layer_ms``: a checkpointed layer runs the forward twice and the backward
once). FLA's Hopper guard is lifted in this process as ``benchmarks.fla_guard`` does for a run (fla-core 0.6.0
refuses Hopper under Triton 3.4 to 3.7.1). A call that fails records its error and the others go on.

Results go to ``DIR/deltanet.json``, rewritten after every call; interrupted (Ctrl-C, ``timeout``, SIGTERM), it
keeps the calls done, names the one it was in (``interrupted_in``) and exits 130. Measurement only: nothing of the
product's state is changed.
"""

from __future__ import annotations

import itertools
import json
import time
from typing import Any

from benchmarks.lab import kernel_cli
from benchmarks.lab.attention_bench import cuda_median_ms
from benchmarks.lab.kernel_cli import Results, counts_of, names_of, run

KERNELS = ("conv", "conv-per-sample", "chunk", "chunk-repeated")
KEY_HEADS, VALUE_HEADS, HEAD_DIM, CONV_WIDTH = 16, 48, 128, 4  # Qwen3.5-27B (benchmarks.bench_assets.QWEN3_5_27B)


def bounds_of(samples: list[int], tokens: int) -> list[int]:
    """``cu_seqlens`` of segments of ``samples`` tokens laid end to end, the last running to ``tokens``."""
    return [*itertools.accumulate([0, *samples[:-1]]), tokens]


def draw_inputs(torch, kernel: str, tokens: int) -> dict[str, Any]:
    """The kernel's inputs as leaves that take gradients, seeded, on the CUDA device."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    if kernel.startswith("conv"):
        width = (2 * KEY_HEADS + VALUE_HEADS) * HEAD_DIM
        found = {"x": draw(1, tokens, width), "weight": draw(width, CONV_WIDTH, scale=0.5)}
    else:
        gates = (1, tokens, VALUE_HEADS)  # one gate and one beta per value head and token
        found = {
            "q": draw(1, tokens, KEY_HEADS, HEAD_DIM),
            "k": draw(1, tokens, KEY_HEADS, HEAD_DIM),
            "v": draw(*gates, HEAD_DIM),
            "g": -torch.rand(*gates, generator=gen, device="cuda"),
            "beta": torch.rand(*gates, generator=gen, device="cuda").to(torch.bfloat16),
        }
    return {name: t.requires_grad_() for name, t in found.items()}


def kernel_call(torch, kernel: str, bounds: list[int] | None):
    """A function of the inputs returning the kernel's output, with ``cu_seqlens`` (device and CPU) of ``bounds``."""
    if kernel == "conv-per-sample":  # no cu_seqlens: the plain kernel on each segment's slice, the outputs joined
        from fla.modules.causal_conv1d import causal_conv1d

        assert bounds is not None, "conv-per-sample runs on segments"
        sizes = [b - a for a, b in itertools.pairwise(bounds)]  # split, not slices: its backward is one join
        return lambda t: torch.cat(
            [
                causal_conv1d(part, weight=t["weight"], bias=None, activation="silu")[0]
                for part in t["x"].split(sizes, dim=1)
            ],
            dim=1,
        )
    extra = (
        {}
        if bounds is None
        else {"cu_seqlens": torch.tensor(bounds, device="cuda"), "cu_seqlens_cpu": torch.tensor(bounds)}
    )
    if kernel == "conv":
        from fla.modules.causal_conv1d import causal_conv1d

        return lambda t: causal_conv1d(t["x"], weight=t["weight"], bias=None, activation="silu", **extra)[0]
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    def run(t):
        q, k = t["q"], t["k"]
        if kernel == "chunk-repeated":
            q, k = (x.repeat_interleave(VALUE_HEADS // KEY_HEADS, dim=2) for x in (q, k))
        return chunk_gated_delta_rule(q, k, t["v"], g=t["g"], beta=t["beta"], use_qk_l2norm_in_kernel=True, **extra)[0]

    return run


def measure(torch, kernel: str, bounds: list[int] | None, tokens: int, repeats: int) -> dict[str, Any]:
    leaves = draw_inputs(torch, kernel, tokens)
    fn = kernel_call(torch, kernel, bounds)

    def forward():
        with torch.no_grad():
            fn(leaves)

    def forward_backward():
        for leaf in leaves.values():
            leaf.grad = None
        out = fn(leaves)
        out.backward(torch.ones_like(out))

    started = time.perf_counter()
    forward_backward()
    torch.cuda.synchronize()
    first = round(time.perf_counter() - started, 2)
    found: dict[str, Any] = {"kernel": kernel, "cu_seqlens": bounds, "first_call_s": first}
    for _ in range(3):
        forward_backward()
    found["forward_ms"] = round(cuda_median_ms(torch, forward, repeats), 3)
    found["forward_backward_ms"] = round(cuda_median_ms(torch, forward_backward, repeats), 3)
    found["checkpointed_layer_ms"] = round(found["forward_ms"] + found["forward_backward_ms"], 3)
    return found


def input_problem(args) -> str | None:
    """What is wrong with the arguments (which value, how to fix), or None; checked before anything is written."""
    unknown = sorted(set(names_of(args.kernels)) - set(KERNELS))
    if unknown:
        return f"--kernels: unknown {', '.join(unknown)}; choose from {', '.join(KERNELS)}"
    try:
        samples = counts_of(args.samples)
    except ValueError:
        return f"--samples {args.samples!r}: write whole token counts separated by commas, such as 2482,1614"
    if len(samples) < 2 or min(samples) < 1 or sum(samples) > args.tokens:
        return (
            f"--samples {args.samples!r}: give two segments or more (one is the plain call), each of 1 token or "
            f"more, {args.tokens} tokens in all at most (--tokens)"
        )
    if args.repeats < 1:
        return f"--repeats {args.repeats}: give 1 or more timed calls"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = kernel_cli.parser(__doc__, "deltanet.json")
    parser.add_argument("--tokens", type=int, default=4096, help="row length (default 4096)")
    parser.add_argument(
        "--samples",
        default="2482,1614",
        help="segment lengths of the varlen calls, comma separated, the last running to the end of "
        "the row (default 2482,1614: one sample and its padding)",
    )
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per measurement (default 10)")
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"comma separated, of {', '.join(KERNELS)}")
    args = kernel_cli.parse("deltanet_bench", parser, argv, "deltanet.json", input_problem)
    if args is None:
        return 2
    import torch

    from benchmarks.fla_guard import lift_hopper_guard

    guard = lift_hopper_guard()
    bounds = bounds_of(counts_of(args.samples), args.tokens)
    results = Results(
        "deltanet_bench",
        args.out,
        "deltanet.json",
        {
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(),
            "tokens": args.tokens,
            "fla_guard": guard,
            "calls": [],
        },
    )
    for kernel in names_of(args.kernels):
        cuts = {"chunk-repeated": (None,), "conv-per-sample": (bounds,)}.get(kernel, (None, bounds))
        for cut in cuts:
            try:
                found = measure(torch, kernel, cut, args.tokens, args.repeats)
            except KeyboardInterrupt:  # a time limit inside a cold compile: the calls done are kept
                return results.interrupted(
                    {"kernel": kernel, "cu_seqlens": cut}, f"{kernel} ({'varlen' if cut else 'plain'})"
                )
            except Exception as error:  # noqa: BLE001 - a failing call is a result too
                found = {"kernel": kernel, "cu_seqlens": cut, "error": f"{type(error).__name__}: {error}"[:600]}
            results.data["calls"].append(found)
            print(json.dumps(found), flush=True)
            results.save()  # after every call: a cut-off run keeps them
    return 0


if __name__ == "__main__":
    run(main)
