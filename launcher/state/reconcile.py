"""What a run's record is held against the live system to: the answer (``Reconciled``), what the Docker
engine says of a container (``ContainerView``), and the rules every placement shares.

Each placement (``run/placement/``) reconciles its own runs: a local run by its processes, a container run seen
from the host through the engine, a Slurm run through Slurm. What they share is here: a record of another boot
is ``NODE_LOST`` (``rebooted``), a run whose pid namespace or container started again after its supervisor is
gone (``restarted_since``), and whether the run's pids can be checked from here (``same_namespace``).

Nothing here writes; callers that act on the answer record it through ``RunStore``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from launcher.state.procs import boot_id, pid_namespace
from launcher.state.record import RunRecord
from launcher.state.slurmjob import SlurmJobView
from launcher.state.states import RunState

Liveness = Literal["live", "gone", "unknown"]
# Docker's container states in which the run's processes can still be alive
CONTAINER_ALIVE = frozenset({"running", "paused", "restarting", "created"})


@dataclass
class Reconciled:
    """The state to show, why it differs from the record (``note``), and the job's live processes."""

    state: RunState
    recorded: RunState
    note: str | None = None
    live: list[Any] = field(default_factory=list)  # psutil.Process of the job still alive here
    liveness: Liveness = "live"
    container_state: str | None = None  # the engine's word, "gone", or None when unknown
    container_view: ContainerView | None = None  # the engine's whole answer, when it was asked
    slurm_view: SlurmJobView | None = None  # Slurm's answer for a submitted run (``launcher submit``)

    @property
    def live_pids(self) -> list[int]:
        return [p.pid for p in self.live]


@dataclass
class ContainerView:
    """What the Docker engine says of a container: ``state`` (its word, ``gone``, or None when no engine
    answers), when it last started (epoch seconds), while it runs its processes' command lines, its name
    now and, once it has exited, its exit code."""

    state: str | None = None
    started: float | None = None
    commands: list[str] | None = None
    name: str | None = None
    exit_code: int | None = None

    def describe(self) -> str:
        """The engine's answer in a few words: ``running``, ``Exited (0)`` (as ``docker ps`` says), ``gone``."""
        if self.state is None:
            return "state unknown (no answer from a Docker engine)"
        if self.state == "exited" and self.exit_code is not None:
            return f"Exited ({self.exit_code})"
        return self.state


def restarted_since(record: RunRecord, started: float | None) -> bool:
    """Whether the run's container (or this pid namespace) started again after the run's supervisor did:
    that run's supervisor is then certainly gone, whatever runs there now."""
    began = (record.supervisor or {}).get("create_time")
    return started is not None and isinstance(began, int | float) and started > float(began) + 1.0


def same_namespace(record: RunRecord) -> bool:
    """Whether the run's supervisor was recorded in this pid namespace (its pids can be checked here)."""
    recorded = (record.supervisor or {}).get("pid_ns")
    return recorded is None or recorded == pid_namespace()


def first_look(record: RunRecord, live: list[Any], here: bool) -> Reconciled:
    """The answer before a placement asks its own system: the record's state with the live processes found
    here; a live record of another boot of this host is ``NODE_LOST`` (its pids mean nothing now)."""
    result = Reconciled(record.state, record.state, live=live, liveness="live" if here else "unknown")
    current_boot = boot_id()
    if not record.terminal and record.boot_id and current_boot and record.boot_id != current_boot:
        result.state, result.live, result.liveness = RunState.NODE_LOST, [], "gone"
        result.note = "the host rebooted (boot id changed) since the run was recorded live"
    return result


def engine_time(iso: Any) -> float | None:
    """Docker's RFC 3339 time (nanoseconds, Z) as epoch seconds."""
    if not isinstance(iso, str) or iso.startswith("0001-"):
        return None
    try:
        head, _, frac = iso.rstrip("Z").partition(".")
        return datetime.fromisoformat(head).replace(tzinfo=UTC).timestamp() + float(f"0.{frac or 0}")
    except ValueError:
        return None
