"""Route the Gated DeltaNet chunk and recurrent kernels of ``qwen3_5``/``qwen3_5_moe`` per backend; prove what ran.

Upstream behaviour (transformers 5.6.0, ``models/qwen3_5/modeling_qwen3_5.py``; ``qwen3_5_moe`` is the
same code): at import, the module globals ``chunk_gated_delta_rule``, ``fused_recurrent_gated_delta_rule``
and ``FusedRMSNormGated`` come from FLA only if ``is_flash_linear_attention_available()``, which requires
CUDA; ``causal_conv1d_fn``/``causal_conv1d_update`` likewise need CUDA. ``Qwen3_5GatedDeltaNet.__init__``
binds ``self.chunk_gated_delta_rule = chunk_gated_delta_rule or torch_chunk_gated_delta_rule`` (and the
norm, conv and recurrent kernels) from those globals at construction. So on an Ascend NPU the DeltaNet
layers silently run the pure-torch chunk loop even with FLA + triton-ascend installed (about 40x slower
per kernel). ``is_fast_path_available`` is computed once at import and only decides whether the
constructor logs "falling back to torch"; no code path depends on it.

What this patch does, before the model is built (``select_route`` decides, ``apply`` installs):

=======  ============  ===============================  =========================================
backend  kernel        chunk kernel                     conv1d / gated RMSNorm / recurrent (decode)
=======  ============  ===============================  =========================================
npu      auto          preflight's choice (below)       torch nn.Conv1d / torch norm / FLA or torch
npu      fla           FLA (triton-ascend); required    torch nn.Conv1d / torch norm / FLA
cuda     auto          FLA if it imports, else torch    upstream choice / torch norm / FLA
cuda     fla           FLA; required                    upstream choice / torch norm / FLA
cpu      auto          transformers' torch reference    torch / torch / torch
any      torch         transformers' torch reference    torch / torch / torch
=======  ============  ===============================  =========================================

On NPU with ``auto``, preflight has tried FLA's kernel, then fla_npu's AscendC kernels (``ascendc_gdn``, where
installed), then the torch loop, each through the validation cases at the run's shapes, and recorded the first
that passed in ``preflight.json`` (``launcher.checks.kernels.choice``); each rank reads it from its facts and binds
that kernel (decoding keeps FLA's recurrent kernel only when the chunk kernel is FLA's). Without a choice (the
kernel row skipped) FLA is required, as with ``fla``. The proof records the choice.

The gated RMSNorm module is always transformers' own ``Qwen3_5RMSNormGated``: FLA's ``FusedRMSNormGated`` module
is never built, because transformers' constructor passes it ``torch.cuda.current_device()`` (fails on NPU) and
it would change the parameter layout per backend. The ``fused_ops`` patch fuses that module's forward (and the
convolution, the other norms and SwiGLU) on CUDA and NPU. The recurrent kernel
runs only in generation (``launcher evaluate``): once the prompt went through the chunk kernel, each new token
calls ``recurrent_gated_delta_rule`` with the cached state; it follows the chunk kernel (FLA's
``fused_recurrent_gated_delta_rule`` wherever the chunk kernel is FLA, on NPU too; the torch loop otherwise),
and ``launcher validate-kernels`` checks it against the fp32 reference (case ``decode``). When FLA is
installed but refuses the device (its Hopper guard for Triton >= 3.4, < 3.7.1; see ``fla_probe``), the run
stops here with FLA's reason and the fix, unless the config says ``kernel: torch``. We never lift FLA's
guard. The chosen chunk and recurrent kernels are each wrapped in a ``KernelRecorder``: it checks the device
of every call and records the first call on each rank (``first_call``; the recurrent one as
``first_decode_call``), and at the first training step the patch checks that every DeltaNet layer of the
model is bound to the chunk recorder (a model built before the patch was applied fails the run there).

Versions: written and tested against transformers 5.6.0 (``SUPPORTED`` allows 5.6.x) and fla-core 0.6.0
(``fla_probe.FLA_SUPPORTED``; checked only when FLA is used). On CPU, NPU and CUDA are exercised only at
the selection level and with a stand-in FLA module: there is no NPU or GPU on the test machine.

Delete this patch when transformers selects FLA on NPU by itself (``is_flash_linear_attention_available``
no longer requires CUDA, and the norm no longer calls ``torch.cuda``) and a run's record shows FLA ran.
"""

from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass
from typing import Any, Literal

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, ConfigDict

from .core import trainer_hook
from .core.errors import PatchError
from .core.proof import ProofFile, utc_now
from .core.versions import require_global_loads, require_symbols
from .kernels import ascendc_gdn
from .kernels.fla_probe import FLA_SUPPORTED, FlaFacts, fla_presence, probe_fla
from .kernels.recorder import CallLog, KernelRecorder, qualified_name

