"""Kernel numerics: the routed Gated DeltaNet chunk (and decoding) kernels against a float32 reference.

    launcher validate-kernels [--device auto|npu|cuda|cpu] [--suite quick|full] [--json PATH]

(the command's arguments, table and JSON are in ``launcher.kernels_cli``; the checks are here)

Which kernel: the one training routes to (``patches.deltanet_routing.select_route``, through
``launcher.checks.kernels.check``): FLA's ``chunk_gated_delta_rule`` on NPU (triton-ascend) and CUDA, transformers'
``torch_chunk_gated_delta_rule`` on CPU or with ``--kernel torch``. A routing refusal (FLA missing, FLA's
Hopper guard) is reported as the answer; this command never lifts FLA's guard.

How each case is checked:

- inputs are drawn as the model makes them (``Qwen3_5GatedDeltaNet.forward``, transformers 5.6.0): q and k
  in ``[B, T, H_k, D]``, ``repeat_interleave``-d to the value heads ``H_v`` when the case is grouped; v in
  ``[B, T, H_v, D]``; ``g = -exp(A_log) * softplus(a + dt_bias)`` in float32 (negative), with A spread
  geometrically over [1e-3, 16] across the heads (the model initialises A uniformly in [0, 16]) so some heads
  carry state across many chunks and others forget within a few tokens; ``beta = sigmoid(b)``; the kernel
  is called with ``use_qk_l2norm_in_kernel=True``. Everything except g is rounded to bfloat16 once.
- the routed kernel runs on the device in bfloat16 (g in float32, as the model passes it), forward and
  backward against a fixed random output gradient; the reference is transformers' torch chunk
  implementation run in float32 on the same bfloat16-rounded values (on the same device, float32 matmuls at
  full precision). Reported: relative L2 error ``|x - ref| / |ref|`` of the output and of the gradients of
  q, k, v, g and beta (for grouped cases, of the ``H_k``-head q and k the model owns). PASS when every
  value is finite and every error is under the threshold (default 5 %).
- T != H in every case, so a kernel that reads the layout as ``[B, H, T, D]`` cannot pass.
- ``varlen`` packs several sequences into one row with ``cu_seqlens`` (as LLaMA-Factory's packing does) and
  compares the packed call with the same kernel run on each sequence alone, and with the reference run on
  each sequence alone; a kernel that leaks state across sequences fails. transformers' torch kernel has no
  ``cu_seqlens``, so on CPU (and with ``--kernel torch``) this case is skipped with that reason: packed
  training never routes to the torch kernel. ``varlen_grouped`` is the same packed call with q and k handed to the
  routed kernel unrepeated (``H_k`` heads for ``H_v`` value heads), as packed rows call FLA
  (``patches.packing.deltanet.value_heads``), against the reference fed the repeated heads: a kernel that pairs value
  head ``j`` with any key head but ``j // (H_v / H_k)`` fails. Its runs of each sequence alone are the call a packed
  row of one sample makes (unrepeated, no ``cu_seqlens``: ``patches.packing.masks.Segments.state_bounds``).
- ``qwen3_5_27b`` is the 27B model's linear-attention call, [1, 4096, 48, 128] fed from 16 key heads; it also
  reports peak device memory of the routed forward+backward and the median time of the routed kernel
  against the torch fallback (forward+backward, bfloat16, the same inputs).

- the glue cases (``conv``, ``rms_norm``, ``gated_norm``, ``swiglu`` and their ``_27b`` shapes) check the fused
  kernels the ``fused_ops`` patch binds, forward and every gradient, against fp32 (``launcher.checks.kernels.glue``;
  threshold 1 %).

- ``decode`` checks the recurrent kernel that generation calls once per new token (FLA's
  ``fused_recurrent_gated_delta_rule`` on NPU and CUDA, transformers' torch loop on CPU), step by step from a
  prompt's state, against the fp32 torch recurrence: outputs and final state (``launcher.checks.kernels.decode``).

On CPU the "routed" kernel *is* the torch reference, run in bfloat16: the errors are then bfloat16 rounding
only, small but not zero, so the comparison is live (``tests/checks/test_validate_kernels.py`` shows broken
kernels fail). The ``quick`` suite (small shapes) is the CPU default and what preflight runs; ``full`` is the
default on accelerators.
"""

from __future__ import annotations

