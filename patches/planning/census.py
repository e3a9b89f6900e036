"""Count how a model's layers are checkpointed: as configured, and as they actually ran in one step.

Configured: every ``GradientCheckpointingLayer`` has a ``gradient_checkpointing`` flag and a
``_gradient_checkpointing_func`` (transformers 5.6.0 ``modeling_layers.py``: when the flag is set and the
module is training, ``__call__`` runs ``self._gradient_checkpointing_func(partial(super().__call__, ...))``).
The flag alone proves little: LLaMA-Factory 0.9.5 sets it on every layer but installs a function that
skips checkpointing for layers without trainable parameters.

Observed: ``StepObserver`` puts a forward pre-hook on every such layer and looks, at the layer's first
forward, at how autograd is set up around it:

- inside a non-reentrant ``torch.utils.checkpoint.checkpoint`` the top saved-tensor hooks are the
  checkpoint's own (``torch.utils.checkpoint._checkpoint_hook``) -> ``non_reentrant``;
- a reentrant checkpoint runs the forward under ``no_grad`` -> ``reentrant``;
- otherwise -> ``not_checkpointed``; a layer that never ran (a vision block on text data) -> ``not_run``.

The saved-tensor hook query is a private torch API (present in torch 2.6-2.14); without it the
observation says ``unknown`` instead of guessing.
"""

from __future__ import annotations

from collections import Counter
from functools import partial
from typing import Any

OBSERVED_MODES = ("non_reentrant", "reentrant", "not_checkpointed", "not_run", "unknown")


def describe_checkpoint_func(func: Any) -> str | None:
    """A readable name for a layer's ``_gradient_checkpointing_func``, following wrappers."""
    if func is None:
        return None
    if isinstance(func, partial):
        kwargs = ", ".join(f"{k}={v!r}" for k, v in sorted(func.keywords.items()))
        inner = func.func
        return f"{getattr(inner, '__module__', '?')}.{getattr(inner, '__qualname__', repr(inner))}({kwargs})"
    name = getattr(func, "__qualname__", type(func).__qualname__)
    wrapped = getattr(func, "__wrapped__", None)
    return f"{name} -> {describe_checkpoint_func(wrapped)}" if wrapped is not None else name


def checkpoint_layers(model) -> list[tuple[str, Any]]:
    """``(name, module)`` of every ``GradientCheckpointingLayer`` in ``model`` (wrappers included)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [(name, module) for name, module in model.named_modules() if isinstance(module, GradientCheckpointingLayer)]


def fsdp_units(model) -> dict[str, int] | None:
    """``{"version": 2, "units": n}`` for FSDP2 (``FSDPModule``), version 1 for FSDP1, None without FSDP."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6
        FSDPModule = None
    from torch.distributed.fsdp import FullyShardedDataParallel

    modules = list(model.modules())
    if FSDPModule is not None:
        units = sum(isinstance(module, FSDPModule) for module in modules)
        if units:
            return {"version": 2, "units": units}
    units = sum(isinstance(module, FullyShardedDataParallel) for module in modules)
    return {"version": 1, "units": units} if units else None


def _mode_now() -> str:
    import torch

    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooks = top(False) if top is not None else None
    if hooks and getattr(hooks[0], "__module__", "") == "torch.utils.checkpoint":
        return "non_reentrant"
    if not torch.is_grad_enabled():
        return "reentrant"
    return "not_checkpointed" if top is not None else "unknown"


class StepObserver:
    """Observe, for one training step, how every checkpointable layer's forward ran."""

    def __init__(self, model) -> None:
        self.layers = checkpoint_layers(model)
        self.configured = [self._configured(name, layer) for name, layer in self.layers]
        self.observed: dict[str, str] = {}
        self.calls: Counter[str] = Counter()  # forward calls in the step: 2 where the backward recomputed the layer
        self.handles = [layer.register_forward_pre_hook(self._hook(name)) for name, layer in self.layers]
        self.fsdp = fsdp_units(model)

    @staticmethod
    def _configured(name: str, layer) -> dict[str, Any]:
        entry = {
            "name": name,
            "class": type(layer).__name__,
            "gradient_checkpointing": bool(getattr(layer, "gradient_checkpointing", False)),
            "function": describe_checkpoint_func(getattr(layer, "_gradient_checkpointing_func", None)),
            "trainable": any(p.requires_grad for p in layer.parameters()),
        }
        if getattr(layer, "layer_type", None) is not None:
            entry["layer_type"] = layer.layer_type
        return entry

    def _hook(self, name: str):
        def pre_hook(module, args):
            self.observed.setdefault(name, _mode_now())  # the first call is the forward, later ones recompute
            self.calls[name] += 1

        return pre_hook

    def finish(self) -> dict[str, Any]:
        """Remove the hooks and summarise; safe to call once the step is over."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        layers = [
            {**entry, "observed": self.observed.get(entry["name"], "not_run"), "calls": self.calls[entry["name"]]}
            for entry in self.configured
        ]
        return {
            "layers": len(layers),
            "gradient_checkpointing_true": sum(entry["gradient_checkpointing"] for entry in layers),
            "functions": dict(Counter(entry["function"] for entry in layers if entry["gradient_checkpointing"])),
            "observed": dict(Counter(entry["observed"] for entry in layers)),
            "recomputed": sum(entry["calls"] > 1 for entry in layers),  # layers whose forward ran again in the backward
            "by_class": _group(layers, "class"),
            "by_layer_type": _group([e for e in layers if "layer_type" in e], "layer_type"),
            "fsdp": self.fsdp,
            "layers_detail": layers,
        }


def _group(layers: list[dict[str, Any]], key: str) -> dict[str, dict[str, Any]]:
    groups: dict[str, dict[str, Any]] = {}
    for entry in layers:
        group = groups.setdefault(entry[key], {"layers": 0, "gradient_checkpointing_true": 0, "observed": Counter()})
        group["layers"] += 1
        group["gradient_checkpointing_true"] += entry["gradient_checkpointing"]
        group["observed"][entry["observed"]] += 1
    return {name: {**group, "observed": dict(group["observed"])} for name, group in groups.items()}
