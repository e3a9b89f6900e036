"""The run record: ``status.json`` (one typed record, replaced atomically) and ``events.jsonl`` (append-only).

``RunStore`` is the only writer of both. It checks every state change against ``states.TRANSITIONS``,
and ``record_end`` writes the terminal status first and the ``ended`` event second, so that a reader
who sees the event always finds the end state. Paths in the record are relative to the run directory
(``output/trainer_log.jsonl``); readers resolve them against the folder they found the record in, so a
run written inside a container under another mount point reads the same on the host.
"""

from __future__ import annotations

import json
import socket
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from launcher.errors import ExitCode, LauncherError
from launcher.files import append_line, write_json_atomic
from launcher.state.states import TERMINAL, RunState, check_transition

STATUS_FILE = "status.json"
EVENTS_FILE = "events.jsonl"
SCHEMA_VERSION = 2
READABLE_SCHEMAS = (1, 2)  # schema 1 had the same keys, with absolute paths


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


class RecordUnreadable(LauncherError):
    """``status.json`` is missing, damaged or of a newer schema; the message names the path."""

    def __init__(self, path: Path, why: str):
        super().__init__(f"unreadable: {path} ({why})", ExitCode.FAILED)
        self.path = path


@dataclass
class RunRecord:
    """What ``status.json`` holds. Process identities are ``{pid, create_time, cmdline}`` mappings."""

    run_id: str
    state: RunState = RunState.PENDING
    schema: int = SCHEMA_VERSION
    hostname: str = field(default_factory=socket.gethostname)
    run_dir: str | None = None  # where the writer saw the run directory (information only)
    created: str = field(default_factory=now_iso)
    updated: str | None = None
    attempt: int = 1
    smoke: bool | None = None
    backend: str | None = None
    supervisor: dict[str, Any] | None = None
    boot_id: str | None = None
    container: dict[str, Any] | None = None  # name, id, image of the container the run lives in
    trainer_log: str = "output/trainer_log.jsonl"  # relative to the run directory
    resumed_from: str | None = None  # checkpoint folder, relative to the run directory
    resume_mode: str | None = None
    started: str | None = None
    heartbeat: str | None = None
    ended: str | None = None
    job_pid: int | None = None
    command: list[str] | None = None
    node: dict[str, Any] | None = None
    processes: list[dict[str, Any]] = field(default_factory=list)
    progress: dict[str, Any] = field(default_factory=dict)
    exit_code: int | None = None
    signal: int | None = None
    stop_signal: int | None = None
    reason: str | None = None
    failed_rank: dict[str, Any] | None = None
    leftover_pids_stopped: list[int] = field(default_factory=list)
    acceptance: dict[str, Any] | None = None

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["state"] = self.state.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], path: Path) -> RunRecord:
        """Build a record from ``status.json``'s content; raises ``RecordUnreadable`` naming ``path``."""
        if not isinstance(data, dict) or data.get("schema") not in READABLE_SCHEMAS:
            schemas = ", ".join(map(str, READABLE_SCHEMAS))
            raise RecordUnreadable(path, f"not a status record of schema {schemas}")
        try:
            state = RunState(data.get("state"))
        except ValueError:
            raise RecordUnreadable(path, f"unknown state {data.get('state')!r}") from None
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values.update(state=state, schema=SCHEMA_VERSION)
        if isinstance(values.get("container"), str):  # schema 1 kept the name only
            values["container"] = {"name": values["container"]}
        try:
            return cls(**values)
        except TypeError as err:
            raise RecordUnreadable(path, str(err)) from None

    def resolve(self, run_dir: Path, relative: str | None) -> Path | None:
        """A path the record stores, under the run directory where it was found (absolute ones re-rooted)."""
        if not relative:
            return None
        path = Path(relative)
        if path.is_absolute():  # schema 1: re-root what follows the writer's run directory
            try:
                path = path.relative_to(self.run_dir or "")
            except ValueError:
                return path
        return run_dir / path


def read_record(run_dir: Path) -> RunRecord:
    """Read ``status.json``.

    Raises:
        RecordUnreadable: missing, damaged, or not a record this launcher can read.
    """
    path = run_dir / STATUS_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise RecordUnreadable(path, "missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RecordUnreadable(path, str(err)) from None
    return RunRecord.from_dict(data, path)


def append_event(run_dir: Path, kind: str, **values: Any) -> dict[str, Any]:
    """Append one event line to ``events.jsonl`` and fsync it."""
    event = {"time": now_iso(), "event": kind, **values}
    append_line(run_dir / EVENTS_FILE, json.dumps(event, default=str))
    return event


class RunStore:
    """The owner of one run's ``status.json`` and ``events.jsonl``; the only code that writes them."""

    def __init__(self, run_dir: Path, record: RunRecord):
        self.run_dir = run_dir
        self.record = record

    @classmethod
    def create(cls, run_dir: Path, run_id: str) -> RunStore:
        """A new run's record (PENDING); written at the first ``save``/``transition``."""
        return cls(run_dir, RunRecord(run_id=run_id, run_dir=str(run_dir)))

    @classmethod
    def open(cls, run_dir: Path) -> RunStore:
        """The existing record of ``run_dir``; raises ``RecordUnreadable``."""
        return cls(run_dir, read_record(run_dir))

    @property
    def state(self) -> RunState:
        return self.record.state

    @property
    def path(self) -> Path:
        return self.run_dir / STATUS_FILE

    def save(self, **values: Any) -> None:
        """Update fields other than the state and write the whole record atomically."""
        if "state" in values:
            raise TypeError("change the state with transition() or record_end()")
        for key, value in values.items():
            if not hasattr(self.record, key):
                raise AttributeError(f"RunRecord has no field {key!r}")
            setattr(self.record, key, value)
        self.record.updated = now_iso()
        write_json_atomic(self.path, self.record.to_dict())

    def transition(self, state: RunState, *, event: str | None = "state", **values: Any) -> None:
        """Move to ``state`` (checked against the table), write the record, then the event."""
        previous = self.record.state
        check_transition(previous, state)
        self.record.state = state
        self.save(**values)
        if event and state is not previous:
            self.event(event, state=state.value, previous=previous.value)

    def record_end(self, state: RunState, **values: Any) -> None:
        """Record a terminal state: status first, then the ``ended`` event with the same facts."""
        if state not in TERMINAL:
            raise ValueError(f"{state.value} is not a terminal state")
        values.setdefault("ended", now_iso())
        self.transition(state, event=None, **values)
        self.event("ended", state=state.value, **{k: v for k, v in values.items() if k != "acceptance"})

    def event(self, kind: str, **values: Any) -> dict[str, Any]:
        return append_event(self.run_dir, kind, **values)