import inspect
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from launcher.checks.kernels import decode as decode_kernels
from launcher.checks.kernels import glue as glue_kernels
from launcher.checks.kernels.cases import Case, CaseResult, Device, _FullPrecision, make_inputs, rel_error, run_case
from launcher.config.backend import device_name

__all__ = [
    "Case",
    "CaseResult",
    "Device",
    "Report",
    "case_progress",
    "check_case",
    "make_inputs",
    "rel_error",
    "select_cases",
    "validate",
]
DEFAULT_THRESHOLD = 0.05
GRAD_NAMES = ("q", "k", "v", "g", "beta")
TIMING_WARMUP, TIMING_REPEATS = 3, 10


def _varlen(
    name: str, lens: tuple[int, ...], heads: int, dim: int, key_heads: int | None = None, unrepeated: bool = False
) -> Case:
    about = f"{len(lens)} sequences packed with cu_seqlens vs each alone"
    if unrepeated:
        about += f", {key_heads} key heads given unrepeated for {heads} value heads (as packed rows call FLA)"
    return Case(name, 1, sum(lens), heads, dim, key_heads, seq_lens=lens, about=about, unrepeated=unrepeated)


MODEL_CASE = Case(
    "qwen3_5_27b",
    1,
    4096,
    48,
    128,
    key_heads=16,
    timing=True,
    memory=True,
    about="the 27B model's DeltaNet call (16 key heads -> 48 value heads)",
)
DECODE_CASE = Case(
    "decode",
    1,
    64,
    48,
    128,
    key_heads=16,
    prefill=512,
    timing=True,
    about="the 27B model's decoding call: 64 one-token steps after a 512-token prompt",
)


def glue_cases(quick: bool) -> tuple[Case, ...]:
    """The fused glue ops (``glue``): small shapes with T != D and batch 2, or the 27B model's shapes
    (conv over 2 x 16 x 128 + 48 x 128 channels, the hidden norm of 5120 and the 24-head q norm of 256, the
    gated norm of the 48 value heads of 128, SwiGLU over the MLP's 17408)."""
    if quick:
        return (
            Case("conv", 2, 150, 3, 32, op="conv", about="batch 2, T=150 != D=96"),
            Case(
                "conv_varlen",
                1,
                200,
                3,
                32,
                seq_lens=(45, 85, 70),
                op="conv",
                about="3 samples packed in one row, each convolved alone",
            ),
            Case("rms_norm", 2, 40, 3, 32, op="rms_norm", about="zero-centred weight, over the last dim"),
            Case("gated_norm", 1, 40, 4, 32, op="gated_norm", about="x_hat * w * silu(gate)"),
            Case("swiglu", 2, 40, 1, 96, op="swiglu", about="silu(gate) * up"),
        )
    return (
        Case("conv_27b", 1, 4096, 80, 128, op="conv", timing=True, about="the DeltaNet short convolution"),
        Case(
            "conv_varlen_27b",
            1,
            4096,
            80,
            128,
            seq_lens=(700, 1100, 1300, 996),
            op="conv",
            about="4 samples packed in one row, each convolved alone (packed rows)",
        ),
        Case("rms_norm_27b", 1, 4096, 1, 5120, op="rms_norm", timing=True, about="the decoder layers' norm"),
        Case("q_norm_27b", 1, 4096, 24, 256, op="rms_norm", about="the attention's q norm per head"),
        Case("gated_norm_27b", 1, 4096, 48, 128, op="gated_norm", timing=True, about="the DeltaNet output norm"),
        Case("swiglu_27b", 1, 4096, 1, 17408, op="swiglu", timing=True, about="the MLP's silu(gate) * up"),
    )


SUITES: dict[str, tuple[Case, ...]] = {
    # one head count and dim per suite: FLA's Triton kernels compile per (heads, dim), which costs minutes
    "quick": (
        Case("layout", 2, 150, 4, 32, about="batch 2, T=150 != H=4, T not a multiple of the 64-token chunk"),
        Case("grouped", 1, 128, 4, 32, key_heads=2, about="q, k repeat_interleave-d from 2 to 4 heads"),
        _varlen("varlen", (45, 85, 70), 4, 32),
        _varlen("varlen_grouped", (45, 85, 70), 4, 32, key_heads=2, unrepeated=True),
        Case("decode", 2, 24, 4, 32, key_heads=2, prefill=40, about="24 one-token steps after a 40-token prompt"),
        *glue_cases(quick=True),
    ),
    "full": (
        # the model's 48 heads of dim 128 throughout, so the suite also shares its compile with training
        Case("layout", 2, 1000, 48, 128, about="batch 2, T=1000 != H=48, T not a multiple of the 64-token chunk"),
        Case("grouped", 1, 2048, 48, 128, key_heads=16, about="q, k repeat_interleave-d from 16 to 48 heads"),
        _varlen("varlen", (700, 1100, 1300, 996), 48, 128, key_heads=16),
        _varlen("varlen_grouped", (700, 1100, 1300, 996), 48, 128, key_heads=16, unrepeated=True),
        MODEL_CASE,
        DECODE_CASE,
        *glue_cases(quick=False),
    ),
}


