"""The glue cases of ``launcher validate-kernels``: the fused convolution, norms and SwiGLU against fp32.

Which kernel: the one training binds (``patches.kernels.fused_kernels.select_kernels``, as the ``fused_ops`` patch
decides it before the model is built): FLA's Triton kernels on CUDA, FLA's triton-ascend kernels and
``torch_npu.npu_rms_norm`` on NPU, transformers' torch ops on CPU (then the "routed" op is the torch op in bf16
and the errors are bf16 rounding only, so the comparison is live). Each op is called through the same adapter
the patch installs (``FlaConv``, ``fused_kernels.rms_norm``, ``fused_kernels.gated_norm``).

How a case is checked: inputs drawn once and rounded to bf16 (the conv's input as the DeltaNet layer hands it:
the transpose of a contiguous ``[B, T, D]`` projection; the zero-centred RMSNorm weight small around 0, the gated
norm's around 1); the routed op runs in bf16 forward and backward against a fixed output gradient; the reference
is transformers' arithmetic (``Qwen3_5GatedDeltaNet``'s ``nn.Conv1d`` + SiLU, ``Qwen3_5RMSNorm``,
``Qwen3_5RMSNormGated``, ``silu(gate) * up``) in fp32 on the same values. Reported: the relative L2 error of the
output and of every input's gradient; PASS under 1 % (``GLUE_THRESHOLD``) with everything finite. The conv cases
have T != D and batch 2 in the quick suite, so a kernel reading the layout the wrong way round cannot pass. The
``conv_varlen`` cases pack samples end to end in one row, as ``packed_rows`` does: the routed convolution takes the
samples' boundaries (FLA's ``cu_seqlens``; the segment-reset torch convolution elsewhere), the reference convolves
each sample alone, so a kernel that reads across a sample start cannot pass.
``timing`` cases add the median milliseconds of forward+backward, routed vs the torch op in bf16.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

from launcher.checks.kernels.cases import Case, CaseResult, Device, _FullPrecision, rel_error, run_case

GLUE_THRESHOLD = 0.01
EPS = 1e-6
TIMING_WARMUP, TIMING_REPEATS = 3, 10


def torch_ops() -> dict[str, Callable]:
    """transformers 5.6.0's arithmetic for each op, in the dtype of its inputs (the reference runs it in fp32)."""
    import torch
    import torch.nn.functional as F

    def conv(x, weight, bias=None, activation="silu", seq_idx=None):  # x [B, D, T], weight [D, W]
        taps, length = weight.shape[-1], x.shape[-1]
        out = F.conv1d(x, weight.unsqueeze(1), bias, padding=taps - 1, groups=x.shape[1])[..., :length]
        return F.silu(out)

    def rms_norm(x, weight, eps):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).type_as(x)

    def gated_norm(x, gate, weight, eps):
        xf = x.float()
        normed = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return (normed * F.silu(gate.float())).to(x.dtype)

    def swiglu(gate, up):
        return F.silu(gate) * up

    return {"conv": conv, "rms_norm": rms_norm, "gated_norm": gated_norm, "swiglu": swiglu}


def glue_kernel(op: str, kernel: str) -> Callable:
    """The callable training binds for ``op`` served by ``kernel`` (``fla``, ``torch_npu`` or ``torch``), through the
    adapter ``fused_ops`` installs."""
    from patches.kernels import fused_kernels

    if kernel == "torch":
        return torch_ops()[op]
    loaded = fused_kernels.load(op, kernel)
    if op == "conv":
        return fused_kernels.FlaConv(loaded)
    if op == "rms_norm":
        return lambda x, w, eps, _k=loaded, _n=kernel: fused_kernels.rms_norm(_n, _k, x, w, eps)
    if op == "gated_norm":
        return lambda x, g, w, eps, _k=loaded: fused_kernels.gated_norm(_k, x, g, w, eps)
    return loaded


def select_glue_kernels(backend: str) -> tuple[dict[str, Callable], dict[str, str]]:
    """The callables training binds for each op on ``backend`` (adapters included), and their descriptions."""
    from patches import fused_ops
    from patches.kernels import fused_kernels

    choices = fused_kernels.select_kernels(
        backend,
        dict.fromkeys(fused_kernels.OPS, True),
        fused_ops.fla_usable(backend),
        backend == "npu" and fused_ops.npu_rms_norm_available(),
    )
    fused_kernels.tune_chosen_norms(backend, choices)  # as ``fused_ops`` tunes them for training
    chosen = {op: glue_kernel(op, choice.kernel) for op, choice in choices.items()}
    return chosen, {op: f"{c.kernel} ({c.reason})" for op, c in choices.items()}


def make_glue_inputs(torch, case: Case, seed: int = 0) -> dict[str, Any]:
    """bf16-rounded inputs on the CPU for ``case.op``; ``grad_out`` has the output's shape."""
    gen = torch.Generator().manual_seed(seed)
    b, t, h, d = case.shape

    def draw(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=gen) * scale + shift).to(torch.bfloat16)

    if case.op == "conv":
        width = h * d
        x = draw(b, t, width)
        return {"x": x, "weight": draw(width, 4, scale=0.5), "grad_out": draw(b, t, width)}
    if case.op == "rms_norm":
        return {"x": draw(b, t, h, d), "weight": draw(d, scale=0.1), "grad_out": draw(b, t, h, d)}
    if case.op == "gated_norm":
        rows = b * t * h
        return {
            "x": draw(rows, d),
            "gate": draw(rows, d),
            "weight": draw(d, scale=0.1, shift=1.0),
            "grad_out": draw(rows, d),
        }
    return {"gate": draw(b, t, h * d), "up": draw(b, t, h * d), "grad_out": draw(b, t, h * d)}


