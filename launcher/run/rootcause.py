"""Why a job failed: the failing rank's error file, torch elastic's failure summary, the last traceback.

torchrun and accelerate launch exit 1 whatever a rank died of; the rank's own exit code or signal is
only in the summary torch elastic prints, and the useful traceback is the rank's, not torchrun's.
"""

from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from launcher.files import read_optional, read_tail
from launcher.rank.oomtrack import summary
from launcher.run.rundir import RunDir
from launcher.state.record import OutOfMemory
from launcher.state.runs import ERROR_RECORD, ERRORS_DIR

_RANK_FAILURE = re.compile(
    r"Root Cause \(first observed failure\):\s*\[\d+\]:.*?"
    r"rank\s*:\s*(-?\d+).*?exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)",
    re.S,
)


def rank_failure(log_path: Path, max_bytes: int = 256 << 10, start: int = 0) -> dict[str, Any] | None:
    """The first failing rank as torch elastic reports it: rank, pid, and exit code or signal.

    torchrun (and accelerate launch, which runs it) exits 1 when any rank fails; the rank's own exit
    code (negative: the signal) is only in the ``ChildFailedError`` summary it prints
    (``torch/distributed/elastic/multiprocessing/errors/__init__.py``, ``_FAILURE_FORMAT_TEMPLATE``).
    """
    tail = read_tail(log_path, max_bytes, start).decode(errors="replace")
    found = list(_RANK_FAILURE.finditer(tail))
    if not found:
        return None
    rank, code, pid = (int(x) for x in found[-1].groups())
    return {"rank": rank, "pid": pid, "exit_code": code if code >= 0 else None, "signal": -code if code < 0 else None}


def describe_rank_failure(failed: dict[str, Any]) -> str:
    if failed["signal"] is not None:
        try:
            name = signal.Signals(failed["signal"]).name
        except ValueError:
            name = "?"
        return f"rank {failed['rank']} (pid {failed['pid']}) killed by signal {failed['signal']} ({name})"
    return f"rank {failed['rank']} (pid {failed['pid']}) exit code {failed['exit_code']}"


class DiskRefusal(TypedDict, total=False):
    """``files.disk_error``: the disk's refusal of a write."""

    errno: str
    path: str | None
    free_bytes: int | None
    message: str | None


@dataclass(frozen=True)
class ErrorRecord:
    """``errors/rank<N>.json`` (``rank/entry.py: write_error_file``): a rank's exception and traceback."""

    rank: int | None = None
    time: float = 0.0
    pid: int | None = None
    type: str | None = None
    message: str | None = None
    traceback: str = ""
    disk: DiskRefusal | None = None
    out_of_memory: OutOfMemory | None = None


ERROR_RECORD_MAX_BYTES = 4 << 20  # a traceback of a few KB; a record past this is damaged or planted
ERROR_RECORD_MAX_DEPTH = 8


def first_error_record(run_dir: RunDir, since: float = 0.0) -> ErrorRecord | None:
    """The error record (``errors/rank<N>.json``, written by ``entry.write_error_file``) of the first rank that
    failed at or after ``since``, or None. A record that cannot be read as one is passed over."""
    records = []
    for path in (run_dir.path / ERRORS_DIR).glob(ERROR_RECORD.format(rank="*")):
        record, _ = read_optional(path, ErrorRecord, ERROR_RECORD_MAX_BYTES, ERROR_RECORD_MAX_DEPTH)
        if record is not None and record.time >= since:  # not an earlier attempt's
            records.append(record)
    return min(records, key=lambda r: r.time) if records else None


def out_of_memory(run_dir: RunDir, since: float = 0.0) -> dict[str, Any] | None:
    """The first failing rank's out-of-memory record (phase, step, layer, memory, fix) and its rank, if it ran out."""
    first = first_error_record(run_dir, since)
    return {"rank": first.rank, **first.out_of_memory} if first and first.out_of_memory is not None else None


def root_cause(run_dir: RunDir, max_lines: int = 30, since: float = 0.0, log_start: int = 0) -> str | None:
    """Why the job failed: the first failing rank's error file, else the log's last traceback."""
    first = first_error_record(run_dir, since)
    if first is not None:
        lines = first.traceback.rstrip().splitlines()
        disk = first.disk
        head = (
            f"the disk refused a write: {disk.get('errno')} ({disk.get('message')}) writing {disk.get('path')}, "
            f"{disk.get('free_bytes')} bytes free\n"
            if disk
            else ""
        )
        if first.out_of_memory is not None:
            head = summary(first.out_of_memory) + "\n" + head
        return f"rank {first.rank}: {head}" + "\n".join(lines[-max_lines:])
    return last_traceback(run_dir.log, max_lines=max_lines, start=log_start)


def disk_state(folder: Path, least_free: int = 1 << 20) -> str | None:
    """Why the disk under ``folder`` refuses writes now (read-only, or under ``least_free`` bytes free), or None.

    A job that dies of a full or read-only disk often cannot write its own error record, so the supervisor asks
    the disk itself when it records the end."""
    try:
        usage = os.statvfs(folder)
    except OSError as exc:
        return f"the run folder's disk cannot be read ({exc.strerror})"
    if usage.f_flag & os.ST_RDONLY:
        return f"the run folder's disk is read-only ({folder})"
    free = usage.f_bavail * usage.f_frsize
    if free < least_free:
        return f"the run folder's disk is full ({free} bytes free under {folder})"
    return None


def last_traceback(log_path: Path, max_bytes: int = 256 << 10, max_lines: int = 30, start: int = 0) -> str | None:
    """The last Python traceback in the job log (its final ``max_lines`` lines), if any."""
    tail = read_tail(log_path, max_bytes, start)
    end = len(tail)
    while (at := tail.rfind(b"Traceback (most recent call last):", 0, end)) >= 0:
        lines = tail[at:].decode(errors="replace").splitlines()
        block = [lines[0]]
        for line in lines[1:]:
            block.append(line)
            if line and not line.startswith((" ", "\t")):
                break
        # torchrun's own traceback says only that a child failed; the rank's traceback, if any, is earlier
        if "ChildFailedError" not in block[-1]:
            return "\n".join(block[-max_lines:])
        end = at
    return None
