"""Which fused kernel serves each glue op of a Qwen3.5 layer, and the adapters that call it.

Pure selection (``select_kernels``) plus thin adapters from transformers' call shapes to the kernels' own.
The kernels, as read in fla-core 0.6.0 (each dispatches to its triton-ascend variant on an NPU through FLA's
backend registry, ``fla.backends``) and torch_npu:

==========  ====================================================  ==========================================
op          kernel                                                call shape
==========  ====================================================  ==========================================
conv        ``fla.modules.causal_conv1d.causal_conv1d``           x ``[B, T, D]``, weight ``[D, W]``, optional
                                                                  ``cu_seqlens``; returns ``(y, final_state)``
rms_norm    ``fla.modules.norm.layernorm.rms_norm`` (CUDA, norms  ``(x, weight, bias, eps=)``; fp32 inside,
            wider than 512: ``narrow_norm``),                     output in x's dtype / ``(x, gamma, epsilon=)``
            ``torch_npu.npu_rms_norm`` (NPU)
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
# fla-core 0.6.0's layer norm on CUDA (``fla/modules/norm/layernorm.py``, ``layer_norm_fwd`` / ``layer_norm_bwd``)
# serves a normalized width of at most 512 with kernels that take ``NB = cdiv(rows, 2048)`` as a compile-time
# constant and as an autotune key, so every new bucket of 2,048 rows compiles and autotunes the forward (9
# configurations) and the backward (6) again; wider norms go to row kernels tuned by width alone. The attention's
# q and k norms (head_dim 256; rows = tokens x heads) meet a new bucket every 85 (q, 24 heads) and 512 (k, 4 heads)
# tokens of sequence length: a packed run on one H100 lost 16 to 37 s at each new length (docs/benchmarks.md,
# "Twenty-first invocation"). Norms this narrow stay on transformers' ops on CUDA (``narrow_norm``).
FLA_ROW_BUCKETED_WIDTH = 512
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


def select_kernels(backend: str, wanted: dict[str, bool], fla_usable: str | None,
                   npu_rms_norm: bool) -> dict[str, Choice]:  # fmt: skip
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
            narrow = (f"; norms of {FLA_ROW_BUCKETED_WIDTH} channels or fewer stay on transformers' ops (FLA tunes "
                      f"them per bucket of rows)") if op == "rms_norm" and backend == "cuda" else ""  # fmt: skip
            choices[op] = Choice("fla", f"FLA's fused {op} on backend {backend}{narrow}")
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
        out, _ = self.kernel(x, weight=weight, bias=bias, activation=activation, cu_seqlens=cu_seqlens,
                             cu_seqlens_cpu=cu_seqlens_cpu)  # fmt: skip
        return out

    # one adapter per process, shared by every layer; copying a model must not fork it
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


def narrow_norm(backend: str, kernel_name: str, width: int) -> bool:
    """Whether a ``Qwen3_5RMSNorm`` of ``width`` channels stays on transformers' ops although ``kernel_name`` serves
    the op: FLA's CUDA kernels for it are tuned per bucket of rows (``FLA_ROW_BUCKETED_WIDTH``)."""
    return backend == "cuda" and kernel_name == "fla" and width <= FLA_ROW_BUCKETED_WIDTH


def rms_norm(kernel_name: str, kernel: Any, x, weight, eps: float):
    """``Qwen3_5RMSNorm``: ``x_hat * (1 + w)`` in fp32, cast to x's dtype (zero-centred weight)."""
    if kernel_name == "torch_npu":
        return kernel(x, (1.0 + weight.float()).to(x.dtype), epsilon=eps)[0]
    return kernel(x, 1.0 + weight.float(), None, eps=eps)


def gated_norm(kernel: Any, x, gate, weight, eps: float):
    """``Qwen3_5RMSNormGated``: ``x_hat * w * silu(gate)``, fp32 inside, x's dtype out."""
    return kernel(x, gate, weight, None, activation="silu", eps=eps)
