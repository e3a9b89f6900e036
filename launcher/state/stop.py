"""The stop protocol: the stop request, the save on stop it leads to, the one rule for whether a job can save,
and the checkpoint it saved. Every reader and writer of these run-folder files is here (their names are in
``state/runs.py``); the supervisor (``run/supervisor.py``), ``launcher stop`` (``run/control.py``,
``run/placement/``) and each rank (``rank/stopsave.py``) use them.

- ``stop_request.json`` (``request_stop``): written by ``launcher stop`` before its SIGTERM reaches the
  supervisor: who asked, the grace, ``now`` (no save: the ranks die of their SIGTERM). Read by the supervisor,
  and for ``now`` by each rank.
- ``save_on_stop.json`` (``announce_save``): written by local rank 0 once training began: this job honours a
  save request. ``job_can_save`` decides from it whether a stop asks the job to save or stops it at once.
- ``save_request.json`` (``ask_to_save``): written by the supervisor, or by ``launcher stop`` when the
  supervisor is gone: save a checkpoint at the next step, then exit. Each rank looks for it at every step end.
- ``stop_saved.json`` (``record_saved``): written by local rank 0 once the requested checkpoint is complete;
  ``saved_checkpoint`` holds it against the checkpoints on disk.

Layer 1: imports ``files`` and ``state`` only, so that the ranks (layer 3) use the same code as the supervisor.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.files import read_optional, write_json_atomic, write_json_or_warn
from launcher.state.checkpoints import last_complete_checkpoint
from launcher.state.record import now_iso
from launcher.state.runs import CHECKPOINT_FOLDER, OUTPUT_SUBDIR, SAVE_DONE, SAVE_READY, SAVE_REQUEST, STOP_REQUEST
from launcher.state.states import RunState

DEFAULT_STOP_GRACE_S = 120.0  # launcher.stop_grace_s's default, for a record that does not say
SAVE_KILL_GRACE_S = 10.0  # after a save on stop that did not end the job in time: SIGTERM, then SIGKILL
STOP_FILE_MAX_BYTES = 64 << 10  # each of these files holds a few fields; past this one is damaged or planted
STOP_FILE_MAX_DEPTH = 4


# --- the records, as their readers see them (``launcher.files.read_typed``: other keys are ignored) ---------------


@dataclass(frozen=True)
class StopRequest:
    """``stop_request.json``."""

    time: str | None = None
    grace_s: float | None = None
    by: str | None = None
    now: bool = False


@dataclass(frozen=True)
class SaveReady:
    """``save_on_stop.json``: the announcing rank's pid."""

    pid: int | None = None
    time: float | None = None
    step: int | None = None


@dataclass(frozen=True)
class SaveDone:
    """``stop_saved.json``: the step saved, its folder relative to the run directory."""

    step: int | None = None
    path: str | None = None
    time: float | None = None
    signalled: bool | None = None


def _read(path: Path, model: Any) -> Any:
    """One of the files above, or None when it is missing or unreadable (then it asks nothing: a damaged stop
    request is no request, a damaged announcement no promise to save, a damaged save record no saved step)."""
    return read_optional(path, model, STOP_FILE_MAX_BYTES, STOP_FILE_MAX_DEPTH)[0]


# --- the stop request: `launcher stop` -> the supervisor (and, for `now`, the ranks) ---------------------------


def request_stop(run_dir: Path, grace_s: float | None, by: str, now: bool = False) -> None:
    """Leave a stop request for the run's supervisor (read when it receives SIGTERM). ``now`` skips the save."""
    write_json_atomic(run_dir / STOP_REQUEST, {"time": now_iso(), "grace_s": grace_s, "by": by, "now": now})


def read_stop_request(run_dir: Path) -> StopRequest | None:
    """The stop request ``launcher stop`` left, or None (none, or unreadable)."""
    return _read(run_dir / STOP_REQUEST, StopRequest)


def skips_save(request: StopRequest | None) -> bool:
    """The stop request is ``launcher stop --now``: no save, the job is stopped at once."""
    return request is not None and request.now


def clear_stop_request(run_dir: Path) -> None:
    """Forget the stop request (a new attempt begins, or the stop it was left for did not happen)."""
    (run_dir / STOP_REQUEST).unlink(missing_ok=True)


# --- the save on stop: the supervisor (or `stop`) asks, the ranks answer ---------------------------------------


