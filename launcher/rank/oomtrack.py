"""Where a rank was when it ran out of memory: the phase, the optimizer step, the decoder layer, and one fix.

The rank side of issue "out of memory: the phase when it happens". ``make_callback`` (installed by ``entry.py``)
keeps a few fields current, at the cost of a dictionary write per hook call:

- ``on_train_begin`` puts a forward pre-hook and a forward hook on every decoder layer (the modules with a
  ``layer_type``): the pre-hook records the layer's index and kind and whether this forward is the training
  forward, the recompute of a checkpointed layer inside the backward (autograd is running a graph task), or an
  evaluation (the module is not training); the forward hook puts a gradient hook on the layer's output, which
  fires when the backward reaches that layer (phase ``backward``, that layer);
- Trainer callbacks mark the optimizer step (``on_pre_optimizer_step`` .. ``on_optimizer_step``), evaluation and
  the checkpoint save that ``on_step_end`` schedules, and the final save after ``on_train_end``.

When the rank fails with torch's out-of-memory error, ``describe`` turns that state into the record that
``entry.write_error_file`` stores (``out_of_memory`` in ``errors/rank<N>.json``). The traceback refines it:
a frame in FSDP2's unshard code is an all-gather, a frame in autograd's engine is the backward even before the
first layer's gradient hook fired (the loss and ``lm_head``), gradient clipping belongs to the optimizer step.
Allocated, reserved and peak memory are read from the device's allocator (CUDA, NPU); the size requested is
parsed from the message where torch gives it.

On CUDA (and on NPU where torch_npu offers it) ``launcher.memory_history_steps: N`` records the allocator's
history for the first N optimizer steps, and an out-of-memory error writes a snapshot to
``RUN_DIR/memory_snapshot_rank<N>.pickle``, which https://pytorch.org/memory_viz opens. Off CUDA and NPU the
option does nothing.

Layer 3, like ``entry.py``: torch and transformers are imported lazily, in the rank.
"""

from __future__ import annotations

import re
import traceback
from pathlib import Path
from typing import Any

from launcher.state.runs import MEMORY_SNAPSHOT

KIND_NAMES = {"linear_attention": "DeltaNet", "full_attention": "full attention"}
# One fix per phase, the first lever to pull there (docs/npu-tuning.md and docs/usage.md, "Out of memory").
FIXES = {
    "loading": "shard the weights: launcher.distribution: fsdp2 over more devices",
    "forward": "a lower cutoff_len or per_device_train_batch_size (the forward keeps every checkpointed layer's "
    "input and the un-checkpointed layers' activations)",
    "forward, un-checkpointed layer": "fewer un-checkpointed layers: a lower "
    "launcher.patches.checkpoint_all_layers.memory_budget_gib or uncheckpointed_layers",
    "recompute in backward": "a lower cutoff_len or per_device_train_batch_size (one layer's recomputed "
    "activations and their gradients must fit beside everything checkpointed)",
    "backward": "a lower cutoff_len or per_device_train_batch_size",
    "backward, loss": "launcher.patches.chunked_loss on, with a lower chunk_tokens (the logits' gradient)",
    "optimizer step": "launcher.distribution: fsdp2 (shards the optimizer state over the ranks) or a lower lora_rank",
    "FSDP all-gather": "keep launcher.patches.fsdp2_frozen_dtype on (bf16 shards) and spread over more ranks "
    "(launcher.nproc_per_node, launcher.nnodes)",
    "evaluation": "a lower per_device_eval_batch_size",
    "save": "save_only_model: true (no optimizer state gathered for the checkpoint)",
    "between steps": "a lower cutoff_len or per_device_train_batch_size",
}

_state: dict[str, Any] = {"phase": "loading", "step": None, "layer": None, "kind": None, "checkpointed": None}
_hooks: list[Any] = []
_history: dict[str, Any] = {"backend": None, "until": 0, "recording": False}

_REQUESTED = (
    re.compile(r"Tried to allocate ([\d.]+) ?([KMGT]i?B)"),  # CUDA, NPU
    re.compile(r"you tried to allocate (\d+) bytes"),  # CPU (DefaultCPUAllocator)
)
_UNITS = {
    "B": 1,
    "KiB": 1 << 10,
    "MiB": 1 << 20,
    "GiB": 1 << 30,
    "TiB": 1 << 40,
    "KB": 1 << 10,
    "MB": 1 << 20,
    "GB": 1 << 30,
    "TB": 1 << 40,
}


def state() -> dict[str, Any]:
    """A copy of what the tracker holds now."""
    return dict(_state)


