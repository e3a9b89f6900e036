"""The run record: ``status.json`` (one typed record, replaced atomically) and ``events.jsonl`` (append-only).

``RunStore`` is the only writer of both. It checks every state change against ``states.TRANSITIONS``,
and ``record_end`` writes the terminal status first and the ``ended`` event second, so that a reader
who sees the event always finds the end state.

A write the disk refuses (ENOSPC, EIO, a read-only remount) never raises out of ``RunStore``: the last
good ``status.json`` stays, the new record and the events not yet written are kept in memory, in order,
and go out with the next write that succeeds; the failure is reported on stderr at once and recorded in
``record_write_failures`` once a write lands again. ``reserve`` keeps a small file of real bytes in the
run directory, given back when the disk is full, so that the end record fits even on a disk that stays
full. Paths in the record are relative to the run directory
(``output/trainer_log.jsonl``); readers resolve them against the folder they found the record in, so a
run written inside a container under another mount point reads the same on the host.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypedDict, get_type_hints

from launcher.errors import ExitCode, LauncherError
from launcher.files import (
    Unreadable,
    append_line,
    kind_of,
    read_json_bounded,
    type_problem,
    unreadable,
    write_json_atomic,
)
from launcher.state.runs import EVENTS_FILE, OUTPUT_SUBDIR, RESERVE_FILE, STATUS_FILE, TRAINER_LOG
from launcher.state.states import TERMINAL, RunState, check_transition

RESERVE_BYTES = 256 << 10
SCHEMA_VERSION = 2
READABLE_SCHEMAS = (1, 2)  # schema 1 had the same keys, with absolute paths
# A record holds a few KB (a run restarted a hundred times: some 100 KB) and nests 4 levels; past these
# bounds the file is damaged or planted and is refused before it is parsed (launcher.files.read_json_bounded).
MAX_RECORD_BYTES = 4 << 20
MAX_RECORD_DEPTH = 32
MAX_RECORD_ITEMS = 100_000  # a record of a thousand restarts holds some tens of thousands of values


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def parse_time(text: str) -> datetime:
    """An ISO 8601 timestamp of a record as an aware datetime: one without a UTC offset is taken as UTC (the
    launcher writes UTC; a hand-edited or foreign record may leave the offset out).

    Raises:
        ValueError: not an ISO 8601 timestamp.
    """
    if not isinstance(text, str) or len(text) > 64:
        raise ValueError(f"not a timestamp: {text!r:.70}")
    moment = datetime.fromisoformat(text)
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


class RecordUnreadable(LauncherError):
    """A run's record (``status.json``, another file a verb needs) is missing, damaged, of a newer schema or
    of the wrong shape; the message (one line) names the path and says why. Every host verb catches this
    one error per run."""

    def __init__(self, path: Path, why: str):
        super().__init__(unreadable(path, why), ExitCode.FAILED)
        self.path = path


# The shapes of the mappings a record holds, as the code reads them. Keys are optional (older records lack
# some); a key that is there must have its type, so that no reader meets a string where it counts.
class Identity(TypedDict, total=False):
    pid: int
    create_time: float
    cmdline: str  # joined, cut at 500 characters (procs.identity)
    pid_ns: int | str | None


class Attempt(TypedDict, total=False):
    attempt: int
    state: str
    cause: str
    exit_code: int | None
    signal: int | None
    failed_rank: dict[str, Any] | None
    ended: str
    last_step: int | None
    resumed_step: int | None
    steps_lost: int | None
    reason: str | None


class WriteFailure(TypedDict, total=False):
    since: str
    until: str | None
    failed_writes: int
    error: str


class FailedRank(TypedDict, total=False):
    rank: int | None
    exit_code: int | None
    signal: int | None


class OutOfMemory(TypedDict, total=False):
    """The failing rank's out-of-memory record (``launcher.rank.oomtrack.describe``)."""

    rank: int | None
    phase: str
    step: int | None
    layer: int | None
    kind: str | None
    requested: int | None
    allocated: int | None
    reserved: int | None
    peak: int | None
    fix: str
    snapshot: str | None


class SavedCheckpoint(TypedDict, total=False):
    step: int | None
    path: str


class ContainerImage(TypedDict, total=False):
    tag: str | None
    digest: str | None


class Container(TypedDict, total=False):
    """``procs.container_identity``: what the supervisor saw of its container from inside."""

    name: str | None
    id: str | None
    image: ContainerImage | None


