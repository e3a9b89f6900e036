"""The interface every placement implements: where a run's processes live, and how the launcher reaches them.

A placement is chosen once per record (``placement_of`` in this package's ``__init__``) and asked for everything
that depends on where the run lives:

- ``start``: begin a run there (a class method: no record exists yet);
- ``reconcile``: the record held against the live system (``state/reconcile.py``'s ``Reconciled``);
- ``stop``: stop it; the grace is decided here, once, by ``state/stop.py``'s ``stop_grace`` (given, else the
  run's recorded ``launcher.stop_grace_s``, else the default), and handed to the placement's ``_stop``;
- ``resume``: carry out a resume plan (``run/resume.py``) there;
- ``status_fields``: what ``launcher status`` shows of the placement;
- ``where``: the placement in a few words, for messages; ``own_files``: whether the run saw the files under
  paths of its own (a container's mounts), so that a verb on this machine must map them;
- ``lost_node``: for the supervisor of a run's first node, whether the end it saw was a lost node.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from launcher.errors import ExitCode, LauncherError
from launcher.state.reconcile import Reconciled
from launcher.state.record import RunRecord, RunStore
from launcher.state.stop import stop_grace

if TYPE_CHECKING:
    from launcher.config.run_config import RunConfig
    from launcher.run.resume import ResumePlan

Supervise = Callable[..., int]  # run/supervisor.py's ``supervise(config, resume=plan)``, handed in


@dataclass(frozen=True)
class StopAsk:
    """What a ``launcher stop`` asks: ``given``, the grace as given (``--grace``) or None, passed on to the stop
    request the run's supervisor reads; ``grace``, the one rule's answer; no save when ``now``; who asks (``by``);
    how long to wait for the end (``wait_s``, None: the placement's own limit)."""

    given: float | None
    grace: float
    now: bool
    by: str
    wait_s: float | None = None


class Placement(ABC):
    """Where one run lives. Subclasses: ``LocalPlacement`` (a process of this pid namespace),
    ``ContainerPlacement`` (a container seen from the host, through the Docker engine), ``SlurmPlacement`` (a
    batch job, through Slurm)."""

    kind: ClassVar[str]
    own_files: ClassVar[bool] = False

    def __init__(self, record: RunRecord) -> None:
        self.record = record

    @staticmethod
    @abstractmethod
    def holds(record: RunRecord) -> bool:
        """Whether this placement is where ``record``'s run lives, as seen from here."""

    @classmethod
    def start(cls, config: RunConfig, **options: Any) -> int:
        """Begin a new run in this placement; a placement the launcher does not start refuses."""
        raise LauncherError(f"a {cls.kind} run is not started by the launcher", ExitCode.USAGE)

    @abstractmethod
    def reconcile(self, run_dir: Path) -> Reconciled:
        """The record held against the live system: the state to show, why, and the job's live processes."""

    def stop(
        self,
        run_dir: Path,
        store: RunStore,
        seen: Reconciled,
        grace_s: float | None,
        now: bool,
        by: str,
        wait_s: float | None = None,
    ) -> int:
        """Stop the live run (``launcher stop``): a save on stop first unless ``now``; ``grace_s`` as given
        (``--grace``), or None. Returns the verb's exit code."""
        return self._stop(run_dir, store, seen, StopAsk(grace_s, self.grace(grace_s), now, by, wait_s))

    def grace(self, grace_s: float | None) -> float:
        """The stop's grace in seconds: the one rule (``state.stop.stop_grace``), the same in every placement."""
        return stop_grace(grace_s, self.record.stop_grace_s)

    @abstractmethod
    def _stop(self, run_dir: Path, store: RunStore, seen: Reconciled, ask: StopAsk) -> int:
        """Stop the run as ``ask`` says, ``ask.grace`` seconds for its save."""

    @abstractmethod
    def resume(self, run_dir: Path, plan: ResumePlan, adapter_only: bool, in_process: Supervise | None) -> int:
        """Carry out ``plan``, a new attempt of the run, in this placement. ``in_process``: the supervisor entry
        (``run/supervisor.py``: ``supervise``) when the attempt is to be supervised by this very process
        (``--foreground``), else None (handed in: this package sits below the supervisor, which asks it about
        earlier runs)."""

    def status_fields(self, seen: Reconciled) -> dict[str, Any]:
        """The placement's part of ``launcher status --json`` (the keys every run shows, None where unknown)."""
        return {"slurm_state": None, "slurm_status": None}

    @abstractmethod
    def where(self) -> str:
        """The placement in a few words: ``container NAME``, ``Slurm job N``, ``this pid namespace``."""

    def lost_node(self, node_rank: int) -> str | None:
        """What the placement says of a lost node of the run (the first node's supervisor asks after a failed
        end); None: no node was lost, or the placement has no nodes to lose."""
        return None