@dataclass
class Report:
    device: str
    backend: str
    kernel: str
    threshold: float
    suite: str
    decode_kernel: str = ""
    glue_kernels: dict[str, str] = field(default_factory=dict)
    cases: list[CaseResult] = field(default_factory=list)
    error: str | None = None
    environment: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.cases) and all(c.status != "fail" for c in self.cases)

    def to_dict(self) -> dict[str, Any]:
        cases = [{**asdict(c), "max_error": c.max_error} for c in self.cases]
        return {"ok": self.ok, **asdict(self), "cases": cases}


# --- inputs, runs and errors ------------------------------------------------------------------------


def run_kernel(
    torch,
    kernel: Callable,
    inputs: dict[str, Any],
    case: Case,
    *,
    device: str,
    dtype,
    cu_seqlens: list[int] | None = None,
    repeat: bool = True,
) -> tuple[Any, dict[str, Any]]:
    """Forward and backward of ``kernel`` as the model calls it; returns the output and the input gradients.

    ``dtype`` applies to q, k, v, beta and the output gradient; g stays float32 (the model computes it so).
    ``repeat``: grouped key heads are repeated for the value heads before the call (transformers' forward);
    false hands them over as they are (a kernel that pairs them itself). The gradients are the key heads' either way.
    """
    leaves = {}
    for name in GRAD_NAMES:
        x = inputs[name].to(device=device, dtype=torch.float32 if name == "g" else dtype)
        leaves[name] = x.detach().requires_grad_(True)
    q, k = leaves["q"], leaves["k"]
    if repeat and case.key_heads and case.key_heads != case.heads:  # as Qwen3_5GatedDeltaNet.forward feeds it
        q = q.repeat_interleave(case.heads // case.key_heads, dim=2)
        k = k.repeat_interleave(case.heads // case.key_heads, dim=2)
    extra = {}
    if cu_seqlens is not None:
        extra["cu_seqlens"] = torch.tensor(cu_seqlens, dtype=torch.long, device=device)
    out = kernel(
        q,
        k,
        leaves["v"],
        g=leaves["g"],
        beta=leaves["beta"],
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=True,
        **extra,
    )
    out = out[0] if isinstance(out, tuple) else out
    out.backward(inputs["grad_out"].to(device=device, dtype=out.dtype))
    return out.detach(), {name: leaves[name].grad for name in GRAD_NAMES}


def compare(torch, got: tuple[Any, dict[str, Any]], ref: tuple[Any, dict[str, Any]]) -> dict[str, float]:
    out, grads = got
    ref_out, ref_grads = ref
    errors = {"out": rel_error(torch, out, ref_out)}
    errors.update({f"d{n}": rel_error(torch, grads[n], ref_grads[n]) for n in GRAD_NAMES})
    return errors


def _split_run(torch, kernel, inputs, case: Case, **kw) -> tuple[Any, dict[str, Any]]:
    """Run each packed sequence of a varlen case alone and stitch outputs and gradients back together."""
    outs, grads = [], {n: [] for n in GRAD_NAMES}
    bounds = case.cu_seqlens
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        part = {n: x[:, start:end] for n, x in inputs.items()}
        sub = Case(case.name, 1, end - start, case.heads, case.dim, case.key_heads)
        out, g = run_kernel(torch, kernel, part, sub, **kw)
        outs.append(out)
        for n in GRAD_NAMES:
            grads[n].append(g[n])
    return torch.cat(outs, dim=1), {n: torch.cat(parts, dim=1) for n, parts in grads.items()}


def accepts_cu_seqlens(kernel: Callable) -> bool:
    try:
        return "cu_seqlens" in inspect.signature(kernel).parameters
    except (TypeError, ValueError):
        return False


def time_fwd_bwd(torch, kernel, inputs, case: Case, dev: Device, dtype) -> float:
    """Median milliseconds of one forward+backward (synchronised wall clock, after warm-up calls)."""
    times = []
    for i in range(TIMING_WARMUP + TIMING_REPEATS):
        dev.sync()
        start = time.perf_counter()
        run_kernel(torch, kernel, inputs, case, device=dev.name, dtype=dtype)
        dev.sync()
        if i >= TIMING_WARMUP:
            times.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times), 3)


