"""After a checkpoint load under FSDP2, every rank's LoRA shards come from the checkpoint's whole adapter file.

Upstream behaviour (accelerate 1.11.0, ``accelerate/utils/fsdp_utils.py``): with ``FULL_STATE_DICT`` (the
launcher's accelerate config) and a PEFT model, ``save_fsdp_model(..., adapter_only=True)`` writes
``get_peft_model_state_dict(model)`` on rank 0 only, and under FSDP2 that dict holds DTensors, so
``pytorch_model_fsdp.bin`` keeps rank 0's ``Shard(0)`` slice of each LoRA tensor. ``load_fsdp_model(...,
adapter_only=True)`` reads the file on rank 0 and hands the other ranks ``{}`` (meant for ``broadcast_from_rank0``),
but ``_set_model_state_dict`` takes ``set_peft_model_state_dict`` for an adapter, which broadcasts nothing.
transformers 5.6.0's Trainer always asks for ``adapter_only`` (``integrations/fsdp.py`` ``get_fsdp_ckpt_kwargs``) in
``Trainer._load_from_checkpoint`` (resume) and ``Trainer._load_best_model``, so after ``launcher resume`` every rank
but 0 trains on from its initial LoRA slices (B zero, A random) with the checkpoint's optimizer state. accelerate
PR #4206 loads the adapter with ``set_model_state_dict`` instead; its first release is 1.15.0 (its
``_set_model_state_dict`` has the branch, 1.14.0's has not). The PEFT save next to it,
``adapter_model.safetensors``, is gathered and whole.

What this patch does (a wrapper of the ``load_fsdp_model`` global that ``transformers.trainer`` imported and both
Trainer methods read at call time): after the original returns, when accelerate is on FSDP2 with
``FULL_STATE_DICT``, ``adapter_only`` and a PEFT model,

1. world rank 0 reads ``<checkpoint>/adapter_model.safetensors`` (only node 0 needs to see it) and maps every
   trainable parameter to its key there, explicitly: PEFT drops the adapter name from the key
   (``...q_proj.lora_A.default.weight`` is saved as ``...q_proj.lora_A.weight``; DoRA's
   ``lora_magnitude_vector.default.weight`` as ``lora_magnitude_vector``; peft 0.18.1
   ``utils/save_and_load.py`` ``get_peft_model_state_dict``). A trainable parameter without a key, or with another
   shape than the file's, is a verdict that rank 0 sends to every rank, and all ranks raise ``PatchError``
   together (no rank is left waiting in a collective);
2. ``torch.distributed.checkpoint.state_dict.set_model_state_dict`` with ``full_state_dict`` and
   ``broadcast_from_rank0`` (and ``strict=False``: the file holds the adapter only) sends each whole tensor from
   rank 0 and every rank copies its own slice into its DTensor shard, in place, so the optimizer keeps its
   parameters (what accelerate 1.15 does, but from the whole file rather than the half-written ``.bin``);
3. records per rank (``loads``): the checkpoint, how many tensors were set, the local shards' squared norm and sum
   before and after, by ``lora_A``/``lora_B``/other, how many local tensors changed, and on rank 0 the file's
   squared norm (the ranks' ``after`` norms add up to it).

Under ``distribution: ddp``, with ``SHARDED_STATE_DICT`` or without a PEFT model nothing changes and the record
says why. Versions: accelerate >=1.11.0,<1.15 (1.15.0 carries PR #4206); transformers >=5.6.0,<5.7 (the Trainer's
import of ``load_fsdp_model``). Delete this patch when the lock moves to accelerate >= 1.15.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from typing import Any

from packaging.specifiers import SpecifierSet
from pydantic import BaseModel, ConfigDict

from launcher.state.runs import ADAPTER_FILE

from .core.errors import PatchError
from .core.proof import ProofFile, utc_now
from .core.versions import require_global_loads, require_symbols
from .core.wrapping import MARKER, ORIGINAL, wrap_once

NAME = "fsdp2_resume_adapter"
SUPPORTED = {
    "accelerate": SpecifierSet(">=1.11.0,<1.15"),
    "transformers": SpecifierSet(">=5.6.0,<5.7"),
    "torch": SpecifierSet(">=2.7"),
}
MODULE = "transformers.trainer"
FUNCTION = "load_fsdp_model"
CALLERS = ("_load_from_checkpoint", "_load_best_model")
TURN_OFF = f"launcher.patches.{NAME}: false"


class Options(BaseModel):
    """``launcher.patches.fsdp2_resume_adapter``: no options besides ``enabled``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    enabled: bool = True


_state: dict[str, Any] = {}


