"""Automatic recovery: which failed attempts are resumed by the supervisor itself (``launcher.restart``).

Off by default. With ``launcher.restart: {max_restarts: N, backoff_s: S}`` a FAILED attempt whose cause is
one a new attempt can get past is resumed ``S`` seconds later from the last complete checkpoint, in the
same run directory, as attempt N+1 (like ``launcher resume``), at most N times per supervisor:

- a rank (or the job's root) killed by a signal that no one of ours sent: the kernel's OOM killer is
  the exception, it is ``OUT_OF_MEMORY`` and never retried;
- a collective that timed out or a peer that went away (NCCL/HCCL/gloo watchdog, a broken rendezvous,
  a node that dropped out and rejoins);
- the hang watchdog with ``stall_action: restart``.

Never retried: ``OUT_OF_MEMORY`` (the same batch fails again), ``FAILED_SETUP`` and
``FAILED_ACCEPTANCE`` (nothing a restart changes), a user's or an outside stop, and a rank that raised an
ordinary error (a bug or bad data: it fails the same way at the same step).
"""

from __future__ import annotations

import re
import signal as _signal
from typing import Any

from launcher.state.states import RunState

# What a collective timeout or a lost peer prints (NCCL, HCCL, gloo, torch elastic's rendezvous).
_COLLECTIVE = re.compile(
    r"Watchdog caught collective operation timeout|collective operation timeout|NCCL (?:communicator|error|timeout)"
    r"|ncclRemoteError|ncclSystemError|HCCL.{0,40}(?:timeout|time out|timed out)|EI0002|EI0006"
    r"|Connection (?:reset|closed) by peer|RendezvousTimeoutError|RendezvousClosedError|DistNetworkError"
    r"|DistBackendError|socket timeout|gloo.{0,40}(?:Timed out|timeout|Connection)",
    re.IGNORECASE,
)


def retry_cause(
    state: RunState,
    *,
    signal: int | None,
    failed_rank: dict[str, Any] | None,
    reason: str | None,
    stopped: bool,
    stalled: bool = False,
) -> str | None:
    """Why this attempt's failure is worth a new attempt, or None when it is not."""
    if state is not RunState.FAILED or stopped:
        return None
    if stalled:
        return "hang watchdog: no progress with live processes (stall_action: restart)"
    if failed_rank and failed_rank.get("signal"):
        sig = int(failed_rank["signal"])
        return f"rank {failed_rank.get('rank')} killed by signal {sig} ({_name(sig)})"
    if signal:
        return f"the job was killed by signal {signal} ({_name(signal)})"
    if reason and (found := _COLLECTIVE.search(reason)):
        return f"collective timeout or lost peer ({found.group(0)})"
    return None


def not_retried_why(state: RunState, stopped: bool) -> str:
    """A short line for the record when a failure is not retried."""
    if stopped:
        return "a stop is never retried"
    if state is RunState.OUT_OF_MEMORY:
        return "OUT_OF_MEMORY is never retried (the same batch would fail again): lower the batch or cutoff_len"
    if state is not RunState.FAILED:
        return f"{state.value} is never retried"
    return "the cause is not one a restart gets past (a rank raised an error; see the reason)"


def _name(sig: int) -> str:
    try:
        return _signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"
