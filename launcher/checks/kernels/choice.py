"""On NPU, ``deltanet_routing.kernel: auto`` chooses each DeltaNet kernel at preflight, by validation, first pass wins.

For each component, candidates in order (``ORDER``): the chunk kernel (FLA on triton-ascend, then fla_npu's
AscendC kernels where installed, ``patches.kernels.ascendc_gdn``, then transformers' torch loop), the short convolution
and the gated norm (FLA's triton-ascend kernel, then torch). Each candidate that loads runs the validation cases of
``launcher validate-kernels`` for its component (the quick suite's, then the same checks at the run's shapes, read
from the model's config and ``cutoff_len``, ``run_cases``); the first whose cases all pass (a skip with its reason
counts as a pass, as in ``validate-kernels``) is chosen. A candidate that does not load, or fails a case, is
recorded as refused with that case and its note. A torch choice carries the expected slowdown (``SLOWDOWN``).

The machinery is ``launcher.checks.kernels.check_case`` and ``launcher.checks.kernels.glue.check_glue_case``, the
same checks as ``launcher validate-kernels``; this module only orders candidates and keeps the record. It runs in
preflight's kernel child (``launcher.checks.kernels.check``); the record lands in ``preflight.json``
(``kernel_choice``), each rank's routing and fused_ops proofs, and ``launcher status``. Training binds the chosen
kernels (``patches.deltanet_routing`` and ``patches.fused_ops`` get the record in their facts: each rank's entry,
``launcher.rank.entry.run_facts``, adds it from ``preflight.json``).
A torch choice on NPU fails preflight unless ``launcher.patches.deltanet_routing.allow_torch_fallback: true``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from launcher.checks.kernels.cases import Case

ORDER = {"npu": {"chunk": ("fla", "ascendc", "torch"), "conv": ("fla", "torch"), "gated_norm": ("fla", "torch")}}
ALLOW_KEY = "launcher.patches.deltanet_routing.allow_torch_fallback"
# What a torch fallback costs, from measurements on one H200 (docs/npu-tuning.md, "Kernel choice on NPU", has the
# table and sources). Not measured on an NPU: the 910B's ratio is expected of the same order (the torch loop is many
# small kernels there too).
SLOWDOWN = {
    "chunk": "about 8x the 27B step (12.9 s against 1.49 s on one H200; the kernel alone 44x: 174.9 ms against "
    "4.0 ms at [1, 4096, 48, 128])",
    "conv": "about +0.25 s a 4,096-token 27B step (2.68 ms against 0.93 ms a call, 48 layers, forward, recompute "
    "and backward; one H200)",
    "gated_norm": "about +0.13 s a 4,096-token 27B step (1.93 ms against 0.59 ms a call, 48 layers; one H200)",
}


@dataclass
class Refusal:
    kernel: str
    case: str  # the failing case, or "load" when the candidate did not load
    note: str


@dataclass
class ComponentChoice:
    component: str
    chosen: str | None = None
    description: str = ""
    refused: list[Refusal] = field(default_factory=list)
    passed_cases: dict[str, float | None] = field(default_factory=dict)  # case -> its largest relative error
    expected_slowdown: str | None = None


@dataclass
class KernelChoice:
    backend: str
    shapes: dict[str, Any]
    components: dict[str, ComponentChoice] = field(default_factory=dict)

    @property
    def torch_fallbacks(self) -> list[str]:
        return [name for name, c in self.components.items() if c.chosen == "torch"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "shapes": self.shapes,
            "components": {name: asdict(c) for name, c in self.components.items()},
        }


def summary(record: dict[str, Any]) -> str:
    """One line of a ``KernelChoice.to_dict()`` record: each component's kernel and what it refused."""
    from patches.deltanet_routing import refusals

    parts = []
    for name, c in record.get("components", {}).items():
        refused = refusals(c)
        text = f"{name} {c.get('chosen') or 'NONE'}" + (f" ({refused})" if refused else "")
        if c.get("expected_slowdown"):
            text += f" [torch fallback: {c['expected_slowdown']}]"
        parts.append(text)
    return ", ".join(parts)


def run_shapes(model_config: dict[str, Any] | None, seq_len: int) -> dict[str, int]:
    """The DeltaNet call's shapes for this run: ``Qwen3_5TextConfig``'s linear-attention fields (the 27B model's
    when the config cannot be read) and the run's sequence length."""
    text = (model_config or {}).get("text_config", model_config or {})
    return {
        "seq_len": int(seq_len),
        "key_heads": int(text.get("linear_num_key_heads", 16)),
        "value_heads": int(text.get("linear_num_value_heads", 48)),
        "head_dim": int(text.get("linear_key_head_dim", 128)),
    }


