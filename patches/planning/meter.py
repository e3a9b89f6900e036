"""What one layer of each kind keeps for backward, measured inside the model's own forward.

During the first training step the first decoder layer of each kind (class and ``layer_type``: a DeltaNet and a
full-attention layer differ) runs un-checkpointed, and the forward hooks of that layer count what autograd
saves for its backward: a forward pre-hook enters ``torch.autograd.graph.saved_tensors_hooks`` and the forward
hook leaves it. The pack hook keeps every tensor as autograd would (the layer really keeps its activations in
this step) and adds up the storages it has not seen, leaving out the layer's parameters and its inputs: a
checkpointed layer keeps its inputs too, and parameters are no activation. That count, at this step's sequence
length, is the cost of leaving one such layer un-checkpointed.

The recompute it saves is the forward's time, taken between a layer's two hooks, on the second layer of the kind
where there is one (checkpointed, it computes the same forward): the first layer of a kind is the first to run
its kernels at this step's shapes, so its forward holds their first-call costs and, on an empty Triton cache,
their compile and autotune: on one H200 a 27B DeltaNet layer's first forward took 62.8 s on an empty cache and
0.65 s on a filled one, more than half of a whole 1.16 s step of 64 layers. Timed there, the order would rank the
kinds by what their first call costs, not by what they recompute each step. The first layer's own time is kept
beside it (``first_forward_s``). A kind with one layer is timed on that layer.

Why inside the forward: the measurement is made where the layer really runs, in the model's order, so it also
holds under FSDP2, whose pre-forward hook (registered with ``prepend=True``, torch
``distributed/fsdp/_fully_shard/_fsdp_state.py``) has all-gathered the layer's parameters before ours runs, and
whose post-forward hook reshards them before ours ends. The parameters' storages are looked up again at each
saved tensor, since under FSDP2 the unsharded parameters exist only during the layer's forward (and a nested
unit's only during its own). It draws no random numbers and runs nothing twice, so the step computes what an
all-checkpointed step computes; what it costs is the measured layers' activations held through step 1.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from .budget import LayerCost, layer_kind


def _tensors(value: Any) -> list:
    """Every tensor in a layer's positional or keyword arguments (nested tuples, lists and dicts)."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _storage(tensor) -> tuple[int, int] | None:
    """``(data_ptr, nbytes)`` of a tensor's storage; None for a tensor without one: a wrapper subclass such as
    the DTensor of an FSDP2 parameter (its python storage is invalid)."""
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _sync(device) -> None:
    import torch

    if device is not None and device.type != "cpu":
        synchronize = getattr(getattr(torch, device.type, None), "synchronize", None)
        if synchronize is not None:
            synchronize()


def _elapsed(started: float, device) -> float:
    """Seconds since ``started`` once ``device`` has finished what was queued."""
    _sync(device)
    return time.perf_counter() - started


class SavedBytes:
    """The pack and unpack hooks that count what one layer's forward saves (see the module docstring)."""

    def __init__(self, layer, inputs: list) -> None:
        self.layer = layer
        self.inputs = {s[0] for s in map(_storage, inputs) if s is not None}
        self.params: set[int] = set()
        self.seen: dict[int, int] = {}
        self.unknown = 0  # tensors without a storage, counted by their own size
        self.error: str | None = None

    def _is_parameter(self, ptr: int) -> bool:
        if ptr not in self.params:  # parameters may have been gathered since the last look (FSDP2)
            self.params = {s[0] for s in (_storage(p) for p in self.layer.parameters()) if s is not None}
        return ptr in self.params

    def pack(self, tensor):
        try:
            found = _storage(tensor)
            if found is None:
                self.unknown += tensor.nelement() * tensor.element_size()
            elif found[1] and found[0] not in self.inputs and not self._is_parameter(found[0]):
                self.seen[found[0]] = max(self.seen.get(found[0], 0), found[1])
        except Exception as exc:  # counting must never stop the step; the plan says what went wrong
            self.error = f"{type(exc).__name__}: {exc}"
        return tensor

    @staticmethod
    def unpack(tensor):
        return tensor

    def total(self) -> int:
        return sum(self.seen.values()) + self.unknown


