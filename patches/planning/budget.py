"""Which layers may keep their activations: measured per-layer cost, a memory budget or a count, a plan.

Checkpointing every decoder layer (``checkpoint_all_layers``) is the safe default; each layer left
un-checkpointed saves its recompute (about 1.5 % of a 27B step per layer on one H200) and costs its
activations (about 1 GiB per layer at 4,096 tokens there; docs/lab/2026-12-01-performance-options.md).
The right number depends on the device, the model and the sequence length, so it is measured, not tabled:

1. ``planning.meter.InForwardMeter`` leaves the first decoder layer of each kind (class and ``layer_type``: a
   DeltaNet and a full-attention decoder layer differ) un-checkpointed in the first training step and counts,
   inside the model's own forward, the bytes autograd keeps for its backward (parameters and the layer's own
   inputs left out: a checkpointed layer keeps its inputs too), and times the forward of the kind's second layer
   (the first pays its kernels' first call, and their compile on an empty cache). That is the cost of leaving
   one such layer un-checkpointed at this step's sequence length, and the recompute it would save.
   The ranks agree on the costs and on the plan (``planning.ranks``).
2. ``plan`` turns the costs into the layers to leave un-checkpointed: by a count, or by a budget for the
   step's peak allocated memory, projected to the run's longest sequence (``cutoff_len``): activations grow
   linearly with length (the chunked loss and the attention kernels keep nothing quadratic), so the step's
   peak above the memory held before it, and each layer's cost, are scaled by ``cutoff_len / seq_len``. The
   kind that saves the most recompute time per byte goes first; layers of a kind in model order.
3. The plan is applied after the first step (``gradient_checkpointing = False`` on the chosen layers), so it
   holds from the second step on; the rest stay checkpointed non-reentrantly, which the second step's census
   shows in the proof record.
4. With a budget, the first plan is made before anything has run it, so it prices each layer at ``PRIOR_FACTOR``
   times its count: what kernels keep outside autograd's saved tensors and the backward's working buffers were once
   measured at 1.48x the count (the side-forward meter this one replaced); layers counted in the forward have since
   taken 0.97 to 1.001 times their count in the budget runs on one H200 (docs/lab/2026-12-05-budget-pair.md). The
   second step, which runs that plan, measures the real factor from its peak (``correction``, never below 1: a layer
   is never priced under its count). Dearer than the prior, the plan is made again at the real factor and the layers
   it no longer affords are checkpointed again from the third step; cheaper, the plan made again at the real factor
   replaces it from the third step (``revised``: more layers un-checkpointed, within the budget), and that step's
   peak is held against the widened plan in turn (narrowed if it is dearer than measured, never widened twice).
   Layers are the decoder layers (those with a ``layer_type``); the frozen vision blocks save nothing worth planning.

"Step" here is one ``Trainer.training_step`` call, one micro-batch: with gradient accumulation the plan holds
from the second micro-batch of the first optimizer step.

The measured layers keep their activations through the first step, so that step's peak is above the
all-checkpointed one by (at least) what they counted; the budget plan takes that count off (``_finish_measuring``
in ``checkpoint_all_layers``). The measurement runs inside the model's forward, so it holds under FSDP2 too,
where running one wrapped layer outside the model's forward would all-gather out of order.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

GIB = 1024**3
MARGIN_GIB = 1.0  # left free under a budget: allocator fragmentation and the optimizer step
# The first budget plan assumes each un-checkpointed layer costs this much more than its saved tensors count,
# so that the second step, which runs the plan before anything corrects it, stays within the budget on a device
# where kernels keep memory outside autograd's saved tensors (27B layers once took 1.48x the count on one H200, as
# counted by the side forward this meter replaced; 0.97 to 1.001x as counted in the forward since). The
# second step measures the real factor, and the plan is narrowed or widened to it (``checkpoint_all_layers``).
PRIOR_FACTOR = 1.5


@dataclass(frozen=True)
class LayerCost:
    """What one kind of layer keeps for backward when not checkpointed, and what its forward takes."""

    kind: str
    layers: int
    saved_bytes: int
    forward_s: float
    seq_len: int


def layer_kind(layer) -> str:
    kind = type(layer).__name__
    layer_type = getattr(layer, "layer_type", None)
    return f"{kind}:{layer_type}" if layer_type else kind


@dataclass(frozen=True)
class Plan:
    """The layers left un-checkpointed, and the arithmetic behind the choice."""

    uncheckpointed: dict[str, int]  # kind -> how many layers of that kind
    projected_peak_gib: float | None
    detail: dict[str, Any]


def plan(
    costs: dict[str, LayerCost],
    *,
    count: int | None = None,
    budget_gib: float | None = None,
    peak_gib: float | None = None,
    held_gib: float | None = None,
    seq_len: int | None = None,
    cutoff_len: int | None = None,
) -> Plan:
    """Choose how many layers of each measured kind to leave un-checkpointed.

    Args:
        costs: per kind, from ``planning.meter.InForwardMeter`` (agreed by ``planning.ranks``).
        count: leave this many layers un-checkpointed (ignores the budget arguments).
        budget_gib: keep the projected peak allocated memory of a step at or under this.
        peak_gib, held_gib: the first step's peak, and what was allocated before it (weights, optimizer).
        seq_len, cutoff_len: the first step's sequence length and the run's longest.

    Returns:
        A ``Plan``; with a budget, ``projected_peak_gib`` is the peak expected at ``cutoff_len``.
    """
    order = sorted(
        (c for c in costs.values() if c.saved_bytes > 0), key=lambda c: c.forward_s / c.saved_bytes, reverse=True
    )
    scale = length_scale(seq_len, cutoff_len)
    chosen: dict[str, int] = {}
    detail: dict[str, Any] = {
        "order": [c.kind for c in order],
        "length_scale": round(scale, 4),
        "costs": {c.kind: asdict(c) for c in order},
    }
    if count is not None:
        left = count
        for cost in order:
            take = min(left, cost.layers)
            if take:
                chosen[cost.kind] = take
            left -= take
        detail["count"] = count
        return Plan(chosen, None, detail)
    assert budget_gib is not None and peak_gib is not None and held_gib is not None
    all_checkpointed = held_gib + (peak_gib - held_gib) * scale
    room = budget_gib - MARGIN_GIB - all_checkpointed
    detail.update(
        budget_gib=budget_gib,
        margin_gib=MARGIN_GIB,
        first_step_peak_gib=round(peak_gib, 3),
        held_before_step_gib=round(held_gib, 3),
        all_checkpointed_peak_gib=round(all_checkpointed, 3),
        room_gib=round(room, 3),
    )
    for cost in order:
        per_layer = cost.saved_bytes * scale / GIB
        take = min(cost.layers, max(0, math.floor(room / per_layer))) if per_layer > 0 else 0
        if take:
            chosen[cost.kind] = take
            room -= take * per_layer
    projected = projected_peak_gib(
        costs, chosen, peak_gib=peak_gib, held_gib=held_gib, seq_len=seq_len, cutoff_len=cutoff_len
    )
    return Plan(chosen, projected, detail)


def length_scale(seq_len: int | None, cutoff_len: int | None) -> float:
    """How much longer the run's longest sequence is than the measured step's (1 when it is not)."""
    return (cutoff_len / seq_len) if seq_len and cutoff_len and cutoff_len > seq_len else 1.0


def projected_peak_gib(
    costs: dict[str, LayerCost],
    chosen: dict[str, int],
    *,
    peak_gib: float,
    held_gib: float,
    seq_len: int | None,
    cutoff_len: int | None,
) -> float:
    """The peak projected at ``cutoff_len`` with ``chosen`` layers un-checkpointed: the all-checkpointed first step's
    peak above ``held_gib`` and each layer's cost, both scaled by length (``plan``'s projection)."""
    scale = length_scale(seq_len, cutoff_len)
    layers = sum(n * costs[kind].saved_bytes * scale / GIB for kind, n in chosen.items())
    return round(held_gib + (peak_gib - held_gib) * scale + layers, 3)


def correction(
    costs: dict[str, LayerCost],
    chosen: dict[str, int],
    *,
    peak_gib: float,
    held_gib: float,
    first_peak_gib: float,
    seq_len: int,
    first_seq_len: int,
) -> float:
    """The factor (>= 1) by which the un-checkpointed layers of ``chosen`` took more than counted, from a
    step's ``peak_gib`` at ``seq_len`` against the all-checkpointed first step's (both scaled by length); 1 where
    they took less (a layer is never priced under its count)."""
    scale = seq_len / first_seq_len
    all_checkpointed = held_gib + (first_peak_gib - held_gib) * scale
    counted = sum(n * costs[kind].saved_bytes for kind, n in chosen.items()) * scale / GIB
    return max(1.0, (peak_gib - all_checkpointed) / counted) if counted > 0 else 1.0


def revised(
    costs: dict[str, LayerCost],
    chosen: dict[str, int],
    factor: float,
    *,
    priced_at: float,
    may_widen: bool,
    **budget: Any,
) -> dict[str, int]:
    """The layers to keep un-checkpointed after a step that ran ``chosen`` (priced at ``priced_at`` times the
    count) measured ``factor``: dearer, the plan at ``factor`` with no kind above ``chosen`` (never un-checkpoints
    a layer the plan that ran kept checkpointed); cheaper and ``may_widen``, the plan at ``factor`` whole, which
    fits the budget by construction (the greedy order may give a later kind fewer layers than before, so a
    per-kind maximum of the two plans would not); else ``chosen``. ``budget``: ``plan``'s budget arguments."""
    widen = may_widen and factor < priced_at
    if not (factor > priced_at or widen):
        return dict(chosen)
    again = plan(scaled(costs, factor), **budget).uncheckpointed
    return again if widen else {k: min(n, again.get(k, 0)) for k, n in chosen.items()}


