"""Which layers may keep their activations: measured per-layer cost, a memory budget or a count, a plan.

Checkpointing every decoder layer (``checkpoint_all_layers``) is the safe default; each layer left
un-checkpointed saves its recompute (about 1.5 % of a 27B step per layer on one H200) and costs its
activations (about 1 GiB per layer at 4,096 tokens there; docs/benchmarks.md). The right number depends on
the device, the model and the sequence length, so it is measured, not tabled:

1. ``LayerMeter`` wraps the checkpoint function during the first training step. At the first call of each
   kind of layer (class and ``layer_type``: a DeltaNet and a full-attention decoder layer differ), it runs that
   layer's forward once more, outside the checkpoint, under ``torch.autograd.graph.saved_tensors_hooks`` that
   count the bytes autograd would keep (parameters and the layer's own inputs left out: a checkpointed layer
   keeps its inputs too) and keep nothing, and times it. That is the cost of leaving one such layer
   un-checkpointed at this step's sequence length, and the recompute it would save.
2. ``plan`` turns the costs into the layers to leave un-checkpointed: by a count, or by a budget for the
   step's peak allocated memory, projected to the run's longest sequence (``cutoff_len``): activations grow
   linearly with length (the chunked loss and the attention kernels keep nothing quadratic), so the step's
   peak above the memory held before it, and each layer's cost, are scaled by ``cutoff_len / seq_len``. The
   kind that saves the most recompute time per byte goes first; layers of a kind in model order.
3. The plan is applied after the first step (``gradient_checkpointing = False`` on the chosen layers), so it
   holds from the second step on; the rest stay checkpointed non-reentrantly, which the second step's census
   shows in the proof record.
4. With a budget, the saved-tensor count misses memory that kernels keep outside autograd's saved tensors and
   the backward's working buffers (on one H200 the 27B layers took 1.48x what was counted), so the first plan
   prices each layer at ``PRIOR_FACTOR`` times its count, and the second step, which runs that plan, measures
   the real factor from its peak (``correction``); if it is above the prior, the plan is made again with the
   costs scaled by it and the layers it no longer affords are checkpointed again from the third step (a plan
   is never widened). Layers are the decoder layers (those with a ``layer_type``); the frozen vision blocks
   save nothing worth planning.

"Step" here is one ``Trainer.training_step`` call, one micro-batch: with gradient accumulation the plan holds
from the second micro-batch of the first optimizer step.

The side forward keeps nothing (the hooks drop what they count), so it adds one layer's transient memory,
not its activations. It is not run under FSDP, where calling one wrapped layer outside the model's forward
would all-gather out of order; ``launcher check`` refuses the options there.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

GIB = 1024**3
MARGIN_GIB = 1.0  # left free under a budget: allocator fragmentation and the optimizer step
# The first budget plan assumes each un-checkpointed layer costs this much more than its saved tensors count,
# so that the second step, which runs the plan before anything corrects it, stays within the budget: the
# 27B layers on one H200 took 1.48x the count (docs/benchmarks.md). The second step measures the real factor.
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


def _saved_bytes(function, args) -> tuple[int, float]:
    """Bytes autograd saves running ``function(*args)`` (parameters and ``args`` excluded), and its seconds."""
    import torch

    layer = getattr(getattr(function, "func", None), "__self__", None)
    excluded = {p.data_ptr() for p in (layer.parameters() if layer is not None else ())}
    excluded |= {a.data_ptr() for a in args if isinstance(a, torch.Tensor)}
    seen: dict[int, int] = {}

    def pack(tensor):
        if tensor.data_ptr() not in excluded:
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return None

    def unpack(_):
        raise RuntimeError("the measuring forward keeps nothing for backward")

    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    sync = getattr(getattr(torch, device.type, None), "synchronize", None) if device is not None else None
    on_device = device is not None and device.type != "cpu"
    devices, kind = ([device.index or 0], device.type) if on_device else ([], "cuda")
    rng = torch.random.fork_rng(devices=devices, device_type=kind)  # dropout draws: leave training's RNG as is
    with rng, torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        if sync is not None and on_device:
            sync()
        started = time.perf_counter()
        out = function(*args)
        if sync is not None and on_device:
            sync()
        seconds = time.perf_counter() - started
    del out
    return sum(seen.values()), seconds


class LayerMeter:
    """A checkpoint function that measures one layer of each kind at its first call, then checkpoints."""

    def __init__(self, checkpoint_func, layers_by_kind: dict[str, int]) -> None:
        self.checkpoint_func = checkpoint_func
        self.layers_by_kind = layers_by_kind
        self.costs: dict[str, LayerCost] = {}
        self.errors: dict[str, str] = {}
        self.__wrapped__ = checkpoint_func  # describe_checkpoint_func follows it

    def __call__(self, function, *args, **kwargs):
        import torch

        out = self.checkpoint_func(function, *args, **kwargs)  # first, so the step's census sees the real call
        layer = getattr(getattr(function, "func", None), "__self__", None)
        kind = layer_kind(layer) if layer is not None else None
        if (
            kind in self.layers_by_kind
            and kind not in self.costs
            and kind not in self.errors
            and torch.is_grad_enabled()
        ):
            try:
                saved, seconds = _saved_bytes(function, args)
                hidden = next(a for a in args if isinstance(a, torch.Tensor))
                self.costs[kind] = LayerCost(kind, self.layers_by_kind.get(kind, 0), saved, round(seconds, 6),
                                             int(hidden.shape[-2]))  # fmt: skip
            except Exception as exc:  # measuring must never stop a step; the plan then says why
                self.errors[kind] = f"{type(exc).__name__}: {exc}"
        return out


@dataclass(frozen=True)
class Plan:
    """The layers left un-checkpointed, and the arithmetic behind the choice."""

    uncheckpointed: dict[str, int]  # kind -> how many layers of that kind
    projected_peak_gib: float | None
    detail: dict[str, Any]


def plan(costs: dict[str, LayerCost], *, count: int | None = None, budget_gib: float | None = None,
         peak_gib: float | None = None, held_gib: float | None = None, seq_len: int | None = None,
         cutoff_len: int | None = None) -> Plan:  # fmt: skip
    """Choose how many layers of each measured kind to leave un-checkpointed.

    Args:
        costs: per kind, from ``LayerMeter``.
        count: leave this many layers un-checkpointed (ignores the budget arguments).
        budget_gib: keep the projected peak allocated memory of a step at or under this.
        peak_gib, held_gib: the first step's peak, and what was allocated before it (weights, optimizer).
        seq_len, cutoff_len: the first step's sequence length and the run's longest.

    Returns:
        A ``Plan``; with a budget, ``projected_peak_gib`` is the peak expected at ``cutoff_len``.
    """
    order = sorted((c for c in costs.values() if c.saved_bytes > 0), key=lambda c: c.forward_s / c.saved_bytes,
                   reverse=True)  # fmt: skip
    scale = (cutoff_len / seq_len) if seq_len and cutoff_len and cutoff_len > seq_len else 1.0
    chosen: dict[str, int] = {}
    detail: dict[str, Any] = {"order": [c.kind for c in order], "length_scale": round(scale, 4),
                              "costs": {c.kind: asdict(c) for c in order}}  # fmt: skip
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
    projected = held_gib + (peak_gib - held_gib) * scale
    room = budget_gib - MARGIN_GIB - projected
    detail.update(budget_gib=budget_gib, margin_gib=MARGIN_GIB, first_step_peak_gib=round(peak_gib, 3),
                  held_before_step_gib=round(held_gib, 3), all_checkpointed_peak_gib=round(projected, 3),
                  room_gib=round(room, 3))  # fmt: skip
    for cost in order:
        per_layer = cost.saved_bytes * scale / GIB
        take = min(cost.layers, max(0, math.floor(room / per_layer))) if per_layer > 0 else 0
        if take:
            chosen[cost.kind] = take
            room -= take * per_layer
            projected += take * per_layer
    return Plan(chosen, round(projected, 3), detail)


def correction(costs: dict[str, LayerCost], chosen: dict[str, int], *, peak_gib: float, held_gib: float,
               first_peak_gib: float, seq_len: int, first_seq_len: int) -> float:  # fmt: skip
    """The factor (>= 1) by which the un-checkpointed layers of ``chosen`` took more than counted, from a
    step's ``peak_gib`` at ``seq_len`` against the all-checkpointed first step's (both scaled by length)."""
    scale = seq_len / first_seq_len
    all_checkpointed = held_gib + (first_peak_gib - held_gib) * scale
    counted = sum(n * costs[kind].saved_bytes for kind, n in chosen.items()) * scale / GIB
    return max(1.0, (peak_gib - all_checkpointed) / counted) if counted > 0 else 1.0


def scaled(costs: dict[str, LayerCost], factor: float) -> dict[str, LayerCost]:
    """The costs with every layer's saved bytes multiplied by ``factor``."""
    return {kind: replace(c, saved_bytes=int(c.saved_bytes * factor)) for kind, c in costs.items()}


def shrink_plan(model, names: list[str], keep: dict[str, int]) -> list[str]:
    """Checkpoint again the layers of ``names`` beyond ``keep[kind]`` per kind (the last ones); their names."""
    from .checkpoint_census import checkpoint_layers

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
    from .checkpoint_census import checkpoint_layers

    left = dict(chosen)
    names = []
    for name, layer in checkpoint_layers(model):
        kind = layer_kind(layer)
        if left.get(kind, 0) > 0:
            layer.gradient_checkpointing = False
            left[kind] -= 1
            names.append(name)
    return names
