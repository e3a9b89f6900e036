"""Fused kernels for the glue of every Qwen3.5 layer: the DeltaNet short convolution, both RMSNorms, SwiGLU.

Upstream behaviour (transformers 5.6.0, ``models/qwen3_5/modeling_qwen3_5.py``; ``qwen3_5_moe`` is the same
code): the DeltaNet layer binds ``causal_conv1d_fn`` at construction from a module global that is set only when
the CUDA-only ``causal-conv1d`` package imports, else it runs ``nn.Conv1d`` (``conv_depthwise2d``) and prints "The
fast path is not available"; ``Qwen3_5RMSNorm`` runs unfused in fp32 (``x.float()``, pow, mean, rsqrt,
``* (1 + w)``, cast back); ``Qwen3_5RMSNormGated`` likewise; ``Qwen3_5MLP`` computes ``act_fn(gate) * up`` as
two kernels. On one H200 these ops took about a fifth of a 27B step (docs/lab/2026-12-02-fused-glue.md).

What this patch does, per op (``fused_kernels.select_kernels``; each has an off switch,
``launcher.patches.fused_ops.<op>: false``):

- ``conv``: the module global ``causal_conv1d_fn`` becomes ``fused_kernels.FlaConv`` (FLA's ``causal_conv1d``)
  before the model is built, so every DeltaNet layer binds it; packed rows hand it their ``cu_seqlens``
  (``packed_rows``). Decoding keeps transformers' one-token update (``causal_conv1d_update``).
- ``rms_norm``, ``gated_norm``, ``swiglu``: the forwards of ``Qwen3_5RMSNorm``, ``Qwen3_5RMSNormGated`` and
  ``Qwen3_5MLP`` (and their MoE twins where they exist) are wrapped at class level to call the fused kernel
  with the module's own weights; the modules, their parameter names and checkpoints stay transformers'. On CUDA
  FLA's kernels for norms of 512 channels or fewer (the attention's q and k norms, the gated norm) are tuned once
  per width instead of at every new bucket of rows (``fused_kernels.tune_by_width``), so a length met for the
  first time costs a compile, not a tuning.

On CUDA every op is FLA's Triton kernel; on NPU FLA's triton-ascend kernels, except the plain RMSNorm, which
goes to ``torch_npu.npu_rms_norm`` (``fused_kernels`` says why), and the convolution and the gated norm where
preflight's kernel choice refused FLA's kernel at a validation case (``launcher.checks.kernels.choice``: then
transformers' torch op, with the refusal recorded); on CPU nothing changes (the patch records why).
``launcher validate-kernels`` checks each op against an fp32 reference at the 27B shapes.
Proof per rank: the kernel and reason per op, and at the first training step how many modules of each kind
the model has and how many fused calls that step made.

Versions: transformers 5.6.x (``SUPPORTED``), fla-core 0.6.x (``fla_probe.FLA_SUPPORTED``). On the test
machine (CPU) the CUDA/NPU selection runs against a stand-in FLA module. Delete an op's part when transformers
fuses it on NPU and CUDA by itself (transformers 5.24 takes the conv and the gated norm from Hub kernels for
CUDA and XPU only).
"""

from __future__ import annotations

import importlib
from dataclasses import asdict
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, ConfigDict

from .core import trainer_hook
from .core.proof import ProofFile, utc_now
from .core.versions import require_global_loads, require_symbols
from .core.wrapping import unwrap, wrap_once
from .deltanet_routing import refusals
from .kernels import fused_kernels
from .kernels.fla_probe import FLA_SUPPORTED, probe_fla