class Progress(TypedDict, total=False):
    """The supervisor's running summary of the trainer log (``TrainerLogFollower.summary``)."""

    step: int
    total_steps: int | None
    first_step: int
    records: int
    epoch: float
    percentage: float
    elapsed_time: str
    lr: float
    throughput: float
    loss: float
    loss_step: int
    eval_loss: float
    eval_step: int
    best_eval_loss: float
    best_eval_step: int
    training_done: bool


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
    supervisor: Identity | None = None
    boot_id: str | None = None
    container: Container | None = None  # name, id, image of the container the run lives in
    trainer_log: str = f"{OUTPUT_SUBDIR}/{TRAINER_LOG}"  # relative to the run directory
    resumed_from: str | None = None  # checkpoint folder, relative to the run directory
    resume_mode: str | None = None
    started: str | None = None
    heartbeat: str | None = None
    ended: str | None = None
    job_pid: int | None = None
    command: list[str] | None = None
    node: dict[str, Any] | None = None
    processes: list[Identity] = field(default_factory=list)
    progress: Progress = field(default_factory=dict)  # type: ignore[assignment]
    exit_code: int | None = None
    signal: int | None = None
    stop_signal: int | None = None
    reason: str | None = None
    failed_rank: FailedRank | None = None
    out_of_memory: OutOfMemory | None = None  # where the failing rank ran out of memory, and the fix
    leftover_pids_stopped: list[int] = field(default_factory=list)
    acceptance: dict[str, Any] | None = None
    # record writes the disk refused: {since, until, failed_writes, error}, one per outage
    record_write_failures: list[WriteFailure] = field(default_factory=list)
    stopped_by: str | None = None  # who sent the stop signal of a CANCELLED/TERMINATED run
    stop_sender: dict[str, Any] | None = None  # that signal's siginfo: signal, pid, uid, si_code, cmdline
    run_exit_code: int | None = None  # what `launcher run` returned for this attempt (states.EXIT_CODES)
    saved_checkpoint: SavedCheckpoint | None = None  # {step, path} saved on a stop (save on stop)
    stop_grace_s: float | None = None  # the save-on-stop grace, for `launcher stop` once the supervisor is gone
    attempts: list[Attempt] = field(default_factory=list)  # earlier attempts: state, cause, steps lost
    # a run submitted to Slurm (`launcher submit`): job_id, nodes, partition, time, runtime, image, script
    slurm: dict[str, Any] | None = None
    # the accelerators the run leased (state/lease.py): {host_index, identity} each; none on a CPU run
    devices: list[dict[str, Any]] = field(default_factory=list)

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
        hints = _field_types()
        values = {k: v for k, v in data.items() if k in hints}
        values.update(state=state, schema=SCHEMA_VERSION)
        if isinstance(values.get("container"), str):  # schema 1 kept the name only
            values["container"] = {"name": values["container"]}
        for key, value in values.items():
            if key != "state" and (why := type_problem(value, hints[key])):
                raise RecordUnreadable(path, f"field {key!r}: {why}")
        for key in TIME_FIELDS:  # every reader computes with them: aware, or the record is refused here
            if values.get(key) is not None:
                try:
                    values[key] = parse_time(values[key]).isoformat()
                except ValueError:
                    raise RecordUnreadable(path, f"field {key!r}: {kind_of(values[key])}, not a timestamp") from None
        try:
            return cls(**values)
        except TypeError as err:  # a required field missing
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


_FIELD_TYPES: dict[str, Any] = {}
TIME_FIELDS = ("created", "updated", "started", "heartbeat", "ended")


def _field_types() -> dict[str, Any]:
    if not _FIELD_TYPES:
        _FIELD_TYPES.update(get_type_hints(RunRecord))
    return _FIELD_TYPES


def read_record(run_dir: Path) -> RunRecord:
    """Read ``status.json`` (bounded in size and depth) into a ``RunRecord`` whose every field has its type.

    Raises:
        RecordUnreadable: missing, damaged, too large or deep, of the wrong shape, or not a record this
        launcher can read.
    """
    path = run_dir / STATUS_FILE
    try:
        data = read_json_bounded(path, MAX_RECORD_BYTES, MAX_RECORD_DEPTH, MAX_RECORD_ITEMS)
    except FileNotFoundError:
        raise RecordUnreadable(path, "missing") from None
    except Unreadable as err:
        raise RecordUnreadable(path, str(err)) from None
    return RunRecord.from_dict(data, path)