def check_case(
    torch,
    case: Case,
    kernel: Callable,
    reference: Callable,
    dev: Device,
    threshold: float,
    fallback: Callable | None = None,
) -> CaseResult:
    """Run one case through ``run_case`` (never raises: an exception is a failed case)."""

    def check(result: CaseResult) -> None:
        if case.seq_lens is not None and not accepts_cu_seqlens(kernel):
            result.status = "skip"
            result.note = (
                "the routed kernel takes no cu_seqlens (transformers' torch chunk kernel); packed training "
                "never routes there (LLaMA-Factory's packing calls FLA's varlen kernels)"
            )
            return
        # on the device once, so that timings hold no host-to-device copies
        inputs = {n: x.to(dev.name) for n, x in make_inputs(torch, case).items()}
        kw = {"device": dev.name}
        dev.reset_peak()
        routed = {**kw, "repeat": not case.unrepeated}
        got = run_kernel(torch, kernel, inputs, case, dtype=torch.bfloat16, cu_seqlens=case.cu_seqlens, **routed)
        if case.memory:
            result.peak_memory_gib = dev.peak_gib()
        with _FullPrecision(torch):
            if case.seq_lens is None:
                ref = run_kernel(torch, reference, inputs, case, dtype=torch.float32, **kw)
            else:
                ref = _split_run(torch, reference, inputs, case, dtype=torch.float32, **kw)
        result.errors = compare(torch, got, ref)
        if case.seq_lens is not None:
            alone = _split_run(torch, kernel, inputs, case, dtype=torch.bfloat16, **routed)
            result.errors_vs_alone = compare(torch, got, alone)
        out, grads = got
        result.finite = bool(torch.isfinite(out).all()) and all(
            x is not None and bool(torch.isfinite(x).all()) for x in grads.values()
        )
        del got, ref
        if case.timing:
            result.timing_ms = {"routed": time_fwd_bwd(torch, kernel, inputs, case, dev, torch.bfloat16)}
            if fallback is not None and fallback is not kernel:
                result.timing_ms["torch_fallback"] = time_fwd_bwd(torch, fallback, inputs, case, dev, torch.bfloat16)
        result.judge(threshold, case.about)

    return run_case(CaseResult(case.name, case.shape, case.key_heads, "fail", cu_seqlens=case.cu_seqlens), check)


# --- the suite ----------------------------------------------------------------------------------------


def select_kernel(backend: str, kernel: str):
    """The kernel training will route to on ``backend`` and its description.

    The routing patch decides (``patches.deltanet_routing.select_route``) from the backend and the config's
    ``launcher.patches.deltanet_routing.kernel``, exactly as it will before the model is built; a refusal
    (FLA missing, FLA's Hopper guard, community triton on NPU) raises ``PatchError`` with the fix.
    """
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    from patches.deltanet_routing import load_fla_kernels, select_route
    from patches.kernels.fla_probe import probe_fla

    route = select_route(backend, kernel, probe_fla(backend))  # PatchError carries the reason and the fix
    if route.kernel == "torch":
        return torch_chunk_gated_delta_rule, f"transformers torch_chunk_gated_delta_rule ({route.reason})"
    return load_fla_kernels().chunk, f"fla chunk_gated_delta_rule ({route.reason})"


def resolve_backend(device: str) -> str:
    if device != "auto":
        return device
    from launcher.config.backend import resolve

    return resolve("auto").name


def torch_reference() -> Callable:
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    return torch_chunk_gated_delta_rule


