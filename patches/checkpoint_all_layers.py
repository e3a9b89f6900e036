"""Checkpoint every decoder layer and vision block non-reentrantly, frozen layers included.

Upstream behaviour (LLaMA-Factory 0.9.5, ``src/llamafactory/model/model_utils/checkpointing.py``):
``prepare_model_for_training`` replaces ``model.gradient_checkpointing_enable`` with
``partial(_gradient_checkpointing_enable, ...)``, looking ``_gradient_checkpointing_enable`` up in its module
globals at call time. That function defaults to ``use_reentrant=True`` and wraps the checkpoint function so
that a layer is checkpointed only if it owns a trainable parameter. With LoRA on ``q,k,v,o`` only the
full-attention layers qualify: on Qwen3.5-27B the 48 Gated DeltaNet layers and their MLPs run
un-checkpointed although gradients flow through them (111.8 GiB peak instead of 66.9 GiB at 4096 tokens,
docs/lab/2026-11-30-patches-on-off.md). LLaMA-Factory turns non-reentrant on by itself only under FSDP2;
the trainable-only rule stays either way. The HF ``Trainer`` (transformers 5.6.0, ``_inner_training_loop``) calls
``model.gradient_checkpointing_enable(args.gradient_checkpointing_kwargs)`` again just before the loop, so a
fix made only at model build time could be undone.

What this patch does:

1. replaces the module global ``_gradient_checkpointing_enable`` with ours (same signature), so model
   preparation and the Trainer's re-enable both set ``partial(torch.utils.checkpoint.checkpoint,
   use_reentrant=False)`` on every module carrying a ``gradient_checkpointing`` flag (exactly the modules
   ``PreTrainedModel._set_gradient_checkpointing`` would set: every ``GradientCheckpointingLayer`` plus the
   text/vision model flags). Other requested checkpoint kwargs are kept; ``use_reentrant`` is forced off
   and the requested value is recorded. ``use_unsloth_gc: true`` is refused (it is a different mechanism).
2. at the first real ``Trainer.training_step`` (``trainer_hook``), applies the same again to the model the
   Trainer hands over (PEFT/DDP/FSDP wrappers included), unless the LLaMA-Factory config asked for no
   checkpointing at all, and records what the step actually did (``planning.census``), including the
   number of FSDP units.

3. optionally leaves some layers un-checkpointed, chosen from costs measured on this model at this run's
   sequence length (``planning.budget``): ``uncheckpointed_layers: N``, or ``memory_budget_gib: G`` for the
   step's peak allocated memory (CUDA and NPU, which report it). The first layer of each kind is measured
   inside the model's own forward in the first step (``planning.meter``), so the same mechanism serves one
   process, DDP and FSDP2; the ranks agree on one plan (``planning.ranks``). The plan is made at the end of the
   first step and holds from the second, whose census is recorded as ``second_training_step``; with a budget the
   second step's peak corrects it (``plan_correction``: narrowed, or widened from the third step, whose census
   and peak are recorded too, ``third_training_step`` and ``plan_recheck``). The default leaves every layer
   checkpointed.
4. optionally keeps the inputs the checkpointed layers save for their backward in pinned host memory
   (``offload_inputs``; ``patches.planning.offload``): copied out and back on a side stream, the next layer's input
   prefetched during the backward. ``true`` / ``false``, or ``auto`` (the default): on when the launcher's memory
   forecast says the run would not fit the device without it and would with it (preflight decides and passes the
   decision in the run's facts, ``offload_inputs``; without a decision it stays off). The setting, the decision and
   its reason are recorded as ``offload_inputs``, with what the first step moved. Off, no hook is installed.

When the patch is turned off, the first-step observation still runs (it only reads), so the record shows
what LLaMA-Factory did by itself.

Versions: written and tested against llamafactory 0.9.5 and transformers 5.6.0 (``SUPPORTED``).
Delete this patch when LLaMA-Factory checkpoints frozen layers (or offers an option for it) and defaults to
non-reentrant checkpointing, and the first-step record of a run without the patch shows every decoder layer
``non_reentrant``.
"""

from __future__ import annotations

import importlib
import logging
import sys
from dataclasses import asdict
from functools import partial
from typing import Any, Literal

from packaging.specifiers import SpecifierSet
from pydantic import BaseModel, ConfigDict, Field, model_validator

