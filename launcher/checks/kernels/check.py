"""Run the Gated DeltaNet kernel the job will use, tiny, forward and backward; print one JSON line.

    python -m launcher _kernel-check --backend cpu|cuda|npu     (an internal verb of the CLI)

Preflight runs this in a child process so that the supervisor itself never holds a device context
(which would keep HBM on device 0 for the whole run) and a kernel crash cannot take the supervisor down.

Which kernel: the one training will route to (``launcher.checks.kernels.validate.select_kernel``, the routing
patch's own decision from the backend and ``launcher.patches.deltanet_routing.kernel``): FLA's
``chunk_gated_delta_rule`` (on NPU through triton-ascend) or transformers' pure-torch
``torch_chunk_gated_delta_rule``. A refusal (FLA missing, FLA's Hopper guard, community triton on NPU)
is the check's answer.

The result is compared with ``reference_gated_delta_rule`` below, the step-by-step recurrence in float32
on the CPU (written here rather than taken from transformers, whose recurrent function newer releases
route to hub kernels), for the output and the gradients of q, k, v, g and beta.
T is not a multiple of the 64-token chunk, so padding is exercised too.
When that passes, the same kernel runs the quick suite of ``launcher validate-kernels``
(``launcher.checks.kernels.validate``: bf16 against the fp32 torch chunk reference, T != H, grouped heads, packed
sequences); ``--no-suite`` skips it.
"""

from __future__ import annotations

import time
from typing import Any

from launcher.checks.kernels.validate import select_kernel
from launcher.config.backend import device_name

SHAPE = (1, 96, 2, 64)  # [B, T, H, D]: FLA's layout
TOLERANCE = {"float32": 1e-3, "bfloat16": 3e-2}


def _inputs(torch, dtype, device, requires_grad: bool):
    gen = torch.Generator().manual_seed(0)
    b, t, h, d = SHAPE
    q = torch.randn(b, t, h, d, generator=gen)
    k = torch.randn(b, t, h, d, generator=gen)
    v = torch.randn(b, t, h, d, generator=gen)
    g = -torch.rand(b, t, h, generator=gen) * 0.5  # log decay, as Qwen3.5 produces (negative)
    beta = torch.rand(b, t, h, generator=gen).clamp(0.05, 0.95)
    out = [x.to(device=device, dtype=dtype) for x in (q, k, v, g, beta)]
    for x in out:
        x.requires_grad_(requires_grad)
    return out


def _run(kernel, tensors) -> tuple[Any, list[Any]]:
    q, k, v, g, beta = tensors
    out = kernel(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)
    out = out[0] if isinstance(out, tuple) else out
    out.float().pow(2).mean().backward()
    return out, [x.grad for x in tensors]


def reference_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel: bool = True, **_unused):
    """The gated delta rule, one token at a time, in float32; inputs and output in [B, T, H, D].

    For each head: S <- S * exp(g_t); S <- S + beta_t * k_t (v_t - S^T k_t)^T; o_t = S^T (q_t / sqrt(D_k)),
    with q and k L2-normalised first when ``use_qk_l2norm_in_kernel`` (as Qwen3.5 calls it).
    """
    import torch

    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q, k, v, g, beta = (x.float().transpose(1, 2) for x in (q, k, v, g, beta))  # [B, H, T, ...]
    q = q * q.shape[-1] ** -0.5
    state = q.new_zeros(*q.shape[:2], q.shape[-1], v.shape[-1])
    outs = []
    for t in range(q.shape[2]):
        state = state * g[:, :, t].exp()[..., None, None]
        k_t = k[:, :, t]
        delta = (v[:, :, t] - (state * k_t[..., None]).sum(-2)) * beta[:, :, t, None]
        state = state + k_t[..., None] * delta[..., None, :]
        outs.append((state * q[:, :, t, :, None]).sum(-2))
    return torch.stack(outs, dim=2).transpose(1, 2)


def _rel_err(torch, got, ref) -> float:
    got, ref = got.detach().float().cpu(), ref.detach()
    return float(torch.linalg.vector_norm(got - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-12))


def _quick_suite(
    backend: str, kernel_fn, name: str, glue_ops: tuple[str, ...] = (), glue_only: bool = False
) -> dict[str, Any]:
    """``launcher validate-kernels --suite quick`` on the same kernel (``launcher.kernels``): bf16 against the
    fp32 torch reference with T != H, grouped heads and packed sequences (skipped for kernels without
    ``cu_seqlens``), and the glue cases of the ops in ``glue_ops`` (those the run's ``fused_ops`` binds: an op
    the config turned off is not checked, so a broken kernel can be worked around)."""
    from launcher.checks.kernels.validate import SUITES, validate

    ops = {c.name: c.op for c in SUITES["quick"] if (c.op is None and not glue_only) or c.op in glue_ops}
    report = validate(backend, suite="quick", kernel_fn=kernel_fn, kernel_name=name, cases=tuple(ops))
    cases = {c.name: c.status if c.max_error is None else f"{c.status} {c.max_error:.1e}" for c in report.cases}
    found: dict[str, Any] = {"validate_kernels": {"ok": report.ok, "cases": cases, "error": report.error}}
    if not report.ok:
        failed = [
            f"{c.name}: {c.note}"
            + (
                f" (the run can do without this kernel: launcher.patches.fused_ops.{ops[c.name]}: false)"
                if ops.get(c.name)
                else ""
            )
            for c in report.cases
            if c.status == "fail"
        ] or [str(report.error)]
        found.update(ok=False, error=f"launcher validate-kernels --suite quick failed: {'; '.join(failed)}")
    return found