NAME = "fused_ops"
SUPPORTED = {"transformers": SpecifierSet(">=5.6.0,<5.7")}
MODULES = ("transformers.models.qwen3_5.modeling_qwen3_5", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
PREFIX = {MODULES[0]: "Qwen3_5", MODULES[1]: "Qwen3_5Moe"}
# op -> (class suffix, method) wrapped at class level
WRAPPED = {"rms_norm": ("RMSNorm", "forward"), "gated_norm": ("RMSNormGated", "forward"), "swiglu": ("MLP", "forward")}


class Options(BaseModel):
    """``launcher.patches.fused_ops``: each op on (where the backend has the kernel) unless set false."""

    model_config = ConfigDict(extra="forbid", strict=True)
    enabled: bool = True
    conv: bool = True
    rms_norm: bool = True
    gated_norm: bool = True
    swiglu: bool = True


_state: dict[str, Any] = {}
_saved_conv: dict[str, Any] = {}  # module name -> causal_conv1d_fn before our first apply


def check_symbols() -> None:
    """The classes we wrap exist, and the DeltaNet constructor still reads ``causal_conv1d_fn``."""
    for module_name, prefix in PREFIX.items():
        names = ["causal_conv1d_fn", f"{prefix}GatedDeltaNet", *(prefix + suffix for suffix, _ in WRAPPED.values())]
        module = require_symbols(NAME, module_name, names, "transformers")
        require_global_loads(
            NAME, getattr(module, f"{prefix}GatedDeltaNet").__init__, ("causal_conv1d_fn",), "transformers"
        )


def fla_usable(backend: str) -> str | None:
    if backend == "cpu":
        return "backend cpu"
    fla = probe_fla(backend)
    if not fla.installed:
        return "FLA (fla-core) is not installed"
    try:
        supported = FLA_SUPPORTED.contains(Version(fla.version or ""), prereleases=True)
    except InvalidVersion:
        supported = False
    if not supported:
        return f"fla-core {fla.version} is outside fla-core{FLA_SUPPORTED}"
    if fla.import_error:
        return f"FLA does not import: {fla.import_error}"
    return None  # FLA's Hopper guard concerns the delta-rule backward only, not these kernels


def npu_rms_norm_available() -> bool:
    try:
        return hasattr(importlib.import_module("torch_npu"), "npu_rms_norm")
    except ImportError:
        return False


def _count(op: str) -> None:
    calls = _state.get("calls")
    if calls is not None:
        calls[op] += 1


def _make_rms_norm(name: str, kernel: Any):
    def make(original):
        def forward(self, x):
            _count("rms_norm")
            return fused_kernels.rms_norm(name, kernel, x, self.weight, self.eps)

        return forward

    return make


def _make_gated_norm(kernel: Any):
    def make(original):
        def forward(self, hidden_states, gate=None):
            if gate is None:
                return original(self, hidden_states, gate)
            _count("gated_norm")
            return fused_kernels.gated_norm(kernel, hidden_states, gate, self.weight, self.variance_epsilon)

        return forward

    return make


def _make_swiglu(kernel: Any):
    def make(original):
        def forward(self, x):
            if self.config.hidden_act not in ("silu", "swish"):
                return original(self, x)
            _count("swiglu")
            return self.down_proj(kernel(self.gate_proj(x), self.up_proj(x)))

        return forward

    return make


def apply(options: dict[str, Any], *, backend: str, proof: ProofFile, facts: dict[str, Any]) -> dict[str, Any]:
    """Select a kernel per op and install the adapters; idempotent."""
    _unwrap_all()
    wanted = {op: options[op] for op in fused_kernels.OPS}
    fla_reason = fla_usable(backend) if any(wanted.values()) else "no op asked for"
    choices = fused_kernels.select_kernels(backend, wanted, fla_reason, backend == "npu" and npu_rms_norm_available())
    record = facts.get("kernel_choice") if backend == "npu" else None
    for op, found in ((record or {}).get("components") or {}).items():
        if op in choices and choices[op].kernel == "fla" and found.get("chosen") == "torch":
            choices[op] = fused_kernels.Choice("torch", f"preflight chose torch by validation ({refusals(found)})")
    kernels = {op: fused_kernels.load(op, c.kernel) for op, c in choices.items() if c.kernel != "torch"}
    conv = fused_kernels.FlaConv(kernels["conv"]) if "conv" in kernels else None
    makers = {
        "rms_norm": lambda: _make_rms_norm(choices["rms_norm"].kernel, kernels["rms_norm"]),
        "gated_norm": lambda: _make_gated_norm(kernels["gated_norm"]),
        "swiglu": lambda: _make_swiglu(kernels["swiglu"]),
    }
    for module_name, prefix in PREFIX.items():
        module = importlib.import_module(module_name)
        if not isinstance(module.causal_conv1d_fn, fused_kernels.FlaConv):  # what the routing left there
            _saved_conv[module_name] = module.causal_conv1d_fn
        module.causal_conv1d_fn = conv if conv is not None else _saved_conv[module_name]
        for op, (suffix, method) in WRAPPED.items():
            if op in kernels:
                wrap_once(getattr(module, prefix + suffix), method, NAME, makers[op]())
    _state.update(proof=proof, conv=conv, choices=choices, calls=dict.fromkeys(fused_kernels.OPS, 0))
    trainer_hook.on_first_training_step(NAME, before=_before_first_step, after=_after_first_step)
    record = {
        **({"kernel_choice": record} if record is not None else {}),
        "ops": {op: {**asdict(c), "callable": callable_name(op, c.kernel)} for op, c in choices.items()},
        "expected_device": {"cpu": "cpu", "cuda": "cuda", "npu": "npu"}[backend],
    }
    tuned = fused_kernels.tune_chosen_norms(backend, choices)
    if tuned is not None:
        record["fla_norms_tuned_by_width"] = tuned  # empty: FLA's kernels not as read, tuned per bucket of rows
    return record


def callable_name(op: str, kernel: str) -> str:
    """What training calls for ``op`` served by ``kernel`` (proofs, and preflight's kernel choice)."""
    if kernel == "torch_npu":
        return "torch_npu.npu_rms_norm"
    if kernel == "fla":
        return ".".join(fused_kernels.FLA_IMPORTS[op])
    return "transformers (unfused torch ops)"


def census(model) -> dict[str, int]:
    """How many modules of each fused kind the model holds, and how many DeltaNet layers bind the FLA conv."""
    counts = dict.fromkeys(fused_kernels.OPS, 0)
    for module in model.modules():
        kind = type(module).__name__
        for prefix in PREFIX.values():
            for op, (suffix, _) in WRAPPED.items():
                counts[op] += kind == prefix + suffix
            if kind == f"{prefix}GatedDeltaNet" and module.causal_conv1d_fn is not None:
                counts["conv"] += module.causal_conv1d_fn is _state.get("conv")
    return counts


def _before_first_step(trainer, model) -> None:
    _state["modules"] = census(model)
    _state["calls_before"] = dict(_state["calls"])
    if _state["conv"] is not None:
        _state["conv_calls_before"] = _state["conv"].calls


def _after_first_step(trainer, model) -> None:
    calls = {op: _state["calls"][op] - _state["calls_before"][op] for op in _state["calls"]}
    if _state["conv"] is not None:
        calls["conv"] = _state["conv"].calls - _state["conv_calls_before"]
    _state["proof"].update(
        first_training_step={"modules": _state["modules"], "fused_calls": calls, "recorded_at": utc_now()}
    )


def observe(*, backend: str, proof: ProofFile) -> None:
    """Disabled: transformers' own ops run (torch convolution, unfused norms and SwiGLU)."""
    restore()


def restore() -> None:
    """Put back the conv global and the upstream forwards."""
    for module_name, value in _saved_conv.items():
        importlib.import_module(module_name).causal_conv1d_fn = value
    _saved_conv.clear()
    _unwrap_all()
    _state.clear()


def _unwrap_all() -> None:
    fused_kernels.restore_tuning()
    for module_name, prefix in PREFIX.items():
        for suffix, method in WRAPPED.values():
            unwrap(module_name, prefix + suffix, method, NAME)