def looks_like_oom(text: str | None) -> bool:
    """An error's name or text says a device or the CPU allocator ran out of memory (a rank's exception, or the
    root cause the supervisor read from its error record or log)."""
    text = (text or "").lower()
    return "outofmemoryerror" in text or "out of memory" in text or "can't allocate memory" in text


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's out-of-memory error (``torch.OutOfMemoryError``; NPU: its message), or a CPU allocator failure."""
    return type(exc).__name__ == "OutOfMemoryError" or looks_like_oom(str(exc))


def requested_bytes(message: str) -> int | None:
    """The allocation that failed, from torch's message (``Tried to allocate 2.00 GiB``), if it says."""
    for pattern in _REQUESTED:
        if match := pattern.search(message):
            unit = _UNITS.get(match.group(2), 1) if pattern.groups > 1 else 1
            return int(float(match.group(1)) * unit)
    return None


def _set(**fields: Any) -> None:
    _state.update(fields)


def _layers(model) -> list[tuple[int, Any]]:
    """``(index, layer)`` of the decoder layers (their ``layer_type`` marks them), in model order."""
    found = []
    for name, module in model.named_modules():
        match = re.search(r"layers\.(\d+)$", name)
        if match and getattr(module, "layer_type", None):
            found.append((int(match.group(1)), module))
    return found


def _in_backward() -> bool:
    import torch

    return torch._C._current_graph_task_id() != -1  # -1 outside an autograd graph task


def install(model) -> int:
    """Put the tracking hooks on the decoder layers of ``model`` (once); returns how many layers."""
    if _hooks:
        return len(_hooks) // 2
    for index, layer in _layers(model):
        kind = KIND_NAMES.get(layer.layer_type, layer.layer_type)

        def before(module, args, index=index, kind=kind):
            if not module.training:
                phase = "evaluation"
            elif _in_backward():
                phase = "recompute in backward"
            else:
                phase = "forward"
            _set(
                phase=phase, layer=index, kind=kind, checkpointed=bool(getattr(module, "gradient_checkpointing", False))
            )

        def after(module, args, output, index=index, kind=kind):
            if _state["phase"] == "recompute in backward":
                _set(phase="backward")  # the recompute is done; this layer's backward runs next
                return
            if _state["phase"] == "forward":
                _set(layer=None, kind=None)
                tensor = output[0] if isinstance(output, (tuple, list)) else output
                if getattr(tensor, "requires_grad", False):
                    tensor.register_hook(lambda grad, index=index, kind=kind: _reached(index, kind, grad))

        _hooks.append(layer.register_forward_pre_hook(before))
        _hooks.append(layer.register_forward_hook(after))
    return len(_hooks) // 2


def _reached(index: int, kind: str, grad):
    _set(phase="backward", layer=index, kind=kind)
    return grad


def uninstall() -> None:
    while _hooks:
        _hooks.pop().remove()


def _phase_from_frames(exc: BaseException, phase: str) -> str:
    """The tracker's phase, refined by where the error was raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    names = [(Path(f.filename).as_posix(), f.name) for f in frames]
    if any("/fsdp/" in path and ("unshard" in name or "all_gather" in name) for path, name in names):
        return "FSDP all-gather"
    if any("clip_grad_norm" in name for _, name in names):
        return "optimizer step"
    in_backward = any(
        name in ("_engine_run_backward", "run_backward")
        or (path.endswith("torch/autograd/__init__.py") and name == "backward")
        for path, name in names
    )
    if in_backward and phase not in ("recompute in backward", "backward"):
        return "backward"
    return phase


def memory_now(backend: str | None = None) -> dict[str, int | None]:
    """Allocated, reserved and peak allocated bytes of this rank's device (None where the backend has no counter)."""
    empty = {"allocated": None, "reserved": None, "peak": None}
    try:
        import torch

        for name in [backend] if backend else ["cuda", "npu"]:
            module = getattr(torch, name or "", None)
            if module is not None and name != "cpu" and module.is_available():
                return {
                    "allocated": module.memory_allocated(),
                    "reserved": module.memory_reserved(),
                    "peak": module.max_memory_allocated(),
                }
    except Exception:  # reading the counters must never mask the error being recorded
        return empty
    return empty


def fix_for(phase: str, layer: int | None, checkpointed: bool | None) -> str:
    if phase == "forward" and layer is not None and checkpointed is False:
        return FIXES["forward, un-checkpointed layer"]
    if phase == "backward" and layer is None:
        return FIXES["backward, loss"]
    return FIXES.get(phase, FIXES["between steps"])