def packed_conv(torch, fn: Callable, x, weight, seq_lens: tuple[int, ...], *, reference: bool):
    """The convolution of samples packed end to end in one row, ``x`` ``[1, N, D]``, each as if it ran alone.

    The reference runs ``fn`` on each sample alone. The routed op is what ``packed_rows`` calls: FLA's adapter
    takes the samples' boundaries (``FlaConv.varlen``, ``cu_seqlens`` on the device and on the host); any other
    route is ``deltanet.segment_causal_conv`` (the row's torch convolution, then the first ``K - 1`` tokens of
    each sample again from that sample alone), whatever transformers' conv would be."""
    from patches.kernels import fused_kernels
    from patches.packing import deltanet, masks

    if reference:
        parts = x.split(list(seq_lens), dim=1)
        return torch.cat([fn(part.transpose(1, 2), weight, None, "silu").transpose(1, 2) for part in parts], dim=1)
    bounds = [0, *itertools.accumulate(seq_lens)]
    spans = tuple((0, start, end, True) for start, end in itertools.pairwise(bounds))
    found = masks.Segments(rows=1, length=x.shape[1], spans=spans, position=None)
    if isinstance(fn, fused_kernels.FlaConv):  # the boundaries as training hands them to FLA
        return fn.varlen(x, weight, None, "silu", *found.cu_seqlens_tensors(x.device))
    return deltanet.segment_causal_conv(x.transpose(1, 2), weight.unsqueeze(1), None, found).transpose(1, 2)


def run_glue(
    torch,
    op: str,
    fn: Callable,
    inputs: dict[str, Any],
    *,
    device: str,
    dtype,
    seq_lens: tuple[int, ...] | None = None,
    reference: bool = False,
):
    """Forward and backward of one op as the model calls it; returns the output and every input's gradient.
    ``seq_lens``: the conv over samples packed in one row (``packed_conv``)."""
    leaves = {
        n: x.to(device=device, dtype=dtype).detach().requires_grad_(True) for n, x in inputs.items() if n != "grad_out"
    }
    if op == "conv" and seq_lens:
        out = packed_conv(torch, fn, leaves["x"], leaves["weight"], seq_lens, reference=reference)
    elif op == "conv":  # the DeltaNet layer hands the conv the transpose of its [B, T, D] projection
        out = fn(leaves["x"].transpose(1, 2), leaves["weight"], None, "silu").transpose(1, 2)
    elif op == "rms_norm":
        out = fn(leaves["x"], leaves["weight"], EPS)
    elif op == "gated_norm":
        out = fn(leaves["x"], leaves["gate"], leaves["weight"], EPS)
    else:
        out = fn(leaves["gate"], leaves["up"])
    out.backward(inputs["grad_out"].to(device=device, dtype=out.dtype))
    return out.detach(), {n: leaf.grad for n, leaf in leaves.items()}


def _time(torch, case: Case, fn, inputs, dev: Device) -> float:
    times = []
    for i in range(TIMING_WARMUP + TIMING_REPEATS):
        dev.sync()
        start = time.perf_counter()
        run_glue(torch, case.op, fn, inputs, device=dev.name, dtype=torch.bfloat16, seq_lens=case.seq_lens)
        dev.sync()
        if i >= TIMING_WARMUP:
            times.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times), 3)


def check_glue_case(torch, case: Case, fn: Callable, dev: Device, threshold: float) -> CaseResult:
    """Run one glue case through ``run_case`` (never raises: an exception is a failed case)."""
    threshold = min(threshold, GLUE_THRESHOLD)

    def check(result: CaseResult) -> None:
        reference = torch_ops()[case.op]
        inputs = {n: x.to(dev.name) for n, x in make_glue_inputs(torch, case).items()}
        got = run_glue(torch, case.op, fn, inputs, device=dev.name, dtype=torch.bfloat16, seq_lens=case.seq_lens)
        with _FullPrecision(torch):
            ref = run_glue(
                torch,
                case.op,
                reference,
                inputs,
                device=dev.name,
                dtype=torch.float32,
                seq_lens=case.seq_lens,
                reference=True,
            )
        result.errors = {"out": rel_error(torch, got[0], ref[0])}
        result.errors.update({f"d{n}": rel_error(torch, got[1][n], ref[1][n]) for n in ref[1]})
        result.finite = all(x is not None and bool(torch.isfinite(x).all()) for x in (got[0], *got[1].values()))
        if case.timing:
            result.timing_ms = {"routed": _time(torch, case, fn, inputs, dev)}
            if fn is not reference:
                result.timing_ms["torch_ops"] = _time(torch, case, reference, inputs, dev)
        result.judge(threshold, case.about)

    return run_case(CaseResult(case.name, case.shape, None, "fail", cu_seqlens=case.cu_seqlens), check)