def choose_kernels(backend: str, glue_ops: tuple[str, ...], shapes: dict[str, int]) -> dict[str, Any]:
    """``launcher.checks.kernels.choice`` for the components the run binds (the convolution and the gated norm only
    where ``fused_ops`` leaves them on); returns its record."""
    from launcher.checks.kernels import choice as kernel_choice

    candidates = {c: opts for c, opts in kernel_choice.npu_candidates().items() if c == "chunk" or c in glue_ops}
    choice = kernel_choice.choose(backend, candidates, kernel_choice.run_cases(shapes), device_name(backend), shapes)
    return choice.to_dict()


def chosen_chunk(record: dict[str, Any]):
    """The chunk kernel a ``kernel_choice`` record chose, loaded, and its description (None when none passed)."""
    from launcher.checks.kernels import choice as kernel_choice

    chunk = record["components"]["chunk"]
    for name, loader in kernel_choice.npu_candidates()["chunk"]:
        if name == chunk["chosen"]:
            return loader()
    return None


def _choose_then_check(backend: str, glue_ops: tuple[str, ...], shapes: dict[str, int] | None) -> dict[str, Any]:
    """The kernel choice, then the quick suite's cases of the glue ops the choice does not cover (rms_norm, swiglu)
    with their routed kernels. The choice's own cases replace the fixed-shape check above: they run at the run's
    head size, the only one some kernels take."""
    from launcher.checks.kernels.choice import run_shapes

    record = choose_kernels(backend, glue_ops, shapes or run_shapes(None, 4096))
    found: dict[str, Any] = {"kernel_choice": record, "ok": False}
    missing = [name for name, c in record["components"].items() if c["chosen"] is None]
    if missing:
        found["error"] = f"no kernel passed its validation cases on this device for: {', '.join(missing)}"
        return found
    kernel_fn, name = chosen_chunk(record)
    found.update(kernel=name, device=device_name(backend), dtype="bfloat16", ok=True)
    rest = tuple(op for op in glue_ops if op not in record["components"])
    if rest:
        found.update(_quick_suite(backend, kernel_fn, name, rest, glue_only=True))
    return found


def check(
    backend: str,
    kernel: str = "auto",
    suite: bool = True,
    glue_ops: tuple[str, ...] = ("conv", "rms_norm", "gated_norm", "swiglu"),
    shapes: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Run the kernel once, then (``suite``) the quick validation suite; return a JSON-able result with
    ``ok`` and the measured errors. On NPU with ``kernel: auto``, first choose the kernels (``choose_kernels`` at
    ``shapes``, the 27B model's when not given)."""
    started = time.monotonic()
    result: dict[str, Any] = {"backend": backend, "shape": list(SHAPE), "ok": False}
    try:
        import torch

        device = device_name(backend)
        dtype = torch.float32 if backend == "cpu" else torch.bfloat16
        if backend == "npu" and kernel == "auto":
            result.update(_choose_then_check(backend, glue_ops, shapes))
            result["seconds"] = round(time.monotonic() - started, 2)
            return result
        kernel_fn, name = select_kernel(backend, kernel)
        result.update(kernel=name, device=device, dtype=str(dtype).removeprefix("torch."))

        ref_out, ref_grads = _run(reference_gated_delta_rule, _inputs(torch, torch.float32, "cpu", True))
        out, grads = _run(kernel_fn, _inputs(torch, dtype, device, True))
        if any(x is None for x in grads):
            raise RuntimeError("the kernel produced no gradient for some input")
        finite = bool(torch.isfinite(out).all()) and all(bool(torch.isfinite(x).all()) for x in grads)
        fwd = _rel_err(torch, out, ref_out)
        bwd = max(_rel_err(torch, x, r) for x, r in zip(grads, ref_grads, strict=True))
        limit = TOLERANCE[result["dtype"]]
        result.update(finite=finite, fwd_rel_err=round(fwd, 6), grad_rel_err=round(bwd, 6), tolerance=limit)
        result["ok"] = finite and fwd <= limit and bwd <= limit
        if not result["ok"]:
            result["error"] = "non-finite values" if not finite else "result differs from the torch reference"
        elif suite:
            result.update(_quick_suite(backend, kernel_fn, name, glue_ops))
    except Exception as err:  # any failure is the answer; the parent prints it in the table
        result["error"] = f"{type(err).__name__}: {err}"
    result["seconds"] = round(time.monotonic() - started, 2)
    return result