def scaled(costs: dict[str, LayerCost], factor: float) -> dict[str, LayerCost]:
    """The costs with every layer's saved bytes multiplied by ``factor``."""
    return {kind: replace(c, saved_bytes=int(c.saved_bytes * factor)) for kind, c in costs.items()}


def shrink_plan(model, names: list[str], keep: dict[str, int]) -> list[str]:
    """Checkpoint again the layers of ``names`` beyond ``keep[kind]`` per kind (the last ones); their names."""
    from .census import checkpoint_layers

    layers = dict(checkpoint_layers(model))
    kept: dict[str, int] = {}
    again = []
    for name in names:
        kind = layer_kind(layers[name])
        kept[kind] = kept.get(kind, 0) + 1
        if kept[kind] > keep.get(kind, 0):
            layers[name].gradient_checkpointing = True
            again.append(name)
    return again


def apply_plan(model, chosen: dict[str, int]) -> list[str]:
    """Turn checkpointing off on the first ``chosen[kind]`` layers of each kind; their names, in order."""
    from .census import checkpoint_layers

    left = dict(chosen)
    names = []
    for name, layer in checkpoint_layers(model):
        kind = layer_kind(layer)
        if left.get(kind, 0) > 0:
            layer.gradient_checkpointing = False
            left[kind] -= 1
            names.append(name)
    return names