NAME = "deltanet_routing"
SUPPORTED = {"transformers": SpecifierSet(">=5.6.0,<5.7")}
BACKEND_DEVICE = {"npu": "npu", "cuda": "cuda", "cpu": "cpu"}
FLA_PLATFORMS = {"npu": ("npu",), "cuda": ("cuda", "hip")}  # fla.utils.device_platform per backend (ROCm: hip)
ROUTED_GLOBALS = (
    "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "FusedRMSNormGated",
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "is_fast_path_available",
)
TORCH_KERNEL_FIX = "or set launcher.patches.deltanet_routing.kernel: torch to train on the slow torch reference"


class Options(BaseModel):
    """``launcher.patches.deltanet_routing``: ``kernel`` is auto (per backend), fla, or torch. On NPU, ``auto`` takes
    the kernels preflight chose by validation (``launcher.checks.kernels.choice``); a choice that fell back to torch
    stops the run at preflight unless ``allow_torch_fallback`` (about 8x slower a 27B step)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    enabled: bool = True
    kernel: Literal["auto", "fla", "torch"] = "auto"
    allow_torch_fallback: bool = False


@dataclass(frozen=True)
class Target:
    module: str
    deltanet_class: str
    torch_norm_class: str


TARGETS = (
    Target("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5GatedDeltaNet", "Qwen3_5RMSNormGated"),
    Target(
        "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
        "Qwen3_5MoeGatedDeltaNet",
        "Qwen3_5MoeRMSNormGated",
    ),
)


@dataclass(frozen=True)
class Route:
    """Which implementation each DeltaNet piece gets; ``upstream`` keeps transformers' import-time choice."""

    kernel: Literal["fla", "ascendc", "torch"]
    recurrent: Literal["fla", "torch"]
    conv: Literal["upstream", "torch"]
    reason: str


def refusals(component: dict[str, Any]) -> str:
    """The kernels preflight refused for one component of its kernel choice, each with its failing case."""
    return "; ".join(f"{r['kernel']} refused at {r['case']}: {r['note']}" for r in component.get("refused", []))


def _torch_route(reason: str) -> Route:
    return Route(kernel="torch", recurrent="torch", conv="torch", reason=reason)


def select_route(backend: str, kernel: str, fla: FlaFacts, chosen: dict[str, Any] | None = None) -> Route:
    """Decide the route from the backend, the configured ``kernel``, what FLA offers and, on NPU with ``auto``, the
    chunk kernel preflight chose (``chosen``: the ``chunk`` entry of ``launcher.checks.kernels.choice``'s record) (pure
    logic).

    Raises:
        PatchError: the configured kernel cannot run here; the message carries FLA's reason and the fix.
    """
    if chosen is not None and backend == "npu" and kernel == "auto" and chosen.get("chosen") != "fla":
        reason = f"preflight chose {chosen.get('chosen')} by validation ({refusals(chosen) or 'nothing refused'})"
        if chosen.get("chosen") == "ascendc":  # decoding keeps the torch loop: FLA's recurrent kernel was not chosen
            return Route(kernel="ascendc", recurrent="torch", conv="torch", reason=reason)
        if chosen.get("chosen") == "torch":
            return _torch_route(reason)
        raise PatchError(
            NAME,
            f"preflight's kernel choice holds no usable chunk kernel: {chosen}",
            "run launcher preflight again (it chooses the kernels) and read its kernel row",
        )
    if kernel == "torch":
        note = f"; FLA would have refused: {fla.refusal}" if fla.refusal else ""
        return _torch_route(f"the config chose kernel: torch{note}")
    if backend == "cpu":
        if kernel == "fla":
            raise PatchError(
                NAME,
                "kernel: fla was requested on backend cpu, but FLA's Triton kernels need an accelerator",
                "set launcher.patches.deltanet_routing.kernel: auto (or torch) for CPU runs",
            )
        return _torch_route("backend cpu: transformers' torch reference")
    if not fla.installed:
        if backend == "cuda" and kernel == "auto":
            return _torch_route("FLA is not installed; CUDA falls back to the torch reference (slow)")
        raise PatchError(
            NAME,
            f"kernel: {kernel} on backend {backend} needs FLA, which is not installed",
            f"install fla-core{FLA_SUPPORTED}"
            + (" with triton-ascend (the NPU image has both)" if backend == "npu" else "")
            + f", {TORCH_KERNEL_FIX}",
        )
    _require_supported_fla(fla.version)
    if fla.import_error:
        raise PatchError(
            NAME,
            f"FLA {fla.version} is installed but does not import: {fla.import_error}",
            "repair the FLA/Triton install (on NPU only triton-ascend may provide `triton`), " + TORCH_KERNEL_FIX,
        )
    if fla.platform not in FLA_PLATFORMS[backend]:
        raise PatchError(
            NAME,
            f"FLA's Triton backend is {fla.platform!r}, but this run's backend is {backend}",
            "install the Triton that matches the device (triton-ascend on NPU; community triton next to it "
            f"breaks both), {TORCH_KERNEL_FIX}",
        )
    if fla.refusal and not fla.workaround:
        raise PatchError(
            NAME,
            fla.refusal,
            "use a Triton that FLA accepts (>= 3.7.1; the CUDA image pins one) or install tilelang so FLA "
            f"routes the backward around the guard, {TORCH_KERNEL_FIX}",
        )
    reason = f"backend {backend}: FLA {fla.version} ({fla.platform})"
    if fla.refusal:
        reason += f"; FLA's Hopper guard is avoided by its {fla.workaround} backend"
    if backend == "npu":
        return Route(kernel="fla", recurrent="fla", conv="torch", reason=reason)
    return Route(kernel="fla", recurrent="fla", conv="upstream", reason=reason)