def clear_save_files(run_dir: Path) -> None:
    """Forget what an earlier attempt's job announced, was asked and saved: the new attempt starts clean."""
    for name in (SAVE_REQUEST, SAVE_READY, SAVE_DONE):
        (run_dir / name).unlink(missing_ok=True)


def announce_save(run_dir: Path, step: int) -> None:
    """In local rank 0 once training began: this job honours a save request (its pid is how ``job_can_save``
    knows the announcing rank is still alive). A write the disk refuses is a warning, never the rank's end."""
    write_json_or_warn(
        run_dir / SAVE_READY, {"pid": os.getpid(), "time": time.time(), "step": step}, "the save-on-stop announcement"
    )


def job_can_save(run_dir: Path, state: RunState, live_pids: Iterable[int]) -> bool:
    """Whether a stop asks the job to save a checkpoint and exit, rather than stopping it at once: the job has
    optimizer steps left to stop at (the run is not ``FINISHING``), and it announced that it honours a save
    request (``save_on_stop.json``) from a rank that is still alive among ``live_pids``, the job's processes.

    The one rule for the supervisor and for ``launcher stop`` after a lost supervisor. The pid makes an
    announcement left by an earlier attempt, or by a rank that has since died, count for nothing."""
    if state is RunState.FINISHING:
        return False
    ready: SaveReady | None = _read(run_dir / SAVE_READY, SaveReady)
    return ready is not None and ready.pid is not None and ready.pid in set(live_pids)


def announced_at(run_dir: Path) -> float | None:
    """When this folder's job announced that it honours a save request (epoch seconds), or None; read from the
    file alone, for a reader on another host than the ranks (``launcher stop`` of a Slurm run)."""
    ready: SaveReady | None = _read(run_dir / SAVE_READY, SaveReady)
    return ready.time if ready is not None else None


def ask_to_save(run_dir: Path, why: str, anew: bool = False) -> None:
    """Ask the job to save a checkpoint at the next step and exit (every rank looks at each step end).
    ``anew``: first forget a save recorded before (``stop`` after a lost supervisor, which cleared nothing).

    Raises:
        OSError: the request could not be written (the job then is stopped without a save)."""
    if anew:
        (run_dir / SAVE_DONE).unlink(missing_ok=True)
    write_json_atomic(run_dir / SAVE_REQUEST, {"time": now_iso(), "why": why})


def save_asked(run_dir: Path) -> bool:
    """A save on stop was asked for (by the supervisor, its watchdog, or ``launcher stop``)."""
    return (run_dir / SAVE_REQUEST).exists()


def record_saved(run_dir: Path, step: int, signalled: bool) -> None:
    """In local rank 0 once the requested ``checkpoint-<step>`` is complete: the step, its folder (relative to
    the run directory) and whether a SIGTERM (rather than the request file) asked for it."""
    done = {
        "step": step,
        "path": str(Path(OUTPUT_SUBDIR) / CHECKPOINT_FOLDER.format(step=step)),
        "time": time.time(),
        "signalled": signalled,
    }
    write_json_or_warn(run_dir / SAVE_DONE, done, "the saved checkpoint's record")


def read_saved(run_dir: Path) -> SaveDone | None:
    """What the job recorded saving on the stop (``stop_saved.json``), or None (none, or unreadable)."""
    return _read(run_dir / SAVE_DONE, SaveDone)


def saved_checkpoint(run_dir: Path, saved: SaveDone | None) -> dict[str, Any] | None:
    """The checkpoint the job reported saving on a stop (``read_saved``), if it is the newest complete one on
    disk: ``{step, path, optimizer_state}``, the path relative to the run directory."""
    if saved is None or saved.step is None:
        return None
    last = last_complete_checkpoint(run_dir / OUTPUT_SUBDIR)
    if last is None or last.step != saved.step:
        return None
    return {"step": last.step, "path": last.relative_to(run_dir), "optimizer_state": last.optimizer_state}


def stop_grace(given: float | None, recorded: float | None) -> float:
    """The one grace rule of a stop, wherever the run lives (a local process, a container, a Slurm job): the grace
    given (``--grace``), else the one the run recorded (``launcher.stop_grace_s``), else ``DEFAULT_STOP_GRACE_S``.
    A grace of 0 is a grace of 0, never the default."""
    if given is not None:
        return given
    return DEFAULT_STOP_GRACE_S if recorded is None else recorded