def describe(exc: BaseException, backend: str | None = None) -> dict[str, Any]:
    """The ``out_of_memory`` record of an error raised while the tracker ran."""
    now = dict(_state)
    phase = _phase_from_frames(exc, now["phase"])
    layer = (
        now["layer"]
        if phase in ("forward", "recompute in backward", "backward", "evaluation", "FSDP all-gather")
        else None
    )
    if phase == "backward" and now["phase"] not in ("backward", "recompute in backward"):
        layer = None  # the backward had not reached a decoder layer yet: the loss and lm_head
    record = {
        "phase": phase,
        "step": now["step"],
        "layer": layer,
        "kind": now["kind"] if layer is not None else None,
        "requested": requested_bytes(str(exc)),
        **memory_now(backend),
        "fix": fix_for(phase, layer, now["checkpointed"]),
    }
    return record


def summary(record: dict[str, Any]) -> str:
    """One line: ``out of memory in recompute in backward at step 3, layer 5 (DeltaNet): ...; fix: ...``."""

    def size(value: Any) -> str:
        return "-" if not isinstance(value, int) else f"{value / (1 << 30):.2f} GiB"

    where = f"out of memory in {record.get('phase')}"
    if record.get("step") is not None:
        where += f" at step {record['step']}"
    if record.get("layer") is not None:
        where += f", decoder layer {record['layer']} ({record.get('kind')})"
    figures = (
        f"requested {size(record.get('requested'))}, allocated {size(record.get('allocated'))}, "
        f"reserved {size(record.get('reserved'))}, peak {size(record.get('peak'))}"
    )
    return f"{where}: {figures}; fix: {record.get('fix')}"


# --- the allocator's history (CUDA; NPU where torch_npu has it) ---------------------------------------------------


def _memory_module(backend: str):
    import torch

    module = getattr(getattr(torch, backend, None), "memory", None)
    ok = backend in ("cuda", "npu") and module is not None and getattr(torch, backend).is_available()
    return module if ok and hasattr(module, "_record_memory_history") else None


def start_history(backend: str, steps: int) -> bool:
    """Record the allocator's history until optimizer step ``steps``; False (nothing done) off CUDA/NPU."""
    module = _memory_module(backend) if steps > 0 else None
    if module is None:
        return False
    module._record_memory_history(max_entries=200_000)
    _history.update(backend=backend, until=steps, recording=True)
    return True


def _stop_history() -> None:
    module = _memory_module(_history["backend"] or "")
    if module is not None and _history["recording"]:
        module._record_memory_history(enabled=None)
    _history["recording"] = False


def dump_snapshot(run_dir: Path, rank: str) -> Path | None:
    """Write the allocator's snapshot (segments, and the history if recorded) for pytorch.org/memory_viz."""
    module = _memory_module(_history["backend"] or "")
    if module is None:
        return None
    path = run_dir / MEMORY_SNAPSHOT.format(rank=rank)
    try:
        module._dump_snapshot(str(path))
    except Exception:  # never mask the out-of-memory error itself
        return None
    return path


def make_callback(backend: str, history_steps: int = 0) -> Any:
    """The ``TrainerCallback`` that keeps the phase and step current (see the module docstring)."""
    from transformers import TrainerCallback

    class PhaseCallback(TrainerCallback):
        def __init__(self) -> None:
            self.pending: list[str] = []

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if model is not None:
                install(model)
            start_history(backend, history_steps)
            _set(phase="forward", step=state.global_step + 1, layer=None, kind=None)
            return control

        def on_step_begin(self, args, state, control, **kwargs):
            _set(phase="forward", step=state.global_step + 1, layer=None, kind=None)
            return control

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            _set(phase="optimizer step", layer=None, kind=None)
            return control

        def on_optimizer_step(self, args, state, control, **kwargs):
            _set(phase="between steps")
            return control

        def on_step_end(self, args, state, control, **kwargs):
            if _history["recording"] and state.global_step >= _history["until"]:
                _stop_history()
            self.pending = [
                p for p, on in (("evaluation", control.should_evaluate), ("save", control.should_save)) if on
            ]
            _set(
                phase=self.pending[0] if self.pending else "between steps",
                step=state.global_step,
                layer=None,
                kind=None,
            )
            return control

        def on_evaluate(self, args, state, control, **kwargs):
            self.pending = [p for p in self.pending if p != "evaluation"]
            _set(phase=self.pending[0] if self.pending else "between steps", layer=None, kind=None)
            return control

        def on_save(self, args, state, control, **kwargs):
            self.pending = []
            _set(phase="between steps", layer=None, kind=None)
            return control

        def on_train_end(self, args, state, control, **kwargs):
            _set(phase="save", step=state.global_step, layer=None, kind=None)  # LLaMA-Factory's final save next
            return control

    return PhaseCallback()
