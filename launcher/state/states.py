"""Run states, the transitions allowed between them, and the one rule that names how a run ended.

Non-terminal: ``PENDING`` (lock taken, preflight running), ``RUNNING``, ``FINISHING`` (optimizer steps
done; final eval, save and cleanup still running), ``STALLED`` (processes alive, trainer log not
advancing; a warning, not an end). Terminal: everything else. A terminal state is left only by a new
attempt of a resumable run (``launcher resume``), which goes back to ``PENDING``; an automatic restart
(``launcher.restart``) goes back to ``PENDING`` from the failed attempt's live state, so that the run never
looks ended while its supervisor is about to continue it.

A write that asks for a transition outside ``TRANSITIONS`` is a bug in the launcher and raises
``IllegalTransition``; staying in the same state (a heartbeat) is not a transition.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal


class RunState(str, Enum):
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
# What `launcher resume` continues: a run that stopped or failed during training.
RESUMABLE = frozenset(
    {
        RunState.FAILED,
        RunState.CANCELLED,
        RunState.TERMINATED,
        RunState.OUT_OF_MEMORY,
        RunState.SUPERVISOR_LOST,
        RunState.NODE_LOST,
    }
)
_LOST = {RunState.SUPERVISOR_LOST, RunState.NODE_LOST}  # recorded from outside the supervisor
_ENDS_OF_A_JOB = TERMINAL - {RunState.FAILED_SETUP}

TRANSITIONS: dict[RunState, frozenset[RunState]] = {
    # preflight refuses (FAILED_SETUP), the supervisor fails (FAILED) or is stopped before the job starts
    RunState.PENDING: frozenset(
        {RunState.RUNNING, RunState.FAILED_SETUP, RunState.FAILED, RunState.CANCELLED, RunState.TERMINATED} | _LOST
    ),
    # -> PENDING: an automatic restart (launcher.restart) of an attempt that failed with a retryable cause
    RunState.RUNNING: frozenset({RunState.FINISHING, RunState.STALLED, RunState.PENDING} | _ENDS_OF_A_JOB),
    RunState.STALLED: frozenset({RunState.RUNNING, RunState.FINISHING, RunState.PENDING} | _ENDS_OF_A_JOB),
    RunState.FINISHING: _ENDS_OF_A_JOB | {RunState.PENDING},
    **{state: frozenset({RunState.PENDING}) for state in RESUMABLE},
    RunState.SUCCEEDED: frozenset(),
    RunState.FAILED_ACCEPTANCE: frozenset(),
    RunState.FAILED_SETUP: frozenset(),
}


class IllegalTransition(RuntimeError):
    """The launcher tried a state change the table does not allow (a bug, never a user's mistake)."""


def check_transition(current: RunState, new: RunState) -> None:
    """Raise ``IllegalTransition`` unless ``current -> new`` is allowed (or no change)."""
    if new is not current and new not in TRANSITIONS[current]:
        raise IllegalTransition(f"run state {current.value} -> {new.value} is not an allowed transition")


StopCause = Literal["user", "external"]


def end_state(
    *,
    exit_code: int | None,
    signal: int | None,
    stop: StopCause | None = None,
    accepted: bool | None = None,
    out_of_memory: bool = False,
) -> RunState:
    """The terminal state of a job that ended: a pure function of how it ended.

    Args:
        exit_code: the job's exit code (None when a signal ended it).
        signal: the signal that ended the job's root process, if any.
        stop: ``user`` for ``launcher stop``, ``external`` for a SIGTERM/SIGINT/SIGHUP from outside
            (``docker stop``, a closed terminal); a stop decides the state whatever the job returned.
        accepted: the acceptance checklist's verdict for a job that exited 0; None when this node does
            not run it (node 0 does).
        out_of_memory: the root cause reads as an out-of-memory kill.
    """
    if stop == "user":
        return RunState.CANCELLED
    if stop == "external":
        return RunState.TERMINATED
    if exit_code == 0 and signal is None:
        return RunState.FAILED_ACCEPTANCE if accepted is False else RunState.SUCCEEDED
    return RunState.OUT_OF_MEMORY if out_of_memory else RunState.FAILED


# What `launcher run` (and a foreground `launcher resume`) returns for each end state. ``None`` means "from
# the job": its own exit code, or 128 + signal when a signal killed it (a shell's convention), never 0.
EXIT_CODES: dict[RunState, int | None] = {
    RunState.SUCCEEDED: 0,
    RunState.FAILED: None,
    RunState.FAILED_SETUP: 2,
    RunState.FAILED_ACCEPTANCE: 4,
    RunState.OUT_OF_MEMORY: 5,
    RunState.SUPERVISOR_LOST: 6,
    RunState.NODE_LOST: 7,
    RunState.CANCELLED: None,  # 128 + the stop signal
    RunState.TERMINATED: None,  # 128 + the stop signal
}
EXIT_CODE_TABLE = """\
exit codes of `launcher run` (and `launcher resume --foreground`):
  0          SUCCEEDED: the job exited 0 and the acceptance checklist passed
  1, N       FAILED: the job's exit code (torchrun exits 1 whatever a rank died of)
  128 + N    FAILED: the job was killed by signal N (137: SIGKILL)
  2          FAILED_SETUP: config, preflight or environment refused before training
  3          refused: another run holds the lock or a device lease, or its processes are alive (no run
             started)
  4          FAILED_ACCEPTANCE: the job exited 0 but an acceptance check failed
  5          OUT_OF_MEMORY: a rank was killed as out of memory
  6, 7       SUPERVISOR_LOST, NODE_LOST: recorded from outside (status, list): the supervisor died
             without an end record; a Slurm run's node was lost
  128 + N    CANCELLED / TERMINATED: stopped by signal N (143: SIGTERM from `launcher stop` or
             `docker stop`, 130: Ctrl-C, 129: the terminal closed)"""


def run_exit_code(
    state: RunState, *, exit_code: int | None = None, signal: int | None = None, stop_signal: int | None = None
) -> int:
    """The exit code for a run that ended in ``state`` (``EXIT_CODES``; never 0 unless SUCCEEDED)."""
    if state not in TERMINAL:
        raise ValueError(f"{state.value} is not a terminal state")
    fixed = EXIT_CODES[state]
    if fixed is not None:
        return fixed
    if state in (RunState.CANCELLED, RunState.TERMINATED):
        return 128 + (stop_signal or 15)
    if signal:
        return 128 + signal
    return exit_code if exit_code else 1