from .core import trainer_hook
from .core.errors import PatchError
from .core.proof import ProofFile, utc_now
from .core.versions import require_global_loads, require_symbols
from .planning.budget import (
    GIB,
    PRIOR_FACTOR,
    apply_plan,
    correction,
    plan,
    projected_peak_gib,
    revised,
    scaled,
    shrink_plan,
)
from .planning.census import StepObserver, checkpoint_layers, describe_checkpoint_func
from .planning.meter import InForwardMeter
from .planning.offload import MIN_BYTES, OffloadedCheckpoint, Offloader
from .planning.ranks import agree_costs, agree_counts

logger = logging.getLogger(__name__)

NAME = "checkpoint_all_layers"
SUPPORTED = {"llamafactory": SpecifierSet(">=0.9.5,<0.9.6"), "transformers": SpecifierSet(">=5.6.0,<5.7")}
LF_MODULE = "llamafactory.model.model_utils.checkpointing"
_MARKER = "__deltanet_launcher_patch__"


class Options(BaseModel):
    """``launcher.patches.checkpoint_all_layers``: ``uncheckpointed_layers`` (a count) or ``memory_budget_gib``
    (a peak per device) lets measured layers keep their activations; neither (the default): every layer."""

    model_config = ConfigDict(extra="forbid", strict=True)
    enabled: bool = True
    uncheckpointed_layers: int | None = Field(None, ge=0)
    memory_budget_gib: float | None = Field(None, gt=0)
    offload_inputs: bool | Literal["auto"] = "auto"

    @model_validator(mode="after")
    def _one_way(self) -> Options:
        if self.uncheckpointed_layers is not None and self.memory_budget_gib is not None:
            raise ValueError("set uncheckpointed_layers or memory_budget_gib, not both")
        if not self.enabled and self.offload_inputs is True:
            raise ValueError("offload_inputs: true needs the patch enabled (it offloads what its checkpointing saves)")
        return self


def offload_decision(setting: bool | str, facts: dict[str, Any]) -> dict[str, Any]:
    """``{"setting", "on", "reason"}``: ``offload_inputs`` as set, or for ``auto`` the launcher's decision from the
    memory forecast (``facts["offload_inputs"]``, written by preflight), off when there is none."""
    if setting is True or setting is False:
        return {"setting": setting, "on": setting, "reason": f"offload_inputs: {str(setting).lower()} in the config"}
    decided = facts.get("offload_inputs")
    if isinstance(decided, dict) and isinstance(decided.get("on"), bool):
        return {"setting": "auto", "on": decided["on"], "reason": str(decided.get("reason") or "")}
    return {
        "setting": "auto",
        "on": False,
        "reason": "auto: no decision from the memory forecast in this run's facts (preflight's memory row did not "
        "run); left off",
    }


def check_symbols() -> None:
    """LLaMA-Factory's function exists and is still looked up at call time; the transformers hooks exist."""
    lf = require_symbols(
        NAME, LF_MODULE, ("_gradient_checkpointing_enable", "prepare_model_for_training"), "llamafactory"
    )
    require_global_loads(NAME, lf.prepare_model_for_training, ("_gradient_checkpointing_enable",), "llamafactory")
    require_symbols(NAME, "transformers.modeling_layers", ("GradientCheckpointingLayer",), "transformers")
    transformers = require_symbols(NAME, "transformers", ("Trainer",), "transformers")
    if not callable(getattr(transformers.Trainer, "training_step", None)):
        raise PatchError(NAME, "transformers.Trainer has no training_step", "install transformers>=5.6.0,<5.7")


def non_reentrant_checkpoint(**kwargs: Any) -> partial:
    """``torch.utils.checkpoint.checkpoint`` with ``use_reentrant=False`` and any other given kwargs."""
    from torch.utils.checkpoint import checkpoint

    return partial(checkpoint, **{**kwargs, "use_reentrant": False})


