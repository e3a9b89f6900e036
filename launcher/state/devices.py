"""The accelerators of this host as their drivers' tools describe them: a stable identity for each device, its
memory in use and the processes on it.

- CUDA: ``nvidia-smi`` (the driver's own tool, present wherever the driver is): ``--query-gpu`` gives each GPU's
  index, UUID (the identity: the same in every container and every process of the host), PCI bus id and memory;
  ``--query-compute-apps`` the processes with their memory.
- NPU: ``npu-smi info`` (Ascend's driver tool): the device table (NPU id, chip, PCIe bus id, HBM used / total)
  and the process table (NPU, chip, pid, name, memory). The bus id is the identity; npu-smi has no UUID.

``run_devices`` turns a job's device selection (``CUDA_VISIBLE_DEVICES``, ``ASCEND_RT_VISIBLE_DEVICES``) into the
devices it will use: an index counts the devices this process sees in the order the tool lists them (a container
given GPUs 2 and 3 sees them as 0 and 1, and so does its nvidia-smi), a UUID or bus id names one device; the job
uses the first ``nproc_per_node``. Where the tool is missing, a device is known by its index on this host only
(``cuda:index:3``), which a container that sees another numbering would not match; the lease says so
(``Device.note``).

Index order: CUDA numbers GPUs fastest first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, while ``nvidia-smi`` numbers
them by PCI bus; the job's environment gets ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (``launcher.config.backend.child_env``) so
that both agree. Output formats: nvidia-smi's CSV is documented (``nvidia-smi --help-query-gpu``); npu-smi's table
as printed by npu-smi 23.0 to 26.0 (docs/devices.md shows the lines read).
"""

from __future__ import annotations

import csv
import io
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any

TOOL_TIMEOUT_S = 20.0
GPU_QUERY = ["--query-gpu=index,uuid,pci.bus_id,memory.used,memory.total", "--format=csv,noheader,nounits"]
APPS_QUERY = ["--query-compute-apps=gpu_uuid,pid,process_name,used_memory", "--format=csv,noheader,nounits"]


@dataclass(frozen=True)
class DeviceProcess:
    """A process on a device: its pid (as the tool sees it: the host's), name and memory; its owner when this
    process can see it (the same pid namespace)."""

    pid: int
    name: str
    used_mib: float | None
    user: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "name": self.name, "used_mib": self.used_mib, "user": self.user}


@dataclass
class Device:
    kind: str  # "cuda" or "npu"
    host_index: str  # the index the tool gives (nvidia-smi's GPU index, npu-smi's NPU id[:chip])
    identity: str  # stable across processes and containers of this host: "cuda:GPU-<uuid>", "npu:<bus id>"
    bus_id: str | None = None
    used_mib: float | None = None
    total_mib: float | None = None
    processes: list[DeviceProcess] = field(default_factory=list)
    note: str | None = None  # why the identity is weaker than it should be

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "host_index": self.host_index,
            "identity": self.identity,
            "bus_id": self.bus_id,
            "used_mib": self.used_mib,
            "total_mib": self.total_mib,
            "note": self.note,
            "processes": [p.to_dict() for p in self.processes],
        }


class DeviceError(ValueError):
    """The job's device selection names a device this host does not have; the message says which and how to fix."""


def _number(text: str) -> float | None:
    try:
        return float(text.strip())
    except ValueError:
        return None


def parse_nvidia_smi(gpus: str, apps: str) -> list[Device]:
    """The GPUs of ``nvidia-smi --query-gpu`` (``GPU_QUERY``) and their processes (``APPS_QUERY``)."""
    devices: dict[str, Device] = {}
    for row in csv.reader(io.StringIO(gpus)):
        if len(row) < 5:
            continue
        index, uuid, bus, used, total = (c.strip() for c in row[:5])
        devices[uuid] = Device("cuda", index, f"cuda:{uuid}", bus.lower(), _number(used), _number(total))
    for row in csv.reader(io.StringIO(apps)):
        if len(row) < 4 or row[0].strip() not in devices or not row[1].strip().isdigit():
            continue
        uuid, pid, name, used = (c.strip() for c in row[:4])
        devices[uuid].processes.append(DeviceProcess(int(pid), name, _number(used), owner(int(pid))))
    return sorted(devices.values(), key=lambda d: int(d.host_index) if d.host_index.isdigit() else 0)


_CELLS = re.compile(r"^\|(.*)\|\s*$")