def run_cases(shapes: dict[str, int]) -> dict[str, tuple[Case, ...]]:
    """Each component's cases at the run's heads and head size (kernels compile per heads and size, and some take one
    head size only: fla_npu's K = 128): the quick suite's layouts (batch 2 with T not a multiple of the chunk,
    grouped heads, three samples packed with ``cu_seqlens``, given repeated and unrepeated), then one sequence of the
    run's ``seq_len`` tokens and the same packed into three samples; the glue ops' quick cases and the run's shapes."""
    from launcher.checks.kernels.validate import SUITES

    t, hk, hv, d = shapes["seq_len"], shapes["key_heads"], shapes["value_heads"], shapes["head_dim"]
    lens, quick = (t // 4, t // 2, t - t // 4 - t // 2), SUITES["quick"]
    small = (45, 85, 70)
    return {
        "chunk": (
            Case("layout", 2, 150, hv, d, about="batch 2, T=150, not a multiple of the 64-token chunk"),
            Case("grouped", 1, 128, hv, d, key_heads=hk, about=f"q, k repeated from {hk} to {hv} heads"),
            Case("varlen", 1, sum(small), hv, d, key_heads=hk, seq_lens=small, about="3 samples packed"),
            Case(
                "varlen_grouped",
                1,
                sum(small),
                hv,
                d,
                key_heads=hk,
                seq_lens=small,
                unrepeated=True,
                about="3 samples packed, key heads unrepeated",
            ),
            Case("run", 1, t, hv, d, key_heads=hk, about=f"the run's DeltaNet call, {t} tokens"),
            Case(
                "run_varlen",
                1,
                t,
                hv,
                d,
                key_heads=hk,
                seq_lens=lens,
                unrepeated=True,
                about="the run's shapes, 3 samples packed with cu_seqlens",
            ),
        ),
        "conv": (
            *(c for c in quick if c.op == "conv"),
            Case("conv_run", 1, t, 2 * hk + hv, d, op="conv", about="the run's short convolution"),
        ),
        "gated_norm": (
            *(c for c in quick if c.op == "gated_norm"),
            Case("gated_norm_run", 1, t, hv, d, op="gated_norm", about="the run's DeltaNet output norm"),
        ),
    }


Loader = Callable[[], tuple[Callable, str]]  # returns (kernel, description); raises when the candidate is unusable


def choose(
    backend: str,
    candidates: dict[str, list[tuple[str, Loader]]],
    cases: dict[str, tuple[Case, ...]],
    device: str,
    shapes: dict[str, Any],
    threshold: float = 0.05,
    on_case: Callable[[str, Any], None] | None = None,
) -> KernelChoice:
    """Per component, the first candidate (in the given order) that loads and passes every case.

    Args:
        candidates: component -> [(kernel name, loader)], in order of preference.
        cases: component -> its validation cases (``run_cases``).
        device: where the kernels run (``npu:0``; the CPU in tests).
    """
    import torch

    from launcher.checks.kernels import glue as glue_kernels
    from launcher.checks.kernels.cases import Device
    from launcher.checks.kernels.validate import check_case, torch_reference

    dev = Device(torch, device)
    choice = KernelChoice(backend, shapes)
    for component, options in candidates.items():
        record = ComponentChoice(component)
        choice.components[component] = record
        for name, loader in options:
            try:
                kernel, description = loader()
            except Exception as err:  # not installed, does not import, refused by its own guard
                record.refused.append(Refusal(name, "load", f"{type(err).__name__}: {err}"))
                continue
            failed, passed = None, {}
            for case in cases[component]:
                if component == "chunk":
                    result = check_case(torch, case, kernel, torch_reference(), dev, threshold)
                else:
                    result = glue_kernels.check_glue_case(torch, case, kernel, dev, threshold)
                if on_case is not None:
                    on_case(f"{component}/{name}/{case.name}", result)
                if result.status == "fail":
                    failed = Refusal(name, case.name, result.note)
                    break
                passed[case.name] = None if result.max_error is None else round(result.max_error, 6)
            if failed is not None:
                record.refused.append(failed)
                continue
            record.chosen, record.description = name, description
            record.passed_cases = passed
            record.expected_slowdown = SLOWDOWN[component] if name == "torch" else None
            break
    return choice


def npu_candidates() -> dict[str, list[tuple[str, Loader]]]:
    """The candidates of ``ORDER["npu"]``, each a loader of the very callable training binds for it."""
    from launcher.checks.kernels import glue as glue_kernels
    from patches.deltanet_routing import load_fla_kernels, select_route
    from patches.fused_ops import callable_name, fla_usable
    from patches.kernels import ascendc_gdn
    from patches.kernels.fla_probe import probe_fla

    def fla_chunk():
        route = select_route("npu", "fla", probe_fla("npu"))  # PatchError: FLA missing, not on triton-ascend...
        return load_fla_kernels().chunk, f"fla chunk_gated_delta_rule ({route.reason})"

    def ascendc_chunk():
        reason = ascendc_gdn.available()
        if reason is not None:
            raise RuntimeError(reason)
        return ascendc_gdn.chunk_gated_delta_rule, ascendc_gdn.LABEL

    def torch_chunk():
        from launcher.checks.kernels.validate import torch_reference

        return torch_reference(), "transformers torch_chunk_gated_delta_rule"

    def glue(op: str, kernel: str) -> Loader:
        def load():
            if kernel == "fla" and (reason := fla_usable("npu")) is not None:
                raise RuntimeError(reason)
            return glue_kernels.glue_kernel(op, kernel), callable_name(op, kernel)

        return load

    loaders = {"chunk": {"fla": fla_chunk, "ascendc": ascendc_chunk, "torch": torch_chunk}}
    return {
        component: [
            (name, loaders[component][name] if component == "chunk" else glue(component, name)) for name in names
        ]
        for component, names in ORDER["npu"].items()
    }
