"""FSDP2 keeps the frozen base in its load dtype; only the trainable (LoRA) parameters get float32 masters.

Upstream behaviour (accelerate 1.11.0, ``accelerate/utils/fsdp_utils.py``, ``fsdp2_prepare_model``): after
``fully_shard`` it calls ``model.to(torch.float32)`` whenever mixed precision is on and the model is not float32,
so the frozen bf16 base of a LoRA run is held as float32 shards (twice the bytes: 101.9 GiB on one H200 for the
27B shape, 12.7 GiB per card on 8 x 910B instead of 6.4) and every all-gather casts it back to bf16.
accelerate PR #3848 limits the upcast to ``requires_grad`` parameters, before sharding; its first working release
is 1.14.0, outside LLaMA-Factory 0.9.5's pin (docs/upstream.md says why we patch rather than move).

What this patch does (a wrapper of the ``fsdp2_prepare_model`` global that ``Accelerator._prepare_fsdp2`` calls,
in ``accelerate.accelerator``):

1. with mixed precision, casts every trainable parameter that is not float32 to float32 before sharding
   (what 1.14 does), and turns accelerate's later whole-model ``model.to(torch.float32)`` into a no-op for this
   one call (an instance attribute ``to`` on the model, removed again when the preparation returns; any other
   ``to`` call passes through);
2. ``trainable_units``: ``own``: before accelerate wraps a layer, the submodules of that layer that own
   trainable parameters (the LoRA ``lora_A``/``lora_B`` of it) become one FSDP2 unit of their own
   (``fully_shard`` of the list, accelerate's own ``mesh``/``mp_policy``/``reshard_after_forward``/offload), so a
   group never mixes bf16 frozen and float32 trainable parameters: torch before 2.8 asserts "FSDP expects uniform
   original parameter dtype" for any group that mixes them (pytorch PR #154103 relaxed it to trainable parameters
   only, first in 2.8); the NPU and CUDA images pin torch 2.7.1. ``shared`` leaves them in the layer's unit
   (torch >= 2.8 only): one gather and one set of FSDP2 hooks fewer per layer with LoRA, 1.3 % of the 27B step on
   one H200 (docs/lab/2026-12-02-fsdp2-one-device.md). ``auto`` (the default) is ``shared`` where torch allows
   it, else ``own``;
3. ``embedding_units: true`` (the default): the frozen input and output embeddings (when not tied) become FSDP2
   units of their own before accelerate makes the root unit, so neither stays gathered through the decoder layers'
   backward (in the root's unit both do: 4.74 GiB for the 27B shape); the output embedding is gathered once per
   forward for all loss chunks (``_embedding_units`` says how). ``false`` leaves them in the root unit;
4. on the ``cpu`` backend, lets accelerate take FSDP at all: ``AcceleratorState.__init__`` (accelerate/state.py)
   turns ``ACCELERATE_USE_FSDP`` into ``DistributedType.FSDP`` only for accelerator device types, so a CPU job with
   ``distribution: fsdp2`` silently ran DDP over gloo. torch's ``fully_shard`` works on a CPU mesh over gloo, so
   in an FSDP2 rank on ``cpu`` only the state is switched to FSDP with the plugin the Accelerator built; NPU and
   CUDA ranks never take this branch;
5. records per rank (``planning.shards``): the dtype and local bytes of the frozen and the trainable shards, and for
   each FSDP2 unit its local bytes against the whole unit's.

Under ``distribution: ddp`` nothing calls the wrapped function and the record says so.

Versions: accelerate >=1.11.0,<1.14 (``SUPPORTED``; 1.14 does step 1 itself). Delete this patch when the lock
moves to accelerate >= 1.14 and torch >= 2.8, and a run without it shows bf16 frozen shards in this record.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Literal

from packaging.specifiers import SpecifierSet
from packaging.version import Version
from pydantic import BaseModel, ConfigDict

from .core.errors import PatchError
from .core.proof import ProofFile, utc_now
from .core.versions import require_global_loads, require_symbols
from .core.wrapping import MARKER, ORIGINAL, unwrap, wrap_once
from .planning.shards import shard_census

NAME = "fsdp2_frozen_dtype"
SUPPORTED = {"accelerate": SpecifierSet(">=1.11.0,<1.14"), "torch": SpecifierSet(">=2.7")}
MODULE = "accelerate.accelerator"
STATE_MODULE = "accelerate.state"
FUNCTION = "fsdp2_prepare_model"


class Options(BaseModel):
    """``launcher.patches.fsdp2_frozen_dtype``: ``trainable_units`` own (a unit per layer's LoRA), shared (in the
    layer's unit; torch >= 2.8) or auto (shared where torch allows it); ``embedding_units``: the frozen input and
    output embeddings as FSDP2 units of their own (else in the root's)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    enabled: bool = True
    trainable_units: Literal["auto", "own", "shared"] = "auto"
    embedding_units: bool = True


SHARED_UNITS_TORCH = (2, 8)  # pytorch PR #154103: the uniform-dtype check of a unit covers trainable parameters only

_state: dict[str, Any] = {}


def trainable_units_mode(choice: str, torch_version: str) -> str:
    """``own`` or ``shared`` for the option ``choice`` under ``torch_version``; ``shared`` before torch 2.8 is refused
    (its ``fully_shard`` would assert on the first layer that mixes bf16 and float32 parameters)."""
    allowed = Version(torch_version).release[:2] >= SHARED_UNITS_TORCH
    if choice == "auto":
        return "shared" if allowed else "own"
    if choice == "shared" and not allowed:
        raise PatchError(
            NAME,
            f'trainable_units: shared needs torch >= 2.8; torch {torch_version} asserts "FSDP '
            'expects uniform original parameter dtype" for a unit that mixes the bf16 base and the '
            "float32 LoRA parameters",
            "set launcher.patches.fsdp2_frozen_dtype.trainable_units: auto (or own)",
        )
    return choice


def fsdp2_rank() -> bool:
    """This process is a rank of an accelerate FSDP2 job (``accelerate launch`` sets both variables)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and os.environ.get("FSDP_VERSION") == "2"


def check_symbols() -> None:
    """``Accelerator._prepare_fsdp2`` still reads ``fsdp2_prepare_model`` from its module globals."""
    accelerator = require_symbols(NAME, MODULE, ("Accelerator", FUNCTION), "accelerate")
    require_global_loads(NAME, accelerator.Accelerator._prepare_fsdp2, (FUNCTION,), "accelerate")
    require_symbols(NAME, STATE_MODULE, ("AcceleratorState",), "accelerate")
    require_symbols(NAME, "accelerate.utils", ("DistributedType",), "accelerate")


def _upcast_trainable(model) -> list[str]:
    import torch

    names = []
    for name, param in model.named_parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.to(torch.float32)
            names.append(name)
    return names


def _unit_kwargs(accelerator) -> dict[str, Any]:
    """``fully_shard``'s arguments as accelerate gives them to its own units (mesh, mixed precision, offload)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    plugin = accelerator.state.fsdp_plugin
    mesh = getattr(accelerator, "torch_device_mesh", None)
    return {
        "reshard_after_forward": plugin.reshard_after_forward,
        "offload_policy": plugin.cpu_offload,
        "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy(),
        "mesh": mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)] if mesh is not None else None,
    }


