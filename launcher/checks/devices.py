"""Preflight's ``devices`` row: who else is on the accelerators the run will use.

For each device the job will use (``state/devices.run_devices``): its memory in use and the processes on it, with
their owner where this process can see them (nvidia-smi, npu-smi). Another process holding more than
``launcher.busy_device_gib`` on one of them fails the row, unless ``launcher.allow_busy_devices``: such a run would
die hours in when its peak meets the other's, or slow both. The device lease (``state/lease.py``) keeps two
launcher runs apart; this row sees what the lease cannot: a job started outside the launcher.
"""

from __future__ import annotations

from typing import Any

from launcher.state.devices import Device, DeviceError, run_devices

MIB_PER_GIB = 1024.0


def _mib(value: float | None) -> str:
    return "?" if value is None else f"{value / MIB_PER_GIB:.1f} GiB"


def describe(device: Device, index: int) -> str:
    """One device as a phrase: job index, host index, identity, memory in use, its processes."""
    text = f"{index}: {device.identity} ({_mib(device.used_mib)} of {_mib(device.total_mib)} in use"
    procs = ", ".join(
        f"pid {p.pid} {p.name} {_mib(p.used_mib)}" + (f" of {p.user}" if p.user else "") for p in device.processes
    )
    return text + (f"; {procs})" if procs else "; no process)")


def check_devices(backend: str, launcher: Any, env: dict[str, str] | None = None) -> tuple[str, str, float | None]:
    """``(status, detail, free_gib)`` of the ``devices`` row; ``free_gib`` is the least free memory among the
    run's devices (None when not known), for the memory forecast's verdict."""
    if backend == "cpu":
        return "ok", "cpu: no accelerator to share", None
    try:
        devices = run_devices(backend, launcher.nproc_per_node, env)
    except DeviceError as err:
        return "fail", str(err), None
    detail = "; ".join(describe(d, i) for i, d in enumerate(devices))
    notes = sorted({d.note for d in devices if d.note})
    if notes:
        return "warn", f"{detail}; {'; '.join(notes)}: memory in use and processes not known", None
    limit = launcher.busy_device_gib * MIB_PER_GIB
    busy = [
        f"{i}: pid {p.pid} ({p.name}{', ' + p.user if p.user else ''}) holds {_mib(p.used_mib)}"
        for i, d in enumerate(devices)
        for p in d.processes
        if (p.used_mib or 0) > limit
    ]
    free = [d.total_mib - d.used_mib for d in devices if d.total_mib is not None and d.used_mib is not None]
    free_gib = min(free) / MIB_PER_GIB if free else None
    if busy and not launcher.allow_busy_devices:
        return (
            "fail",
            f"another process holds more than launcher.busy_device_gib ({launcher.busy_device_gib:g} "
            f"GiB) on the run's devices: {'; '.join(busy)}. Pick other devices, wait for it, or set "
            f"launcher.allow_busy_devices: true to share them ({detail})",
            free_gib,
        )
    if busy:
        return "warn", f"shared (launcher.allow_busy_devices): {'; '.join(busy)} ({detail})", free_gib
    return "ok", detail, free_gib
