"""The decoding case of ``launcher validate-kernels``: the routed recurrent kernel against a float32 reference.

Generation runs the Gated DeltaNet layers twice over: the prompt through the chunk kernel (checked by the other
cases of ``launcher.checks.kernels.validate``), then every new token through ``recurrent_gated_delta_rule`` with the
state the previous step left in the cache (``Qwen3_5GatedDeltaNet.forward``, transformers 5.6.0, when
``cache_params`` has a previous state and ``seq_len == 1``). The routing patch binds FLA's
``fused_recurrent_gated_delta_rule`` there on NPU and CUDA, transformers' ``torch_recurrent_gated_delta_rule``
on CPU or with ``kernel: torch`` (``patches.deltanet_routing.select_route``).

How a decode case is checked: a prompt of ``prefill`` tokens gives the starting state (transformers' torch
chunk kernel in float32, as the prompt's pass would leave it in the cache); then ``seq_len`` single-token
steps, each fed the state the previous step returned, with inputs drawn as for the chunk cases (bf16 q, k, v,
beta; float32 g; ``use_qk_l2norm_in_kernel=True``; q and k interleaved from the key heads). The routed kernel
runs in bfloat16 with the state in float32 (what the cache holds); the reference is transformers' torch
recurrent kernel in float32 on the same rounded values. Reported: the relative L2 error of the outputs of all
steps (``out``) and of the final state (``state``); forward only, since generation computes no gradient. A
``timing`` case adds the median milliseconds per decoded token, routed vs the torch fallback.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from launcher.checks.kernels.cases import Case, CaseResult, Device, _FullPrecision, make_inputs, rel_error, run_case


def select_decode_kernel(backend: str, kernel: str) -> tuple[Callable, str]:
    """The recurrent kernel generation will route to on ``backend``, and its description.

    Raises:
        PatchError: the route is refused (as for the chunk kernel; the message carries the fix).
    """
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    from patches.deltanet_routing import load_fla_kernels, select_route
    from patches.kernels.fla_probe import probe_fla

    route = select_route(backend, kernel, probe_fla(backend))
    if route.recurrent == "torch":
        return torch_recurrent_gated_delta_rule, f"transformers torch_recurrent_gated_delta_rule ({route.reason})"
    return load_fla_kernels().fused_recurrent, f"fla fused_recurrent_gated_delta_rule ({route.reason})"


def torch_decode_reference() -> Callable:
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    return torch_recurrent_gated_delta_rule


def _interleave(case: Case, x):
    if case.key_heads and case.key_heads != case.heads:  # as Qwen3_5GatedDeltaNet.forward feeds the kernel
        return x.repeat_interleave(case.heads // case.key_heads, dim=2)
    return x


def starting_state(torch, case: Case, device: str):
    """The float32 state a prompt of ``case.prefill`` tokens leaves behind (torch chunk kernel, float32)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    prompt = Case(case.name, case.batch, case.prefill, case.heads, case.dim, case.key_heads)
    x = {n: t.to(device=device, dtype=torch.float32) for n, t in make_inputs(torch, prompt, seed=1).items()}
    with torch.no_grad(), _FullPrecision(torch):
        _, state = torch_chunk_gated_delta_rule(
            _interleave(case, x["q"]),
            _interleave(case, x["k"]),
            x["v"],
            g=x["g"],
            beta=x["beta"],
            initial_state=None,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
    return state.float()


def run_decode(torch, kernel: Callable, inputs: dict[str, Any], state, case: Case, *, dtype) -> tuple[Any, Any]:
    """``case.seq_len`` one-token steps of ``kernel`` from ``state``; returns all outputs and the last state."""
    outs = []
    with torch.no_grad():
        for t in range(case.seq_len):
            step = {n: x[:, t : t + 1] for n, x in inputs.items()}
            q, k = (_interleave(case, step[n].to(dtype)) for n in ("q", "k"))
            out, state = kernel(
                q,
                k,
                step["v"].to(dtype),
                g=step["g"].float(),
                beta=step["beta"].to(dtype),
                initial_state=state,
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )
            outs.append(out)
    return torch.cat(outs, dim=1), state


def time_decode(torch, kernel: Callable, inputs, state, case: Case, dev: Device, repeats: int = 5) -> float:
    """Median milliseconds per decoded token (synchronised wall clock over all steps, after one warm-up)."""
    times = []
    for i in range(repeats + 1):
        dev.sync()
        start = time.perf_counter()
        run_decode(torch, kernel, inputs, state, case, dtype=torch.bfloat16)
        dev.sync()
        if i:
            times.append((time.perf_counter() - start) * 1e3 / case.seq_len)
    return round(statistics.median(times), 4)


def check_decode_case(
    torch, case: Case, kernel: Callable | None, dev: Device, threshold: float, fallback: Callable | None = None
) -> CaseResult:
    """Run one decode case through ``run_case`` (never raises: an exception is a failed case)."""

    def check(result: CaseResult) -> None:
        if kernel is None:
            result.status = "skip"
            result.note = "no recurrent kernel given (a caller that checks the training kernel only)"
            return
        inputs = {n: x.to(dev.name) for n, x in make_inputs(torch, case).items() if n != "grad_out"}
        state = starting_state(torch, case, dev.name)
        got_out, got_state = run_decode(torch, kernel, inputs, state.clone(), case, dtype=torch.bfloat16)
        with _FullPrecision(torch):
            ref_out, ref_state = run_decode(
                torch, torch_decode_reference(), inputs, state.clone(), case, dtype=torch.float32
            )
        result.errors = {"out": rel_error(torch, got_out, ref_out), "state": rel_error(torch, got_state, ref_state)}
        result.finite = bool(torch.isfinite(got_out).all()) and bool(torch.isfinite(got_state).all())
        if case.timing:
            result.timing_ms = {"routed_per_token": time_decode(torch, kernel, inputs, state, case, dev)}
            if fallback is not None and fallback is not kernel:
                result.timing_ms["torch_per_token"] = time_decode(torch, fallback, inputs, state, case, dev)
        result.judge(
            threshold,
            f"final state within {result.errors['state']:.2%}; {case.about}",
            non_finite="non-finite output or state",
        )

    return run_case(CaseResult(case.name, case.shape, case.key_heads, "fail"), check)
