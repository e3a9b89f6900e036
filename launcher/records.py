"""Durable run records: ``status.json`` (atomic replace) and ``events.jsonl`` (append-only).

A status write goes to a temporary file in the same folder, is fsynced, renamed over the old file,
and the folder is fsynced: a reader sees the old record or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from datetime import UTC, datetime
from enum import Enum
from pathlib import Path
from typing import Any

STATUS_FILE = "status.json"
EVENTS_FILE = "events.jsonl"
SCHEMA_VERSION = 1


class RunState(str, Enum):
    """Run states; see ``TERMINAL`` for the ones a run ends in."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    FINISHING = "FINISHING"
    STALLED = "STALLED"
    SUCCEEDED = "SUCCEEDED"
    FAILED_ACCEPTANCE = "FAILED_ACCEPTANCE"
    FAILED = "FAILED"
    FAILED_SETUP = "FAILED_SETUP"
    CANCELLED = "CANCELLED"
    TERMINATED = "TERMINATED"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    SUPERVISOR_LOST = "SUPERVISOR_LOST"
    NODE_LOST = "NODE_LOST"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset(
    {
        RunState.SUCCEEDED,
        RunState.FAILED_ACCEPTANCE,
        RunState.FAILED,
        RunState.FAILED_SETUP,
        RunState.CANCELLED,
        RunState.TERMINATED,
        RunState.OUT_OF_MEMORY,
        RunState.SUPERVISOR_LOST,
        RunState.NODE_LOST,
    }
)


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that readers see the old file or the new one, never half of one.

    The text goes to a temporary file in the same folder, is fsynced and renamed over ``path``, and the
    folder is fsynced. If anything fails, the old file stays as it was.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_json_atomic(path: Path, data: Any) -> None:
    """Replace ``path`` with ``data`` as JSON so that readers never see a partial file."""
    write_text_atomic(path, json.dumps(data, indent=2, default=str) + "\n")


def append_event(run_dir: Path, kind: str, **fields: Any) -> dict[str, Any]:
    """Append one event line to ``events.jsonl`` and fsync it."""
    event = {"time": now_iso(), "event": kind, **fields}
    with open(run_dir / EVENTS_FILE, "a") as f:
        f.write(json.dumps(event, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return event


class StatusRecord:
    """The run's ``status.json``, updated field by field and always written whole."""

    def __init__(self, run_dir: Path, run_id: str):
        self.path = run_dir / STATUS_FILE
        self.data: dict[str, Any] = {
            "schema": SCHEMA_VERSION,
            "run_id": run_id,
            "run_dir": str(run_dir),
            "hostname": socket.gethostname(),
            "state": RunState.PENDING.value,
            "created": now_iso(),
        }

    @classmethod
    def reopen(cls, run_dir: Path, data: dict[str, Any]) -> StatusRecord:
        """Continue an existing record (a resumed attempt, or a state fixed up from outside)."""
        record = cls(run_dir, str(data.get("run_id", run_dir.name)))
        record.data.update(data)
        return record

    def update(self, **fields: Any) -> None:
        for key, value in fields.items():
            self.data[key] = value.value if isinstance(value, RunState) else value
        self.data["updated"] = now_iso()
        write_json_atomic(self.path, self.data)


def read_status(run_dir: Path) -> dict[str, Any]:
    """Read ``status.json``; raises ``ValueError`` naming the path if it is missing or damaged."""
    path = run_dir / STATUS_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as err:
        raise ValueError(f"unreadable: {path} (missing)") from err
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"unreadable: {path} ({err})") from err
    if not isinstance(data, dict) or data.get("schema") != SCHEMA_VERSION:
        raise ValueError(f"unreadable: {path} (not a status record of schema {SCHEMA_VERSION})")
    if data.get("state") not in {s.value for s in RunState}:  # every reader turns it into a RunState
        raise ValueError(f"unreadable: {path} (unknown state {data.get('state')!r})")
    return data