def environment(torch, dev: Device) -> dict[str, Any]:
    from importlib import metadata

    versions = {}
    for dist in ("torch", "transformers", "fla-core", "triton", "triton-ascend", "torch-npu"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    env: dict[str, Any] = {"versions": versions, "python": sys.version.split()[0]}
    if dev.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(dev.name)
    chunk_o = sys.modules.get("fla.ops.common.chunk_o")  # FLA's Hopper guard flags, read only (see fla_probe)
    if chunk_o is not None:
        names = ("IS_NVIDIA_HOPPER", "TRITON_ABOVE_3_4_0", "TRITON_ABOVE_3_7_1")
        env["fla_hopper_guard_flags"] = {n: getattr(chunk_o, n, None) for n in names}
    return env


def select_cases(suite: str, cases: tuple[str, ...] | None = None) -> list[Case]:
    """The cases of ``suite`` that ``validate`` runs: all, or those named in ``cases``, in the suite's order."""
    return [c for c in SUITES[suite] if not cases or c.name in cases]


def case_progress(total: int, file=None):
    """``validate``'s ``on_case``: a line as each case starts and ends (on a cold Triton cache a case at the model's
    shapes compiles for minutes; the line says which one)."""
    done = []

    def on_case(name: str, result) -> None:
        if result is None:
            line = f"[{len(done) + 1}/{total}] {name} ..."
        else:
            done.append(name)
            line = f"[{len(done)}/{total}] {name}: {result.status} in {result.seconds:g} s"
        print(f"validate-kernels: {line}", file=file or sys.stderr, flush=True)

    return on_case


def validate(
    backend: str,
    *,
    kernel: str = "auto",
    suite: str = "quick",
    threshold: float = DEFAULT_THRESHOLD,
    cases: tuple[str, ...] | None = None,
    kernel_fn: Callable | None = None,
    kernel_name: str | None = None,
    decode_fn: Callable | None = None,
    glue_fns: dict[str, Callable] | None = None,
    on_case: Callable[[str, CaseResult | None], None] | None = None,
) -> Report:
    """Run a suite against the kernels routed for ``backend`` (or ``kernel_fn``/``decode_fn``, for tests).

    The ``decode`` case checks the recurrent kernel generation routes to (``launcher.checks.kernels.decode``);
    it is skipped, with that reason, when ``kernel_fn`` is given without ``decode_fn``.

    Args:
        backend: npu, cuda or cpu.
        kernel: the config's ``launcher.patches.deltanet_routing.kernel`` (auto, fla, torch).
        suite: ``quick`` (small shapes) or ``full`` (model shapes).
        threshold: largest relative L2 error that passes.
        cases: run only these case names of the suite.
        on_case: called with a case's name as it starts (and None), then with its result as it ends: progress, so
            that a suite that runs for minutes (compiles on a cold Triton cache) shows which case it is in.

    Returns:
        The report; ``report.error`` is set (and no case runs) when no kernel can be routed here.
    """
    report = Report(device=backend, backend=backend, kernel=kernel_name or "", threshold=threshold, suite=suite)
    unknown = sorted(set(cases or ()) - {c.name for c in SUITES[suite]})
    if unknown:
        names = ", ".join(c.name for c in SUITES[suite])
        report.error = f"unknown case(s) {', '.join(unknown)} in suite {suite}; its cases are {names}"
        return report
    try:
        import torch

        dev = Device(torch, device_name(backend))
        report.device = dev.name
        if kernel_fn is None:
            kernel_fn, report.kernel = select_kernel(backend, kernel)
            decode_fn, report.decode_kernel = decode_kernels.select_decode_kernel(backend, kernel)
        reference = torch_reference()
        report.environment = environment(torch, dev)
    except Exception as err:  # a refused route (PatchError) carries its reason and the fix
        report.error = f"{type(err).__name__}: {err}"
        return report
    selected = select_cases(suite, cases)
    if any(c.op for c in selected) and glue_fns is None:
        try:
            glue_fns, report.glue_kernels = glue_kernels.select_glue_kernels(backend)
        except Exception as err:  # FLA that does not import on an accelerator: reported, not raised
            report.error = f"{type(err).__name__}: {err}"
            return report
    for case in selected:
        if on_case is not None:
            on_case(case.name, None)
        if case.op is not None:
            result = glue_kernels.check_glue_case(torch, case, glue_fns[case.op], dev, threshold)
        elif case.prefill is not None:
            fallback = decode_kernels.torch_decode_reference()
            result = decode_kernels.check_decode_case(torch, case, decode_fn, dev, threshold, fallback)
        else:
            result = check_case(torch, case, kernel_fn, reference, dev, threshold, fallback=reference)
        report.cases.append(result)
        if on_case is not None:
            on_case(case.name, result)
    return report