def _own_units(accelerator, model) -> int:
    """One FSDP2 unit per wrapped layer for the submodules that own its trainable parameters."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from torch.distributed.fsdp import FSDPModule, fully_shard

    plugin = accelerator.state.fsdp_plugin
    plugin.set_auto_wrap_policy(model)
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    kwargs = _unit_kwargs(accelerator)
    layers = [m for m in model.modules() if policy is not None and m is not model and policy(m)]
    units = 0
    for layer in layers:
        owners = [m for m in layer.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]
        frozen = any(not p.requires_grad for p in layer.parameters())
        if owners and frozen and not isinstance(layer, FSDPModule):
            fully_shard(owners, **kwargs)
            units += 1
    return units


def _embedding_units(accelerator, model) -> list[str]:
    """The frozen input and (untied) output embeddings as FSDP2 units of their own.

    In the root unit they stay gathered from the first forward to the end of the backward (4.74 GiB for the 27B
    shape with one process, and on every rank whatever the rank count). As units of their own: the input
    embedding is gathered for its forward only (``set_unshard_in_backward(False)``: its frozen weight takes no part
    in the backward, although PEFT makes its output require a gradient); the output embedding is gathered once per
    forward, at the loss, and stays gathered through the loss's chunks (``reshard_after_forward`` and
    ``reshard_after_backward`` off) until the gradient of its input is complete (``_release_after_loss``), so one
    all-gather serves every chunk's forward, recompute and backward, and the decoder layers' backward runs without
    it."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    kwargs = _unit_kwargs(accelerator)
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if getattr(inputs, "weight", None) is getattr(outputs, "weight", False):
        return []  # tied: one weight cannot belong to two units; both stay in the root's
    made = []
    for role, module in (("input", inputs), ("output", outputs)):
        if getattr(module, "weight", None) is None or isinstance(module, FSDPModule):
            continue
        if any(p.requires_grad for p in module.parameters()):
            continue  # trained (modules_to_save): float32, and gathered through the backward anyway
        if role == "input":
            fully_shard(module, **kwargs)
            if hasattr(module, "set_unshard_in_backward"):  # where this torch has it; else gathered in backward too
                module.set_unshard_in_backward(False)
        else:
            fully_shard(module, **{**kwargs, "reshard_after_forward": False})
            _release_after_loss(module, model)
        made.append(role)
    return made