def checkpoint_every_layer(model, func) -> int:
    """Enable checkpointing with ``func`` on every module that has a ``gradient_checkpointing`` flag.

    Returns:
        How many of them are ``GradientCheckpointingLayer`` modules.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = 0
    for module in model.modules():
        if hasattr(module, "gradient_checkpointing"):
            module._gradient_checkpointing_func = func
            module.gradient_checkpointing = True
            layers += isinstance(module, GradientCheckpointingLayer)
    return layers


_state: dict[str, Any] = {}


def _gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, use_unsloth_gc: bool = False) -> None:
    """Stands in for LLaMA-Factory's function of the same name: every layer, non-reentrant."""
    if not self.supports_gradient_checkpointing:
        raise ValueError(f"{self.__class__.__name__} does not support gradient checkpointing.")
    if use_unsloth_gc:
        raise PatchError(
            NAME,
            "the LLaMA-Factory config sets use_unsloth_gc: true, Unsloth's CPU-offloading checkpoint, which "
            "this patch would replace (and which hard-codes CUDA)",
            "remove use_unsloth_gc from the LLaMA-Factory config, or turn this patch off with "
            "launcher.patches.checkpoint_all_layers: false",
        )
    requested = dict(gradient_checkpointing_kwargs or {})
    func = _with_offload(non_reentrant_checkpoint(**{k: v for k, v in requested.items() if k != "use_reentrant"}))
    layers = checkpoint_every_layer(self, func)
    _state["func"] = func
    calls = _state.setdefault("enable_calls", [])
    calls.append(
        {
            "requested_kwargs": requested,
            "function": describe_checkpoint_func(func),
            "checkpoint_layers": layers,
            "at": utc_now(),
        }
    )
    if _state.get("proof") is not None:
        _state["proof"].update(model_preparation={"enable_calls": calls})


setattr(_gradient_checkpointing_enable, _MARKER, NAME)


def _offloader(backend: str) -> Offloader:
    """The run's offloader; on cpu every input is taken (the tiny test models' are below ``MIN_BYTES``), so that the
    CPU tests drive the copies the accelerators make."""
    return Offloader(backend, min_bytes=0 if backend == "cpu" else MIN_BYTES)


def _with_offload(func):
    """``func`` inside the offloader's hooks when ``offload_inputs`` is on; ``func`` itself otherwise."""
    offloader = _state.get("offloader")
    return OffloadedCheckpoint(func, offloader) if offloader is not None else func


def _memory(backend: str):
    """The backend's allocator counters (``torch.cuda`` or ``torch.npu``), or None on CPU."""
    import torch

    module = getattr(torch, backend, None) if backend in ("cuda", "npu") else None
    return module if module is not None and hasattr(module, "max_memory_allocated") else None


def apply(options: dict[str, Any], *, backend: str, proof: ProofFile, facts: dict[str, Any]) -> dict[str, Any]:
    """Install the replacement and the first-step hook; idempotent (the original is saved once)."""
    if options.get("memory_budget_gib") is not None and _memory(backend) is None:
        raise PatchError(
            NAME,
            f"memory_budget_gib needs a device that reports its peak allocated memory (cuda, npu); the backend is "
            f"{backend}",
            "use uncheckpointed_layers: N on cpu, or leave both unset to checkpoint every layer",
        )
    lf = importlib.import_module(LF_MODULE)
    if getattr(lf._gradient_checkpointing_enable, _MARKER, None) != NAME:
        _state["original"] = lf._gradient_checkpointing_enable
    lf._gradient_checkpointing_enable = _gradient_checkpointing_enable
    offload = offload_decision(options.get("offload_inputs", "auto"), facts)
    _state.update(offload=offload, offloader=_offloader(backend) if offload["on"] else None)
    _state.update(
        proof=proof,
        enabled=True,
        enable_calls=[],
        func=_with_offload(non_reentrant_checkpoint()),
        backend=backend,
        count=options.get("uncheckpointed_layers"),
        budget=options.get("memory_budget_gib"),
        cutoff_len=facts.get("cutoff_len"),
    )
    trainer_hook.on_first_training_step(NAME, before=_before_first_step, after=_after_first_step)
    return {
        "replaced": [
            f"{LF_MODULE}._gradient_checkpointing_enable",
            "transformers.Trainer.training_step (first call)",
        ],
        "function": describe_checkpoint_func(_state["func"]),
        "offload_inputs": offload,
    }


def observe(*, backend: str, proof: ProofFile) -> None:
    """Disabled: leave LLaMA-Factory alone, but record what its checkpointing did at the first step."""
    restore()
    _state.update(proof=proof, enabled=False, count=None, budget=None)
    trainer_hook.on_first_training_step(NAME, before=_before_first_step, after=_after_first_step)


def restore() -> None:
    """Put LLaMA-Factory's function back if we replaced it, and forget this process's state."""
    lf = sys.modules.get(LF_MODULE)
    if lf is not None and "original" in _state:
        lf._gradient_checkpointing_enable = _state["original"]
    _state.clear()