def check_symbols() -> None:
    """The Trainer still imports ``load_fsdp_model`` and reads it from its module globals when it loads."""
    trainer = require_symbols(NAME, MODULE, ("Trainer", FUNCTION), "transformers")
    for caller in CALLERS:
        require_global_loads(NAME, getattr(trainer.Trainer, caller), (FUNCTION,), "transformers")
    require_symbols(NAME, "accelerate.utils", ("is_peft_model",), "accelerate")
    require_symbols(
        NAME, "torch.distributed.checkpoint.state_dict", ("set_model_state_dict", "StateDictOptions"), "torch"
    )


def file_key(name: str, adapter: str) -> str | None:
    """The key PEFT writes to ``adapter_model.safetensors`` for parameter ``name`` of adapter ``adapter``, or None
    when the name carries no adapter segment (peft 0.18.1 ``get_peft_model_state_dict``: the DoRA rename, then
    ``remove_adapter_name``)."""
    dora = f"lora_magnitude_vector.{adapter}.weight"
    if name.endswith(dora):
        return name[: -len(f".{adapter}.weight")]
    if name.endswith(f".{adapter}"):
        return name[: -len(adapter) - 1]
    head, _, suffix = name.rpartition(".")
    if head.endswith(f".{adapter}"):
        return f"{head[: -len(adapter) - 1]}.{suffix}"
    return None


def plan(trainable: dict[str, tuple[int, ...]], stored: dict[str, tuple[int, ...]], adapter: str):
    """Map each trainable parameter (name -> shape) to its key in the file (key -> shape).

    Returns:
        (mapping name -> key, problem or None, keys of the file no parameter takes).
    """
    mapping, unmapped, mismatched = {}, [], []
    for name, shape in trainable.items():
        key = file_key(name, adapter)
        if key is None or key not in stored:
            unmapped.append(f"{name} (looked for {key or 'no key: the name has no adapter segment'})")
        elif tuple(stored[key]) != tuple(shape):
            mismatched.append(f"{name}: model {list(shape)}, file {list(stored[key])}")
        else:
            mapping[name] = key
    problems = []
    if not trainable:
        problems.append("the model has no trainable parameter")
    if unmapped:
        problems.append(f"{len(unmapped)} trainable parameter(s) have no entry: {'; '.join(unmapped[:4])}")
    if mismatched:
        problems.append(f"{len(mismatched)} shape(s) differ: {'; '.join(mismatched[:4])}")
    extra = sorted(set(stored) - set(mapping.values()))
    return mapping, ("; ".join(problems) or None), extra


def _kind(name: str) -> str:
    for kind in ("lora_A", "lora_B"):
        if f".{kind}." in name:
            return kind
    return "other"


def _local(param):
    """This rank's part of a parameter: the local shard of a DTensor, the tensor itself otherwise."""
    return (param.to_local() if hasattr(param, "to_local") else param).detach()


def _local_census(params: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Squared norm and sum of this rank's local shards, by kind (float64, so the ranks' figures add up)."""
    import torch

    census: dict[str, dict[str, float]] = {}
    with torch.no_grad():
        for name, param in params.items():
            values = _local(param).to(torch.float64)
            entry = census.setdefault(_kind(name), {"sq_norm": 0.0, "sum": 0.0, "tensors": 0})
            entry["sq_norm"] += float(values.square().sum())
            entry["sum"] += float(values.sum())
            entry["tensors"] += 1
    return census


def _local_copies(params: dict[str, Any]) -> dict[str, Any]:
    return {name: _local(param).clone() for name, param in params.items()}


def _read_on_rank0(checkpoint: str, trainable: dict[str, tuple[int, ...]], adapter: str) -> dict[str, Any]:
    """World rank 0's reading of the adapter file: the tensors to send, or the problem every rank raises."""
    path = os.path.join(checkpoint, ADAPTER_FILE)
    if not os.path.isfile(path):
        return {
            "problem": f"{path} does not exist, so the LoRA shards of ranks other than 0 cannot be restored "
            "(accelerate's pytorch_model_fsdp.bin holds rank 0's slices only)"
        }
    import torch
    from safetensors.torch import load_file

    stored_tensors = load_file(path, device="cpu")
    stored = {k: tuple(v.shape) for k, v in stored_tensors.items()}
    mapping, problem, extra = plan(trainable, stored, adapter)
    if problem is not None:
        return {"problem": f"{path} does not match the model's adapter {adapter!r}: {problem}"}
    tensors = {name: stored_tensors[key] for name, key in mapping.items()}
    sq_norm = sum(float(t.to(torch.float64).square().sum()) for t in tensors.values())
    return {
        "problem": None,
        "tensors": tensors,
        "file": path,
        "file_tensors": len(stored),
        "file_sq_norm": sq_norm,
        "extra_file_keys": extra[:8],
        "extra_file_key_count": len(extra),
    }