def parse_npu_smi(text: str) -> list[Device]:
    """The NPUs of ``npu-smi info``: each device is two rows of the first table (``NPU Name | Health | ...`` then
    ``Chip | Bus-Id | AICore Memory HBM``), its processes rows of the second (``NPU Chip | pid | name | memory``)."""
    devices: dict[str, Device] = {}
    table, npu = 0, None
    for line in text.splitlines():
        if line.startswith("+"):
            continue
        match = _CELLS.match(line.strip())
        if not match:
            continue
        cells = [c.strip() for c in match.group(1).split("|")]
        first = cells[0].split()
        if first[:2] == ["NPU", "Name"]:
            table = 1
            continue
        if first[:2] == ["NPU", "Chip"]:
            table = 2
            continue
        if table == 1 and len(cells) >= 3:
            if len(first) >= 2 and first[0].isdigit() and not first[1].isdigit():  # "0     910B3 | OK | ..."
                npu = first[0]
            elif first and first[0].isdigit() and npu is not None:  # "0 | 0000:C1:00.0 | 0  0 / 0  3318 / 65536"
                chip, bus = first[0], cells[1]
                hbm = re.findall(r"(\d+)\s*/\s*(\d+)", cells[2])
                used, total = (float(hbm[-1][0]), float(hbm[-1][1])) if hbm else (None, None)
                key = npu if chip == "0" else f"{npu}:{chip}"
                devices[key] = Device("npu", key, f"npu:{bus.lower()}", bus.lower(), used, total)
        elif table == 2 and len(cells) >= 4 and len(first) >= 2 and first[0].isdigit() and cells[1].isdigit():
            key = first[0] if first[1] == "0" else f"{first[0]}:{first[1]}"
            if key in devices:
                pid = int(cells[1])
                devices[key].processes.append(DeviceProcess(pid, cells[2], _number(cells[3]), owner(pid)))
    return list(devices.values())


def owner(pid: int) -> str | None:
    """The user name of process ``pid`` when this process can see it (else None: another pid namespace)."""
    try:
        import psutil

        return psutil.Process(pid).username()
    except Exception:  # gone, another namespace, no name for the uid
        return None


def _run(argv: list[str], env: dict[str, str] | None) -> str | None:
    try:
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=TOOL_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def inventory(kind: str, env: dict[str, str] | None = None) -> list[Device] | None:
    """The devices of ``kind`` ("cuda", "npu") as the driver's tool lists them (found on ``env``'s PATH); None
    when the tool is not there or does not answer (``TOOL_TIMEOUT_S``)."""
    path = (env if env is not None else os.environ).get("PATH")
    if kind == "cuda" and (tool := shutil.which("nvidia-smi", path=path)):
        gpus = _run([tool, *GPU_QUERY], env)
        if gpus is None:
            return None
        return parse_nvidia_smi(gpus, _run([tool, *APPS_QUERY], env) or "")
    if kind == "npu" and (tool := shutil.which("npu-smi", path=path)):
        text = _run([tool, "info"], env)
        return None if text is None else parse_npu_smi(text)
    return None


def visible_selection(value: str | None) -> list[str] | None:
    """A ``*_VISIBLE_DEVICES`` value as its entries (``"0,1"``, ``"0-3"``, ``"GPU-8f..."``); None when unset."""
    if value is None:
        return None
    picked: list[str] = []
    for part in (p.strip() for p in value.split(",")):
        if re.fullmatch(r"\d+-\d+", part):
            low, high = (int(x) for x in part.split("-"))
            picked += [str(i) for i in range(low, high + 1)]
        elif part:
            picked.append(part)
    return picked


def run_devices(kind: str, nproc: int, env: dict[str, str] | None = None) -> list[Device]:
    """The devices a job of ``nproc`` processes per node will use: the first ``nproc`` of its visible devices.

    Raises:
        DeviceError: the selection names a device the tool does not list.
    """
    env = os.environ if env is None else env
    variable = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}[kind]
    selection = visible_selection(env.get(variable))
    found = inventory(kind, dict(env))
    if found is None:  # no tool here: known by index only
        picked = selection if selection is not None else [str(i) for i in range(nproc)]
        note = f"{'nvidia-smi' if kind == 'cuda' else 'npu-smi'} not found: known by its index on this host only"
        return [Device(kind, p, f"{kind}:index:{p}", note=note) for p in picked[:nproc]]
    if selection is None:
        return found[:nproc]
    chosen = []
    for entry in selection[:nproc]:
        if entry.isdigit():  # an index counts the devices this process sees, in the order the tool lists them
            device = found[int(entry)] if int(entry) < len(found) else None
        else:  # a UUID (CUDA accepts "GPU-<uuid>" and its prefixes) or a bus id
            device = next(
                (d for d in found if d.identity.split(":", 1)[1].startswith(entry.lower() if kind == "npu" else entry)),
                None,
            )
        if device is None and entry.startswith("MIG-"):  # a MIG slice: its UUID is its identity (not in --query-gpu)
            device = Device(kind, entry, f"cuda:{entry}", note="a MIG slice: its memory and processes are not read")
        if device is None:
            listed = ", ".join(f"{i} ({d.identity})" for i, d in enumerate(found)) or "none"
            raise DeviceError(
                f"{variable}={env.get(variable)} names device {entry!r}, which is not among the "
                f"{len(found)} device(s) seen here: {listed}; pick from them"
            )
        chosen.append(device)
    return chosen