def _release_after_loss(head, model) -> None:
    """Keep ``head``'s unit gathered from its first call in a training forward until the gradient of that call's
    input (the tensor the loss chunks are views of) is complete, then reshard it; in a forward of ``model`` without
    gradients (evaluation), from its first call to the end of that forward (one gather for every loss chunk)."""
    import weakref

    import torch

    head.set_reshard_after_backward(False)
    armed: dict[str, Any] = {"base": None}

    def release(grad):
        head.reshard()
        return grad

    def before(module, args):
        inside_backward = torch._C._current_graph_task_id() != -1  # the checkpointed chunks' recompute
        if not args or not torch.is_grad_enabled() or inside_backward:
            return
        base = args[0]._base if args[0]._base is not None else args[0]
        if not base.requires_grad or (armed["base"] is not None and armed["base"]() is base):
            return
        armed["base"] = weakref.ref(base)
        base.register_hook(release)

    def after(module, args, output):
        if not torch.is_grad_enabled():
            head.reshard()

    head.register_forward_pre_hook(before)
    model.register_forward_hook(after)


def _guard_upcast(model) -> dict[str, Any]:
    """Make the next ``model.to(torch.float32)`` a no-op (the trainable parameters are float32 already)."""
    import torch

    seen: dict[str, Any] = {"intercepted": 0}
    original = type(model).to

    def to(*args, **kwargs):
        if (args == (torch.float32,) and not kwargs) or (not args and kwargs == {"dtype": torch.float32}):
            seen["intercepted"] += 1
            return model
        return original(model, *args, **kwargs)

    object.__setattr__(model, "to", to)
    return seen


