"""The one place that maps a backend name to its device, collective and environment.

``npu`` (Ascend, torch-npu, HCCL), ``cuda`` (NVIDIA, NCCL) and ``cpu`` (gloo). ``auto`` picks the
first one whose devices answer. Detection imports torch lazily, so host-side verbs never need it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from launcher import SOURCE_ROOT


@dataclass(frozen=True)
class Backend:
    name: str
    collective: str  # torch.distributed backend, also LLaMA-Factory's/HF's ``ddp_backend``
    visible_devices_env: str | None  # the variable that selects devices for the job


BACKENDS = {
    "npu": Backend("npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES"),
    "cuda": Backend("cuda", "nccl", "CUDA_VISIBLE_DEVICES"),
    "cpu": Backend("cpu", "gloo", None),
}


def device_count(name: str) -> int:
    """How many devices of backend ``name`` this process can see (0 if none or not installed)."""
    if name == "cpu":
        return 1
    try:
        import torch
    except ImportError:
        return 0
    if name == "cuda":
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    if name == "npu":
        try:
            import torch_npu  # noqa: F401  (registers torch.npu)
        except ImportError:
            return 0
        return torch.npu.device_count() if torch.npu.is_available() else 0
    raise ValueError(f"unknown backend {name!r}; choose one of {sorted(BACKENDS)}")


def resolve(requested: str) -> Backend:
    """Turn ``auto`` into the first backend with devices (npu, then cuda, then cpu)."""
    if requested != "auto":
        if requested not in BACKENDS:
            raise ValueError(f"unknown backend {requested!r}; choose auto, {', '.join(BACKENDS)}")
        return BACKENDS[requested]
    for name in ("npu", "cuda"):
        if device_count(name) > 0:
            return BACKENDS[name]
    return BACKENDS["cpu"]


def device_name(backend: str) -> str:
    """The torch device a one-process check or evaluation uses on ``backend``: ``npu:0``, ``cuda:0`` or ``cpu``
    (on an NPU, torch_npu is imported first: it registers the device)."""
    if backend == "npu":
        import torch_npu  # noqa: F401  (registers the npu device)

        return "npu:0"
    return "cuda:0" if backend == "cuda" else "cpu"


def child_env(backend: Backend) -> dict[str, str]:
    """The environment of a process the launcher starts (the job, preflight's kernel check).

    The caller's environment passes through whole (device selection, NCCL/HCCL settings); on top of it:
    unbuffered output, the repository root on PYTHONPATH so the child imports this launcher and its
    patches, for a CPU run no visible GPU, and for a CUDA run GPUs numbered by PCI bus, as nvidia-smi numbers them
    (``state/devices.py``: the lease and the job must mean the same GPU by the same index).
    """
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    root = str(SOURCE_ROOT)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    if backend.name == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU run stays on the CPU even on a GPU host
    if backend.name == "cuda":  # indices as nvidia-smi counts them (by PCI bus): what the device lease reads
        env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    return env
