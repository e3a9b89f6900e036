"""Which fused kernel serves each glue op of a Qwen3.5 layer, and the adapters that call it.

Pure selection (``select_kernels``) plus thin adapters from transformers' call shapes to the kernels' own.
The kernels, as read in fla-core 0.6.0 (each dispatches to its triton-ascend variant on an NPU through FLA's
backend registry, ``fla.backends``) and torch_npu:

==========  ====================================================  ==========================================
op          kernel                                                call shape
==========  ====================================================  ==========================================
conv        ``fla.modules.causal_conv1d.causal_conv1d``           x ``[B, T, D]``, weight ``[D, W]``, optional
                                                                  ``cu_seqlens``; returns ``(y, final_state)``
rms_norm    ``fla.modules.norm.layernorm.rms_norm`` (CUDA),       ``(x, weight, bias, eps=)``; fp32 inside,
            ``torch_npu.npu_rms_norm`` (NPU)                      output in x's dtype / ``(x, gamma, epsilon=)``
gated_norm  ``fla.modules.norm.fused_norm_gate.rms_norm_gated``   ``(x, g, weight, bias, activation, eps=)``
swiglu      ``fla.modules.activations.swiglu``                    ``(gate, up)`` -> ``silu(gate) * up``
==========  ====================================================  ==========================================

Why torch_npu for the plain RMSNorm on NPU: ``npu_rms_norm`` is an AscendC kernel with its own backward,
what Ascend's MindSpeed recipes use for Qwen models; it needs no Triton compile at a new length, and the
triton-ascend norm is a port of a GPU kernel. Its gamma is passed in the input's dtype (the documented pairing);
rounding ``1 + w`` to bf16 costs at most 2^-9 relative per element, under the bf16 rounding of the output
itself. Where ``npu_rms_norm`` is missing, FLA's kernel serves. ``torch_npu.npu_swiglu`` is not used: it takes
gate and up concatenated in one tensor, and transformers computes them in two projections, so calling it
would add a copy of both. The gated norm has no torch_npu counterpart; FLA's runs on triton-ascend, and it is
called as a function, so nothing calls ``torch.cuda.current_device()`` (FLA's ``FusedRMSNormGated`` module
does in transformers' constructor, which is why the routing never builds it).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

OPS = ("conv", "rms_norm", "gated_norm", "swiglu")
# fla-core 0.6.0's CUDA norms of 512 channels or fewer (``fla/modules/norm/layernorm.py``: the attention's q and k
# norms, head_dim 256; ``fused_norm_gate.py``: the gated norm, 128) run kernels that take ``NB``, a bucket of rows
# (``cdiv(rows, 2048)``, for the gated norm ``cdiv(rows, 65536)``), as a compile-time constant and as an autotune key,
# and use it nowhere in their bodies: every new bucket compiles and benchmarks each configuration again (9 or 6
# for the layer norm). Rows are tokens x heads, so the q norm met a new bucket every 85 tokens of length: a packed
# run on one H100 lost 16 to 37 s at each new length (docs/lab/2026-12-07-cut-rows-new-lengths.md).
# ``tune_by_width`` takes ``NB`` out of these keys: a kernel is tuned once per width and flags, and a new bucket
# costs one compile of the chosen configuration. The configuration is the one tuned at the first length met: in the
# process, or, where Triton keeps autotuning results (FLA asks it to; ``TRITON_CACHE_AUTOTUNING``), in the cache.
# Tuned at 512 tokens and run at 4,096 on one H100 it was as fast as FLA's own choice at 4,096 within the spread of
# two readings, and a new length of a packed run cost 1.5 s instead of 16 to 37 (docs/lab/2026-12-07-tuned-by-width.md).
ROW_BUCKET_KEY = "NB"
FLA_ROW_BUCKETED = {
    "rms_norm": (
        ("fla.modules.norm.layernorm", "layer_norm_fwd_kernel"),
        ("fla.modules.norm.layernorm", "layer_norm_bwd_kernel"),
    ),
    "gated_norm": (
        ("fla.modules.norm.fused_norm_gate", "layer_norm_gated_fwd_kernel"),
        ("fla.modules.norm.fused_norm_gate", "layer_norm_gated_bwd_kernel"),
    ),
}
FLA_IMPORTS = {
    "conv": ("fla.modules.causal_conv1d", "causal_conv1d"),
    "rms_norm": ("fla.modules.norm.layernorm", "rms_norm"),
    "gated_norm": ("fla.modules.norm.fused_norm_gate", "rms_norm_gated"),
    "swiglu": ("fla.modules.activations", "swiglu"),
}


@dataclass(frozen=True)
class Choice:
    """The kernel an op gets: ``fla``, ``torch_npu`` or ``torch`` (transformers' own ops), and why."""

    kernel: str
    reason: str


def select_kernels(
    backend: str, wanted: dict[str, bool], fla_usable: str | None, npu_rms_norm: bool
) -> dict[str, Choice]:
    """Decide per op (pure logic).

    Args:
        backend: ``npu``, ``cuda`` or ``cpu``.
        wanted: op -> whether the config leaves it on.
        fla_usable: None when FLA imports for this backend, else why not.
        npu_rms_norm: whether ``torch_npu.npu_rms_norm`` exists.
    """
    choices: dict[str, Choice] = {}
    for op in OPS:
        if not wanted.get(op, True):
            choices[op] = Choice("torch", f"launcher.patches.fused_ops.{op}: false")
        elif backend == "cpu":
            choices[op] = Choice("torch", "backend cpu: FLA's Triton kernels need an accelerator")
        elif op == "rms_norm" and backend == "npu" and npu_rms_norm:
            choices[op] = Choice("torch_npu", "torch_npu.npu_rms_norm: the AscendC kernel, no Triton compile")
        elif fla_usable is None:
            choices[op] = Choice("fla", f"FLA's fused {op} on backend {backend}")
        else:
            choices[op] = Choice("torch", f"FLA cannot serve {op}: {fla_usable}")
    return choices


def load(op: str, kernel: str) -> Any:
    """The callable behind ``kernel`` for ``op`` (imports FLA or torch_npu only here)."""
    if kernel == "torch_npu":
        return importlib.import_module("torch_npu").npu_rms_norm
    module, name = FLA_IMPORTS[op]
    return getattr(importlib.import_module(module), name)


class FlaConv:
    """transformers' ``causal_conv1d_fn`` contract (x ``[B, D, T]``, weight ``[D, W]``; returns ``[B, D, T]``)
    served by FLA's ``causal_conv1d`` (``[B, T, D]``). The transposes are views: ``Qwen3_5GatedDeltaNet``
    hands in the transpose of its contiguous ``[B, T, D]`` projection and transposes the result back."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.calls = 0

    def __call__(self, x, weight, bias=None, activation=None, seq_idx=None):
        if seq_idx is not None:
            raise ValueError("FlaConv takes no seq_idx; packed rows pass cu_seqlens through varlen()")
        self.calls += 1
        out, _ = self.kernel(x.transpose(1, 2), weight=weight, bias=bias, activation=activation)
        return out.transpose(1, 2)

    def varlen(self, x, weight, bias, activation, cu_seqlens, cu_seqlens_cpu):
        """Packed rows laid end to end, ``x`` ``[1, N, D]``: each sample convolved alone (``cu_seqlens``; None: the
        row as one sequence)."""
        self.calls += 1
        out, _ = self.kernel(
            x, weight=weight, bias=bias, activation=activation, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu
        )
        return out

    # one adapter per process, shared by every layer; copying a model must not fork it
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


_rekeyed: dict[str, tuple[Any, list[str]]] = {}  # kernel -> (its autotuner, the keys FLA gave it)


def conv_of(layer) -> FlaConv | None:
    """The FLA convolution a DeltaNet layer is bound to (by the ``fused_ops`` patch), or None (``packed_rows`` asks)."""
    conv = getattr(layer, "causal_conv1d_fn", None)
    return conv if isinstance(conv, FlaConv) else None


def autotuner_of(module_name: str, name: str) -> Any | None:
    """The Triton ``Autotuner`` behind FLA's kernel ``module_name.name`` (heuristics may wrap it), or None."""
    from triton.runtime.autotuner import Autotuner

    tuner = getattr(importlib.import_module(module_name), name, None)
    while tuner is not None and not isinstance(tuner, Autotuner):
        tuner = getattr(tuner, "fn", None)
    return tuner


def tune_by_width(ops: tuple[str, ...] = tuple(FLA_ROW_BUCKETED)) -> list[str]:
    """Take ``ROW_BUCKET_KEY`` out of the autotune keys of the row-bucketed kernels of FLA's ``ops``
    (``FLA_ROW_BUCKETED``); idempotent. Returns every kernel re-keyed so far (until ``restore_tuning``): none where
    FLA's kernels are not as read in fla-core 0.6.0 (a kernel missing, or its key without ``NB``), and then FLA tunes
    as it does."""
    for module_name, name in (kernel for op in ops for kernel in FLA_ROW_BUCKETED[op]):
        tuner = autotuner_of(module_name, name)
        if tuner is not None and ROW_BUCKET_KEY in tuner.keys:
            _rekeyed[f"{module_name}.{name}"] = (tuner, list(tuner.keys))
            tuner.keys = [key for key in tuner.keys if key != ROW_BUCKET_KEY]
    return sorted(_rekeyed)


def tune_chosen_norms(backend: str, choices: dict[str, Choice]) -> list[str] | None:
    """On CUDA, ``tune_by_width`` for the norms ``choices`` gives FLA; None where no norm is FLA's on CUDA."""
    norms = tuple(op for op in FLA_ROW_BUCKETED if choices[op].kernel == "fla")
    return tune_by_width(norms) if backend == "cuda" and norms else None


def restore_tuning() -> None:
    """Give FLA's kernels their own autotune keys back."""
    for tuner, keys in _rekeyed.values():
        tuner.keys = keys
    _rekeyed.clear()


def rms_norm(kernel_name: str, kernel: Any, x, weight, eps: float):
    """``Qwen3_5RMSNorm``: ``x_hat * (1 + w)`` in fp32, cast to x's dtype (zero-centred weight)."""
    if kernel_name == "torch_npu":
        return kernel(x, (1.0 + weight.float()).to(x.dtype), epsilon=eps)[0]
    return kernel(x, 1.0 + weight.float(), None, eps=eps)


def gated_norm(kernel: Any, x, gate, weight, eps: float):
    """``Qwen3_5RMSNormGated``: ``x_hat * w * silu(gate)``, fp32 inside, x's dtype out."""
    return kernel(x, gate, weight, None, activation="silu", eps=eps)