def _make_prepare(original):
    def fsdp2_prepare_model(accelerator, model):
        if not _state.get("active"):
            return original(accelerator, model)
        mixed = accelerator.mixed_precision != "no"
        upcast = _upcast_trainable(model) if mixed else []
        units = _own_units(accelerator, model) if _state["trainable_units"] == "own" else 0
        embeddings = _embedding_units(accelerator, model) if _state["embedding_units"] else []
        seen = _guard_upcast(model)
        try:
            prepared = original(accelerator, model)
        finally:
            model.__dict__.pop("to", None)
        _state["proof"].update(
            preparation={
                "mixed_precision": accelerator.mixed_precision,
                "upcast_to_float32": len(upcast),
                "upcast_examples": upcast[:4],
                "whole_model_upcast_skipped": seen["intercepted"],
                "trainable_units": units,
                "trainable_units_mode": _state["trainable_units"],
                "embedding_units": embeddings,
                "distributed_type": accelerator.distributed_type.value,
                **shard_census(prepared),
                "recorded_at": utc_now(),
            }
        )
        return prepared

    return fsdp2_prepare_model


def _lift_cpu_gate() -> None:
    """In a CPU FSDP2 rank: let ``AcceleratorState`` take ``DistributedType.FSDP`` (accelerate gates it to
    accelerators), with the plugin and mixed precision it would set on an accelerator."""
    state_module = importlib.import_module(STATE_MODULE)
    from accelerate.utils import DistributedType

    cls = state_module.AcceleratorState

    def make(init):
        def __init__(self, *args, fsdp_plugin=None, **kwargs):
            init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
            if fsdp_plugin is not None and _state.get("cpu") and self.distributed_type == DistributedType.MULTI_CPU:
                self.distributed_type = DistributedType.FSDP
                if self._mixed_precision != "no":
                    fsdp_plugin.set_mixed_precision(self._mixed_precision)
                self.fsdp_plugin = fsdp_plugin
                # every later AcceleratorState() copies PartialState's shared state over its own, as on an accelerator
                state_module.PartialState._shared_state["distributed_type"] = DistributedType.FSDP
                _state["proof"].update(cpu_fsdp={"distributed_type": "FSDP", "was": "MULTI_CPU"})

        return __init__

    wrap_once(cls, "__init__", NAME, make)


def apply(options: dict[str, Any], *, backend: str, proof: ProofFile, facts: dict[str, Any]) -> dict[str, Any]:
    """Wrap accelerate's ``fsdp2_prepare_model`` (and on ``cpu`` the state's FSDP gate); idempotent."""
    import torch

    # only an FSDP2 rank builds units; `launcher check` refuses `shared` on an older torch before the run
    units = trainable_units_mode(options["trainable_units"], torch.__version__) if fsdp2_rank() else "unused"
    wrap_once(importlib.import_module(MODULE), FUNCTION, NAME, _make_prepare)  # a module global, not a method
    cpu = backend == "cpu" and fsdp2_rank()
    _state.update(active=True, proof=proof, trainable_units=units, embedding_units=options["embedding_units"], cpu=cpu)
    if cpu:
        _lift_cpu_gate()
    return {
        "replaced": [f"{MODULE}.{FUNCTION}", *([f"{STATE_MODULE}.AcceleratorState.__init__"] if cpu else [])],
        "fsdp2_rank": fsdp2_rank(),
        "cpu_fsdp_lifted": cpu,
        "trainable_units": units,
    }


def observe(*, backend: str, proof: ProofFile) -> None:
    """Disabled: accelerate 1.11 upcasts the whole model and a CPU job runs DDP; nothing is recorded."""
    restore()
    _state.update(active=False, proof=proof)


def restore() -> None:
    """Put accelerate's function and the state's ``__init__`` back if ours are outermost; forget the state."""
    module = sys.modules.get(MODULE)
    current = getattr(module, FUNCTION, None) if module is not None else None
    if getattr(current, MARKER, None) == NAME:
        setattr(module, FUNCTION, getattr(current, ORIGINAL))
    unwrap(STATE_MODULE, "AcceleratorState", "__init__", NAME)
    _state.clear()