def _require_supported_fla(version: str | None) -> None:
    try:
        supported = version is not None and FLA_SUPPORTED.contains(Version(version), prereleases=True)
    except InvalidVersion:
        supported = False
    if not supported:
        raise PatchError(
            NAME,
            f"FLA (fla-core) {version or 'of unknown version'} is installed; this patch was checked "
            f"against fla-core{FLA_SUPPORTED} (its API and its Hopper guard)",
            f"pip install 'fla-core{FLA_SUPPORTED}', {TORCH_KERNEL_FIX}",
        )


def check_symbols() -> None:
    """The module globals we replace exist, and the DeltaNet constructor still reads them."""
    for target in TARGETS:
        names = (
            *ROUTED_GLOBALS,
            "torch_chunk_gated_delta_rule",
            "torch_recurrent_gated_delta_rule",
            target.deltanet_class,
            target.torch_norm_class,
        )
        module = require_symbols(NAME, target.module, names, "transformers")
        init = getattr(module, target.deltanet_class).__init__
        require_global_loads(
            NAME, init, ("chunk_gated_delta_rule", "FusedRMSNormGated", "causal_conv1d_fn"), "transformers"
        )


@dataclass(frozen=True)
class FlaKernels:
    chunk: Any = None
    fused_recurrent: Any = None


def load_fla_kernels() -> FlaKernels:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    return FlaKernels(chunk_gated_delta_rule, fused_recurrent_gated_delta_rule)


_ORIGINALS: dict[str, dict[str, Any]] = {}  # module name -> its globals before our first apply
_active: dict[str, Any] = {}  # the installed route, its call log and proof file


def apply(options: dict[str, Any], *, backend: str, proof: ProofFile, facts: dict[str, Any]) -> dict[str, Any]:
    """Select and install the route; idempotent (always wraps the saved upstream values, never a recorder)."""
    record = facts.get("kernel_choice") if backend == "npu" and options["kernel"] == "auto" else None
    chosen = (record or {}).get("components", {}).get("chunk")
    # On CUDA transformers has imported FLA already (if installed); on NPU import it only to use it.
    wants_fla = backend == "cuda" or (
        backend == "npu" and options["kernel"] != "torch" and (chosen or {}).get("chosen", "fla") == "fla"
    )
    fla = probe_fla(backend) if wants_fla else fla_presence()
    route = select_route(backend, options["kernel"], fla, chosen)
    kernels = load_fla_kernels() if route.kernel == "fla" else FlaKernels()
    if route.kernel == "ascendc":
        kernels = FlaKernels(chunk=ascendc_gdn.chunk_gated_delta_rule)
    log = CallLog(lambda call: proof.update(first_call={**call, "recorded_at": utc_now()}))
    decode_log = CallLog(lambda call: proof.update(first_decode_call={**call, "recorded_at": utc_now()}))
    for target in TARGETS:
        module = importlib.import_module(target.module)
        originals = _ORIGINALS.setdefault(target.module, {name: getattr(module, name) for name in ROUTED_GLOBALS})
        chunk = kernels.chunk if route.kernel != "torch" else module.torch_chunk_gated_delta_rule
        recurrent = kernels.fused_recurrent if route.recurrent == "fla" else module.torch_recurrent_gated_delta_rule
        recorder = {"expected_device": BACKEND_DEVICE[backend], "patch": NAME, "backend": backend}
        values = {
            "chunk_gated_delta_rule": KernelRecorder(chunk, label=route.kernel, log=log, **recorder),
            # the constructor binds `fused_recurrent_gated_delta_rule or torch_recurrent_gated_delta_rule`
            "fused_recurrent_gated_delta_rule": KernelRecorder(
                recurrent, label=route.recurrent, log=decode_log, role="recurrent_gated_delta_rule", **recorder
            ),
            "FusedRMSNormGated": None,  # transformers' module; fused_ops fuses its forward
            "causal_conv1d_fn": originals["causal_conv1d_fn"] if route.conv == "upstream" else None,
            "causal_conv1d_update": originals["causal_conv1d_update"] if route.conv == "upstream" else None,
            # Only drives the constructor's "falling back to torch" warning; true iff the chunk kernel is FLA.
            "is_fast_path_available": route.kernel == "fla",
        }
        for name, value in values.items():
            setattr(module, name, value)
    _active.update(route=route, log=log, decode_log=decode_log, proof=proof, first_step={})
    trainer_hook.on_first_training_step(NAME, before=_before_first_step, after=_after_first_step)
    return {
        "route": {
            **asdict(route),
            **describe_bindings(TARGETS[0]),
            "expected_device": BACKEND_DEVICE[backend],
        },
        "fla": fla.as_record(),
        **({"kernel_choice": record} if record is not None else {}),
    }