def restore_adapter(model, checkpoint: str) -> dict[str, Any]:
    """Set every rank's trainable (LoRA) shards of ``model`` from ``checkpoint``'s adapter file, read on rank 0.

    Raises:
        PatchError: on every rank, when the file is missing or does not match the model.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    started = time.monotonic()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    adapter = model.active_adapter
    rank = dist.get_rank()
    read = _read_on_rank0(checkpoint, {n: tuple(p.shape) for n, p in params.items()}, adapter) if rank == 0 else {}
    verdict = [read.get("problem") if rank == 0 else None]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise PatchError(
            NAME,
            f"resuming from {checkpoint} under FSDP2: {verdict[0]}",
            f"resume from a checkpoint the Trainer wrote with its PEFT adapter file (launcher resume "
            f"picks the last complete one), or turn the patch off ({TURN_OFF}) and accept that ranks "
            "other than 0 restart their LoRA slices from initial values",
        )
    before_values = _local_copies(params)
    before = _local_census(params)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_model_state_dict(model, read.get("tensors", {}), options=options)
    after = _local_census(params)
    changed = 0
    with torch.no_grad():
        for name, param in params.items():
            changed += int(not torch.equal(_local(param), before_values[name]))
    record = {
        "checkpoint": checkpoint,
        "adapter": adapter,
        "tensors_set": len(params),
        "changed_local_tensors": changed,
        "local_before": before,
        "local_after": after,
        "seconds": round(time.monotonic() - started, 3),
        "recorded_at": utc_now(),
    }
    if rank == 0:
        record.update(
            {k: read[k] for k in ("file", "file_tensors", "file_sq_norm", "extra_file_keys", "extra_file_key_count")}
        )
    return record


def _skip_reason(fsdp_plugin, accelerator, model, adapter_only: bool) -> str | None:
    from accelerate.utils import is_peft_model
    from torch.distributed.fsdp.fully_sharded_data_parallel import StateDictType

    if not getattr(accelerator, "is_fsdp2", False):
        return "not FSDP2"
    if not adapter_only:
        return "adapter_only is false (accelerate loads the whole model)"
    if fsdp_plugin.state_dict_type != StateDictType.FULL_STATE_DICT:
        return f"state_dict_type is {fsdp_plugin.state_dict_type}, not FULL_STATE_DICT"
    if not is_peft_model(model):
        return "not a PEFT model"
    import torch.distributed as dist

    if not dist.is_initialized():
        return "torch.distributed is not initialized"
    return None


def _make_load(original):
    def load_fsdp_model(fsdp_plugin, accelerator, model, input_dir, *args, **kwargs):
        result = original(fsdp_plugin, accelerator, model, input_dir, *args, **kwargs)
        if not _state.get("active"):
            return result
        model_index = args[0] if args else kwargs.get("model_index", 0)
        adapter_only = args[1] if len(args) > 1 else kwargs.get("adapter_only", False)
        reason = _skip_reason(fsdp_plugin, accelerator, model, adapter_only)
        if reason is None and model_index != 0:
            reason = f"model_index {model_index} (the Trainer loads one model, index 0)"
        proof: ProofFile = _state["proof"]
        if reason is not None:
            entry = {"checkpoint": str(input_dir), "skipped": reason, "recorded_at": utc_now()}
        else:
            entry = restore_adapter(model, str(input_dir))
        proof.update(loads=[*proof.read().get("loads", []), entry])
        return result

    return load_fsdp_model


def apply(options: dict[str, Any], *, backend: str, proof: ProofFile, facts: dict[str, Any]) -> dict[str, Any]:
    """Wrap the ``load_fsdp_model`` global of ``transformers.trainer``; idempotent."""
    wrap_once(importlib.import_module(MODULE), FUNCTION, NAME, _make_load)  # a module global, not a method
    _state.update(active=True, proof=proof)
    return {"replaced": [f"{MODULE}.{FUNCTION}"], "callers": [f"Trainer.{c}" for c in CALLERS]}


def observe(*, backend: str, proof: ProofFile) -> None:
    """Disabled: accelerate 1.11 restores rank 0's LoRA slices only; nothing is recorded."""
    restore()


def restore() -> None:
    """Put the Trainer's ``load_fsdp_model`` back if ours is outermost; forget the state."""
    module = sys.modules.get(MODULE)
    current = getattr(module, FUNCTION, None) if module is not None else None
    if getattr(current, MARKER, None) == NAME:
        setattr(module, FUNCTION, getattr(current, ORIGINAL))
    _state.clear()