def _report(message: str) -> None:
    """A line on stderr (the terminal, or supervisor.log); a stderr that cannot be written is ignored."""
    try:
        print(message, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


class RunStore:
    """The owner of one run's ``status.json`` and ``events.jsonl``; the only code that writes them.

    Writes that fail are kept and retried (see the module docstring); ``landed`` says whether what the
    store holds is all on disk.
    """

    def __init__(self, run_dir: Path, record: RunRecord):
        self.run_dir = run_dir
        self.record = record
        self._dirty = False  # the record has changes status.json does not hold yet
        self._pending: list[dict[str, Any]] = []  # events not yet appended, oldest first
        self._failing: dict[str, Any] | None = None  # the outage going on, also in record_write_failures

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

    @property
    def landed(self) -> bool:
        """Everything recorded so far is on disk."""
        return not self._dirty and not self._pending

    @property
    def failing(self) -> dict[str, Any] | None:
        """The write failure going on (since, failed_writes, error), or None."""
        return self._failing

    def save(self, **values: Any) -> bool:
        """Update fields other than the state and write the whole record atomically; False when the disk
        refused (the record is kept and goes out with the next write that succeeds)."""
        if "state" in values:
            raise TypeError("change the state with transition() or record_end()")
        for key, value in values.items():
            if not hasattr(self.record, key):
                raise AttributeError(f"RunRecord has no field {key!r}")
            setattr(self.record, key, value)
        self.record.updated = now_iso()
        self._dirty = True
        return self.flush()

    def transition(self, state: RunState, *, event: str | None = "state", **values: Any) -> bool:
        """Move to ``state`` (checked against the table), write the record, then the event."""
        previous = self.record.state
        check_transition(previous, state)
        self.record.state = state
        landed = self.save(**values)
        if event and state is not previous:
            self.event(event, state=state.value, previous=previous.value)
        return landed and self.landed

    def record_end(self, state: RunState, **values: Any) -> bool:
        """Record a terminal state: status first, then the ``ended`` event with the same facts.

        On a full disk the reserve is given back and the write tried once more. Returns whether it all
        landed; if not, call ``land`` before giving up the run (the lock).
        """
        if state not in TERMINAL:
            raise ValueError(f"{state.value} is not a terminal state")
        values.setdefault("ended", now_iso())
        self.transition(state, event=None, **values)
        self.event("ended", state=state.value, **{k: v for k, v in values.items() if k != "acceptance"})
        if not self.landed and self.release_reserve():
            self.flush()
        if self.landed:
            self.release_reserve()
        return self.landed

    def event(self, kind: str, **values: Any) -> dict[str, Any]:
        """Append an event (after the record it follows: held back while status.json is behind)."""
        event = {"time": now_iso(), "event": kind, **values}
        self._pending.append(event)
        if not self._dirty:
            self.flush()
        return event

    def flush(self) -> bool:
        """Write what is not on disk yet: the record, then the events. False when the disk refused."""
        try:
            if self._dirty:
                write_json_atomic(self.path, self.record.to_dict())
                self._dirty = False
                if self._failing is not None:  # the disk takes writes again: close the outage, in the record too
                    self._recovered()
                    write_json_atomic(self.path, self.record.to_dict())
            while self._pending:
                append_line(self.run_dir / EVENTS_FILE, json.dumps(self._pending[0], default=str))
                self._pending.pop(0)
        except OSError as err:
            self._failed(err)
            return False
        return True

    def land(self, every_s: float = 2.0, report_every_s: float = 60.0) -> None:
        """Retry until everything is on disk (the end record must land before the lock is released)."""
        last_report = time.monotonic()
        while not self.flush():
            if time.monotonic() - last_report > report_every_s:
                _report(
                    f"warning: still cannot write {self.path} ({self._failing['error']}); the run's end "
                    f"is kept in memory and retried every {every_s:.0f} s: free space on that disk"
                )
                last_report = time.monotonic()
            time.sleep(every_s)

    def _failed(self, err: OSError) -> None:
        what = f"{errno.errorcode.get(err.errno or 0, 'error')}: {err.strerror or err}"
        if self._failing is None:
            self._failing = {"since": now_iso(), "until": None, "failed_writes": 0, "error": what}
            self.record.record_write_failures = [*self.record.record_write_failures, self._failing]
            self._dirty = True  # the outage itself goes into the next record that lands
            _report(
                f"warning: cannot write the run record in {self.run_dir} ({what}); keeping the last good "
                f"{STATUS_FILE} and retrying. Free space (or remount read-write) there."
            )
        self._failing["failed_writes"] += 1
        self._failing["error"] = what

    def _recovered(self) -> None:
        failing, self._failing = self._failing, None
        assert failing is not None
        failing["until"] = now_iso()
        _report(
            f"note: the run record in {self.run_dir} is written again ({failing['failed_writes']} write(s) "
            f"failed since {failing['since']}: {failing['error']})"
        )
        # its event goes before a pending `ended`, which stays the last event of the run
        at = next((i for i, e in enumerate(self._pending) if e["event"] == "ended"), len(self._pending))
        self._pending.insert(at, {"time": now_iso(), "event": "record_write_failed", **failing})

    def reserve(self, size: int = RESERVE_BYTES) -> None:
        """Keep ``size`` bytes of real data in the run directory, given back for the end record on a full
        disk. Best effort: on a disk already full there is nothing to keep."""
        path = self.run_dir / RESERVE_FILE
        try:
            with open(path, "wb") as f:
                f.write(b"\0" * size)
                f.flush()
                os.fsync(f.fileno())
        except OSError:
            path.unlink(missing_ok=True)

    def release_reserve(self) -> bool:
        """Delete the reserve file; True if there was one."""
        try:
            (self.run_dir / RESERVE_FILE).unlink()
        except OSError:
            return False
        return True
