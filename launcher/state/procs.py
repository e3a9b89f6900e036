"""Process identity and liveness, judged from the live system, never trusted from a file.

A recorded process is the same live process only if its pid exists, its start time matches and
(when recorded) its command line still names the run. A pid alone can be reused after a reboot or a
long run; "unknown" never leads to killing anything.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Any

import psutil

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_PID_NS = Path("/proc/self/ns/pid")


def boot_id() -> str | None:
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return None


def pid_namespace() -> str | None:
    """This process's pid namespace (``pid:[4026531836]``): pids recorded in another one mean nothing here."""
    try:
        return os.readlink(_PID_NS)
    except OSError:
        return None


_MOUNTINFO = Path("/proc/self/mountinfo")
# Docker bind-mounts /etc/hostname (and resolv.conf, hosts) from /var/lib/docker/containers/<id>/
_CONTAINER_ID = re.compile(r"/containers/([0-9a-f]{64})/")


def container_identity() -> dict[str, Any] | None:
    """The container this process runs in, as far as it can tell from inside: ``LAUNCHER_CONTAINER`` (the
    name compose gives it), its id from ``/proc/self/mountinfo``, and the image the compose file names
    (``LAUNCHER_IMAGE``, ``LAUNCHER_IMAGE_DIGEST``). None outside a container."""
    name = os.environ.get("LAUNCHER_CONTAINER")
    try:
        found = _CONTAINER_ID.search(_MOUNTINFO.read_text())
    except OSError:
        found = None
    if not name and not found:
        return None
    image = {"tag": os.environ.get("LAUNCHER_IMAGE"), "digest": os.environ.get("LAUNCHER_IMAGE_DIGEST") or None}
    return {"name": name, "id": found.group(1) if found else None, "image": image}


def namespace_started() -> float | None:
    """When this pid namespace's init (pid 1) started: a container's start, or the host's boot."""
    try:
        return psutil.Process(1).create_time()
    except (psutil.Error, OSError):
        return None


def identity(proc: psutil.Process) -> dict[str, Any]:
    """What we record about a process to recognise it later."""
    with proc.oneshot():
        return {"pid": proc.pid, "create_time": proc.create_time(), "cmdline": " ".join(proc.cmdline())[:500]}


def self_identity() -> dict[str, Any]:
    """This process's identity plus its pid namespace."""
    return {**identity(psutil.Process()), "pid_ns": pid_namespace()}


def find_live(record: dict[str, Any], must_contain: str | None = None) -> psutil.Process | None:
    """The live process matching ``record`` (pid + start time [+ command line]), or None."""
    try:
        proc = psutil.Process(int(record["pid"]))
        if abs(proc.create_time() - float(record["create_time"])) > 0.5:
            return None
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        if must_contain and must_contain not in " ".join(proc.cmdline()):
            return None
        return proc
    except (psutil.NoSuchProcess, psutil.AccessDenied, KeyError, TypeError, ValueError):
        return None


def tree(root_pid: int) -> list[psutil.Process]:
    """``root_pid`` and all its descendants that exist now."""
    try:
        root = psutil.Process(root_pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def terminate(procs: list[psutil.Process], grace_s: float, sig: int = signal.SIGTERM) -> list[int]:
    """Send ``sig`` to every process (and its process group), SIGKILL whatever outlives ``grace_s``.

    Each rank of a torchrun job runs in its own session and process group, so each group is
    signalled, not only torchrun's. Returns the pids that had to be killed.
    """
    # Each process gets the signal once: torchrun treats a second SIGTERM during its own shutdown as a
    # new failure (a SignalException from inside its cleanup, and a meaningless exit code).
    own = _pgid(os.getpid())
    by_group: dict[int | None, list[psutil.Process]] = {}
    for proc in procs:
        by_group.setdefault(_pgid(proc.pid), []).append(proc)
    for pgid, members in by_group.items():
        try:
            if pgid is not None and pgid != own:
                os.killpg(pgid, sig)
                continue
        except (ProcessLookupError, PermissionError):
            pass
        for proc in members:  # our own group (never signalled as a whole), or the group call failed
            try:
                proc.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    return [p.pid for p in alive]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None
