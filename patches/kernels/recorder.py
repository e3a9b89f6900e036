"""A stand-in for a DeltaNet kernel that checks the device on every call and records the first.

``Qwen3_5GatedDeltaNet`` calls ``self.chunk_gated_delta_rule(query, key, value, g=..., beta=..., ...)`` (the
prompt, and every training step) and ``self.recurrent_gated_delta_rule(...)`` (one-token decoding steps) with
``[B, T, H, D]`` tensors (FLA's layout; transformers' torch references take the same and transpose inside).
``role`` names which of the two a recorder stands for.
The recorder:

- checks on every call that every tensor argument is on the device type of the run's backend and raises
  otherwise: a DeltaNet layer left on the CPU in an NPU run would otherwise run the kernel there, slowly;
- on the first call in this process, hands a description (kernel, device, dtype, shapes) to a callback,
  which writes it into the rank's proof record;
- counts calls, so the first training step can show the kernel really ran.

The recorders of one kernel role share one ``CallLog``: "first call" means first in the process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..core.errors import PatchError


def qualified_name(func: Any) -> str:
    """``module.qualname`` of a function or class, for records."""
    module = getattr(func, "__module__", None) or type(func).__module__
    name = getattr(func, "__qualname__", None) or type(func).__qualname__
    return f"{module}.{name}"


class CallLog:
    """Calls seen by the recorders of one route in this process."""

    def __init__(self, on_first_call: Callable[[dict[str, Any]], None]) -> None:
        self.calls = 0
        self.on_first_call = on_first_call


class KernelRecorder:
    """Callable that checks, records and forwards to ``kernel``."""

    def __init__(
        self,
        kernel: Callable,
        *,
        label: str,
        expected_device: str,
        log: CallLog,
        patch: str,
        backend: str,
        role: str = "chunk_gated_delta_rule",
    ) -> None:
        self.kernel = kernel
        self.kernel_name = qualified_name(kernel)
        self.label = label
        self.expected_device = expected_device
        self.log = log
        self.patch = patch
        self.backend = backend
        self.role = role

    def __call__(self, query, key, value, *args, **kwargs):
        self._check_devices(query=query, key=key, value=value, g=kwargs.get("g"), beta=kwargs.get("beta"))
        self.log.calls += 1
        if self.log.calls == 1:
            self.log.on_first_call(self.describe_call(query, value))
        from torch.profiler import record_function

        with record_function(f"deltanet::{self.label}"):  # what `launcher profile` counts as DeltaNet time
            return self.kernel(query, key, value, *args, **kwargs)

    def describe_call(self, query, value) -> dict[str, Any]:
        import torch

        return {
            "kernel": self.kernel_name,
            "role": self.role,
            "label": self.label,
            "device": str(query.device),
            "dtype": str(query.dtype),
            "layout": "[B, T, H, D]",
            "shape": list(query.shape),
            "value_shape": list(value.shape),
            "grad_enabled": torch.is_grad_enabled(),
        }

    def _check_devices(self, **tensors) -> None:
        for name, tensor in tensors.items():
            device = getattr(tensor, "device", None)
            if device is not None and device.type != self.expected_device:
                raise PatchError(
                    self.patch,
                    f"{self.role} ({self.label}: {self.kernel_name}) received {name} on {device}, "
                    f"but this run's backend is {self.backend}, so a DeltaNet layer would run off the "
                    f"{self.expected_device} device (slowly, or not at all)",
                    "make sure the whole model is placed on the accelerator (check the device visibility "
                    "variables and that no layer is offloaded to CPU), or run with backend cpu",
                )

    # The recorder is shared process-wide state; copying a model must not fork it.
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self