def _before_first_step(trainer, model) -> None:
    info: dict[str, Any] = {}
    if _state["enabled"]:
        requested = bool(_state["enable_calls"]) or bool(getattr(trainer.args, "gradient_checkpointing", False))
        if requested:
            info["reapplied_layers"] = checkpoint_every_layer(model, _state["func"])
            if _state["count"] is not None or _state["budget"] is not None:
                _start_measuring(model, info)
        else:
            info["reapplied_layers"] = 0
            info["note"] = (
                "the LLaMA-Factory config asks for no gradient checkpointing "
                "(disable_gradient_checkpointing: true and gradient_checkpointing: false); left off"
            )
    try:
        _state["observer"] = StepObserver(model)
    except Exception as exc:  # observing must never stop a run
        logger.exception("cannot observe checkpointing at the first training step")
        _state["proof"].update(first_training_step={**info, "observer_error": f"{type(exc).__name__}: {exc}"})
        _state["observer"] = None
    _state["first_step_info"] = info


def _after_first_step(trainer, model) -> None:
    observer = _state.get("observer")
    if observer is not None:
        census = observer.finish()
        _state["proof"].update(first_training_step={**_state["first_step_info"], **census, "recorded_at": utc_now()})
    if _state.get("offloader") is not None:
        _state["proof"].update(offload_inputs={**_state["offload"], "first_step": dict(_state["offloader"].stats)})
    if _state.get("meter") is not None:
        _finish_measuring(model)


def _start_measuring(model, info: dict[str, Any]) -> None:
    """Leave the first layer of each kind un-checkpointed in the first step and measure it inside the model's
    forward (``planning.meter``), and the step's peak where the device tells it."""
    meter = InForwardMeter(checkpoint_layers(model))
    _state["meter"] = meter
    memory = _memory(_state["backend"])
    if memory is not None:
        memory.reset_peak_memory_stats()
        _state["held_gib"] = memory.memory_allocated() / GIB
    info.update(measuring=sorted(meter.measured), measured_layers=meter.measured)


def _finish_measuring(model) -> None:
    """Make the plan from what the first step measured, agree on it with every rank, apply it, and watch the
    second step. Every rank reaches both agreements whatever it measured (``planning.ranks``)."""
    meter = _state.pop("meter")
    meter.close()
    checkpoint_every_layer(model, _state["func"])  # the measured layers too; the plan picks again
    kinds, backend = meter.layers_by_kind, _state["backend"]
    costs, seq_len = agree_costs(meter.costs, kinds, meter.seq_len, backend)
    record: dict[str, Any] = {
        "errors": meter.errors,
        "measured_layers": meter.measured,
        "timed_layers": meter.timed,
        "measured_here": {k: asdict(c) for k, c in meter.costs.items()},
        "first_layer_forward_s": meter.first_forward_s,
        "ranks": _world_size(),
        "recorded_at": utc_now(),
    }
    if not costs:
        record["note"] = "no layer could be measured on any rank; every layer stays checkpointed"
    elif _state["count"] is not None:
        chosen = plan(costs, count=_state["count"])
        agreed = agree_counts(chosen.uncheckpointed, kinds, backend)
        record.update(
            asdict(chosen),
            uncheckpointed=agreed,
            this_rank_chose=chosen.uncheckpointed,
            uncheckpointed_names=apply_plan(model, agreed),
        )
    else:
        # the first step kept the measured layers' activations: without them it is the all-checkpointed peak
        # (their count is below what they really took, so this errs high: fewer layers, never more)
        raw_peak = _memory(backend).max_memory_allocated() / GIB
        first_peak = raw_peak - meter.measured_bytes / GIB
        chosen = plan(
            scaled(costs, PRIOR_FACTOR),
            budget_gib=_state["budget"],
            peak_gib=first_peak,
            held_gib=_state["held_gib"],
            seq_len=seq_len,
            cutoff_len=_state.get("cutoff_len"),
        )
        agreed = agree_counts(chosen.uncheckpointed, kinds, backend)
        record.update(
            asdict(chosen),
            uncheckpointed=agreed,
            this_rank_chose=chosen.uncheckpointed,
            uncheckpointed_names=apply_plan(model, agreed),
            first_step_raw_peak_gib=round(raw_peak, 3),
        )
        _state["budget_plan"] = {
            "costs": costs,
            "chosen": agreed,
            "first_peak": first_peak,
            "kinds": kinds,
            "seq_len": seq_len,
            "names": record["uncheckpointed_names"],
            "step": 2,
            "priced_at": PRIOR_FACTOR,
        }
    record["uncheckpointed_total"] = len(record.get("uncheckpointed_names", []))
    _state["proof"].update(layer_plan=record)
    _watch_step(2)


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _watch_step(step: int) -> None:
    """Around training step ``step`` (2, or 3 after a widening): the census of what ran checkpointed
    (``second_training_step`` / ``third_training_step``) and, under a budget plan, its peak against the plan."""
    which = {2: "second", 3: "third"}[step]

    def before(trainer, model) -> None:
        try:
            _state["observer"] = StepObserver(model)
        except Exception:  # observing must never stop a run
            logger.exception("cannot observe checkpointing at the %s training step", which)
        _watch_peak(model)

    def after(trainer, model) -> None:
        observer = _state.pop("observer", None)
        if observer is not None:
            _state["proof"].update(**{f"{which}_training_step": {**observer.finish(), "recorded_at": utc_now()}})
        if "seq_hook" in _state:
            _state.pop("seq_hook").remove()
            _correct_plan(model)

    trainer_hook.on_training_step(NAME, step, before=before, after=after)