def describe_bindings(target: Target) -> dict[str, str]:
    """What a DeltaNet layer built now would bind, read from the module globals (names, not objects)."""
    module = importlib.import_module(target.module)
    chunk = module.chunk_gated_delta_rule
    if isinstance(chunk, KernelRecorder):
        chunk_name = f"{chunk.kernel_name} (recorded)"
    else:
        chunk_name = qualified_name(chunk or module.torch_chunk_gated_delta_rule)
    norm = module.FusedRMSNormGated or getattr(module, target.torch_norm_class)
    conv = module.causal_conv1d_fn
    recurrent = module.fused_recurrent_gated_delta_rule or module.torch_recurrent_gated_delta_rule
    recurrent_name = (
        f"{recurrent.kernel_name} (recorded)" if isinstance(recurrent, KernelRecorder) else qualified_name(recurrent)
    )
    return {
        "chunk_gated_delta_rule": chunk_name,
        "rms_norm_gated": qualified_name(norm),
        "causal_conv1d": qualified_name(conv) if conv is not None else "torch.nn.Conv1d (transformers fallback)",
        "recurrent_gated_delta_rule": recurrent_name,
    }


def observe(*, backend: str, proof: ProofFile) -> None:
    """Disabled: put upstream's globals back if we changed them, and record what transformers binds."""
    restore()
    proof.update(upstream=describe_bindings(TARGETS[0]))


def restore() -> None:
    """Undo ``apply`` in this process (tests, and a disabled patch after an enabled one)."""
    for module_name, originals in _ORIGINALS.items():
        module = importlib.import_module(module_name)
        for name, value in originals.items():
            setattr(module, name, value)
    _ORIGINALS.clear()
    _active.clear()


def _deltanet_layers(model) -> list:
    classes = tuple(getattr(importlib.import_module(t.module), t.deltanet_class) for t in TARGETS)
    return [module for module in model.modules() if isinstance(module, classes)]


def _before_first_step(trainer, model) -> None:
    log: CallLog = _active["log"]
    layers = _deltanet_layers(model)
    unrouted = [
        layer
        for layer in layers
        if not (isinstance(layer.chunk_gated_delta_rule, KernelRecorder) and layer.chunk_gated_delta_rule.log is log)
    ]
    norms: dict[str, int] = {}
    for layer in layers:
        norms[type(layer.norm).__name__] = norms.get(type(layer.norm).__name__, 0) + 1
    _active["first_step"] = {
        "deltanet_layers": len(layers),
        "routed_layers": len(layers) - len(unrouted),
        "norm_classes": norms,
        "calls_before_step": log.calls,
    }
    if unrouted:
        bound = sorted({qualified_name(layer.chunk_gated_delta_rule) for layer in unrouted})
        error = PatchError(
            NAME,
            f"{len(unrouted)} of {len(layers)} DeltaNet layers are bound to {', '.join(bound)} instead of "
            "the "
            "routed kernel: the model was built before the patch was applied",
            "apply the patches before LLaMA-Factory builds the model (python -m launcher.entry does); "
            "do not build "
            "the model earlier in the training process",
        )
        _active["proof"].update(status="failed", error=str(error))
        raise error


def _after_first_step(trainer, model) -> None:
    record = dict(_active["first_step"])
    record["kernel_calls_in_step"] = _active["log"].calls - record.pop("calls_before_step")
    if record["deltanet_layers"] and not record["kernel_calls_in_step"]:
        record["note"] = (
            "the DeltaNet layers ran without calling the routed chunk_gated_delta_rule: their forward "
            "was replaced (LLaMA-Factory 0.9.5 does so for qwen3_5 with flash_attn: fa2, calling FLA "
            "directly), so the device check and this record do not cover them"
        )
    _active["proof"].update(first_training_step={**record, "recorded_at": utc_now()})