class InForwardMeter:
    """Leaves the first decoder layer of each kind un-checkpointed for one step and measures it there.

    ``layers`` are ``(name, layer)`` pairs in model order (``census.checkpoint_layers``); only those
    with a ``layer_type`` (decoder layers) are planned. After the step, ``costs`` holds one ``LayerCost`` per kind
    measured, ``errors`` why a kind was not, ``measured`` the layer whose saved tensors were counted for each kind,
    ``timed`` the layer whose forward gave ``forward_s`` (the kind's second, where it has one: module docstring),
    ``first_forward_s`` the measured layer's own forward time; ``close()`` removes the hooks (the caller then sets
    every layer's checkpointing as its plan says).
    """

    def __init__(self, layers: list[tuple[str, Any]]) -> None:
        self.layers_by_kind: dict[str, int] = {}
        self.measured: dict[str, str] = {}
        self.timed: dict[str, str] = {}
        self.costs: dict[str, LayerCost] = {}
        self.first_forward_s: dict[str, float] = {}
        self.errors: dict[str, str] = {}
        self.seq_len: int | None = None
        self._open: dict[str, tuple] = {}  # kind -> (counter, hooks, start, seq_len, device) while it runs
        self._clock: dict[str, tuple[float, Any]] = {}  # kind -> (start, device) while its timed layer runs
        self._timed: set[str] = set()  # kinds whose timed layer has started its one timed forward
        self._handles = []
        for name, layer in layers:
            if not getattr(layer, "layer_type", None):  # the frozen vision blocks keep nothing worth planning
                continue
            kind = layer_kind(layer)
            self.layers_by_kind[kind] = self.layers_by_kind.get(kind, 0) + 1
            if kind in self.measured:
                if kind not in self.timed:
                    self.timed[kind] = name
                    self._handles.append(layer.register_forward_pre_hook(self._time_pre(kind), with_kwargs=True))
                    self._handles.append(
                        layer.register_forward_hook(self._time_post(kind), with_kwargs=True, always_call=True)
                    )
                continue
            self.measured[kind] = name
            layer.gradient_checkpointing = False
            self._handles.append(layer.register_forward_pre_hook(self._pre(kind), with_kwargs=True))
            self._handles.append(layer.register_forward_hook(self._post(kind), with_kwargs=True, always_call=True))
        for kind, name in self.measured.items():
            self.timed.setdefault(kind, name)

    @property
    def measured_bytes(self) -> int:
        """What the measured layers kept through this step (one layer per measured kind)."""
        return sum(cost.saved_bytes for cost in self.costs.values())

    def _pre(self, kind: str):
        def pre_hook(module, args, kwargs):
            import torch

            if kind in self.costs or kind in self.errors or not (torch.is_grad_enabled() and module.training):
                return None
            try:
                inputs = _tensors(args) + _tensors(kwargs)
                hidden = inputs[0]
                counter = SavedBytes(module, inputs)
                hooks = torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack)
                _sync(hidden.device)
                hooks.__enter__()
                self._open[kind] = (counter, hooks, time.perf_counter(), int(hidden.shape[-2]), hidden.device)
            except Exception as exc:  # measuring must never stop a step; the plan then says why
                self.errors[kind] = f"{type(exc).__name__}: {exc}"
            return None

        return pre_hook

    def _post(self, kind: str):
        def post_hook(module, args, kwargs, output):
            if kind not in self._open:
                return None
            counter, hooks, started, seq_len, device = self._open.pop(kind)
            hooks.__exit__(None, None, None)  # also after an error in the forward (always_call)
            seconds = _elapsed(started, device)
            if counter.error is not None:
                self.errors[kind] = counter.error
                return None
            self.costs[kind] = LayerCost(kind, self.layers_by_kind[kind], counter.total(), round(seconds, 6), seq_len)
            self.first_forward_s[kind] = round(seconds, 6)
            self.seq_len = max(self.seq_len or 0, seq_len)
            return None

        return post_hook

    def _time_pre(self, kind: str):
        def pre_hook(module, args, kwargs):
            # once, in the forward of the step that measured the kind's first layer (not in its recompute)
            if kind not in self.costs or kind in self._timed or not module.training:
                return None
            self._timed.add(kind)
            device = next((t.device for t in _tensors(args) + _tensors(kwargs)), None)
            _sync(device)
            self._clock[kind] = (time.perf_counter(), device)
            return None

        return pre_hook

    def _time_post(self, kind: str):
        def post_hook(module, args, kwargs, output):
            if kind not in self._clock:
                return None
            started, device = self._clock.pop(kind)
            self.costs[kind] = replace(self.costs[kind], forward_s=round(_elapsed(started, device), 6))
            return None

        return post_hook

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