def _watch_peak(model) -> None:
    """Before a step that runs a budget plan with layers un-checkpointed: count its peak from zero and note its
    sequence length."""
    if _state.get("budget_plan") and _state["budget_plan"]["names"]:
        _memory(_state["backend"]).reset_peak_memory_stats()

        def seq_len(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            _state["budget_plan"].setdefault("watched_seq_len", int(ids.shape[-1]))

        _state["seq_hook"] = model.register_forward_pre_hook(seq_len, with_kwargs=True)


def _correct_plan(model) -> None:
    """Hold a step's real peak against the plan it ran. The second step runs the first plan, which priced each
    layer at ``PRIOR_FACTOR`` times its count: dearer than that, the plan is made again at the real factor and the
    layers it no longer affords are checkpointed again; cheaper, the plan is made again at the real factor and is
    the plan from the third step (more layers un-checkpointed; greedy by kind, so a later kind may lose a layer to
    an earlier one), whose peak is held against it the same way, then only ever narrowed."""
    done = _state.pop("budget_plan")
    peak = _memory(_state["backend"]).max_memory_allocated() / GIB
    step_seq_len, first_seq_len = done.get("watched_seq_len", done["seq_len"]), done["seq_len"]
    factor = correction(
        done["costs"],
        done["chosen"],
        peak_gib=peak,
        held_gib=_state["held_gib"],
        first_peak_gib=done["first_peak"],
        seq_len=step_seq_len,
        first_seq_len=first_seq_len,
    )
    record: dict[str, Any] = {
        "step": done["step"],
        "step_peak_gib": round(peak, 3),
        "factor": round(factor, 4),
        "step_seq_len": step_seq_len,
        "priced_at": done["priced_at"],
    }
    keep = revised(
        done["costs"],
        done["chosen"],
        factor,
        priced_at=done["priced_at"],
        may_widen=done["step"] == 2,
        budget_gib=_state["budget"],
        peak_gib=done["first_peak"],
        held_gib=_state["held_gib"],
        seq_len=done["seq_len"],
        cutoff_len=_state.get("cutoff_len"),
    )
    keep = agree_counts(keep, done["kinds"], _state["backend"])  # every rank, whatever its own factor
    rechecked = shrink_plan(model, done["names"], keep)
    kept = apply_plan(model, keep)
    widened = [n for n in kept if n not in done["names"]]
    if widened:  # the same on every rank (agreed counts, one model): the third step is watched on all or none
        _state["budget_plan"] = {
            **{k: v for k, v in done.items() if k != "watched_seq_len"},
            "chosen": keep,
            "names": kept,
            "priced_at": factor,
            "step": 3,
        }
        _watch_step(3)
    if keep != done["chosen"]:
        record["projected_peak_gib"] = projected_peak_gib(
            scaled(done["costs"], factor),
            keep,
            peak_gib=done["first_peak"],
            held_gib=_state["held_gib"],
            seq_len=done["seq_len"],
            cutoff_len=_state.get("cutoff_len"),
        )
    record.update(
        keep=keep, rechecked=rechecked, widened=widened, uncheckpointed_names=kept, uncheckpointed_total=len(kept)
    )
    _state["proof"].update(
        **{"plan_correction" if done["step"] == 2 else "plan_recheck": {**record, "recorded_at": utc_now()}}
    )
