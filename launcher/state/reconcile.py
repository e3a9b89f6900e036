"""The state a run is really in: its record held against the live system.

One function, ``reconcile``, used by ``status``, ``list``, ``stop``, ``resume`` and the supervisor (when
it looks at earlier runs before a new one). For a record that is not terminal:

- recorded on another boot of this host: ``NODE_LOST`` (its pids mean nothing now);
- recorded in a container the Docker engine says is gone or no longer running: ``NODE_LOST``;
- recorded in this pid namespace: the supervisor is checked by pid, start time and command line; gone
  means ``SUPERVISOR_LOST``, with the job's surviving processes listed;
- recorded in another pid namespace (a container seen from the host): liveness comes from the engine;
  without an engine answer it is unknown, and the recorded state is shown with that note, never
  ``SUPERVISOR_LOST``.

Nothing here writes; callers that act on the answer record it through ``RunStore``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from launcher.state.procs import boot_id, find_live, namespace_started, pid_namespace
from launcher.state.record import RunRecord
from launcher.state.slurmjob import SlurmJobView, query_job
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


def find_container(client: Any, container: dict[str, Any] | None) -> Any | None:
    """The run's container as the docker SDK's object: by its recorded id, and by name only when no id was
    recorded (compose's fixed names are reused by later runs' containers); None when the engine no longer has
    it (``DockerException`` when it does not answer)."""
    from docker.errors import NotFound

    ref = (container or {}).get("id") or (container or {}).get("name")
    try:
        return client.containers.get(ref) if ref else None
    except NotFound:
        return None


def inspect_container(container: dict[str, Any] | None) -> ContainerView:
    """Ask the Docker engine about the run's container (by id, else by name)."""
    if not ((container or {}).get("id") or (container or {}).get("name")):
        return ContainerView()
    try:
        import docker
        from docker.errors import DockerException
    except ImportError:
        return ContainerView()
    try:
        found = find_container(docker.from_env(timeout=2), container)
    except (DockerException, OSError):
        return ContainerView()
    if found is None:
        return ContainerView("gone")
    state = (getattr(found, "attrs", None) or {}).get("State") or {}
    code = state.get("ExitCode")
    view = ContainerView(
        str(found.status),
        _epoch(state.get("StartedAt")),
        name=getattr(found, "name", None),
        exit_code=code if found.status == "exited" and isinstance(code, int) else None,
    )
    if view.state == "running":
        try:
            top = found.top()
            column = top["Titles"].index("CMD")
            view.commands = [str(p[column]) for p in top["Processes"] or []]
        except (DockerException, OSError, KeyError, TypeError, ValueError, AttributeError):
            pass
    return view


def _epoch(iso: Any) -> float | None:
    """Docker's RFC 3339 time (nanoseconds, Z) as epoch seconds."""
    if not isinstance(iso, str) or iso.startswith("0001-"):
        return None
    try:
        head, _, frac = iso.rstrip("Z").partition(".")
        return datetime.fromisoformat(head).replace(tzinfo=UTC).timestamp() + float(f"0.{frac or 0}")
    except ValueError:
        return None


def _restarted_since(record: RunRecord, started: float | None) -> bool:
    """Whether the run's container (or this pid namespace) started again after the run's supervisor did:
    that run's supervisor is then certainly gone, whatever runs there now."""
    began = (record.supervisor or {}).get("create_time")
    return started is not None and isinstance(began, int | float) and started > float(began) + 1.0


def same_namespace(record: RunRecord) -> bool:
    """Whether the run's supervisor was recorded in this pid namespace (its pids can be checked here)."""
    recorded = (record.supervisor or {}).get("pid_ns")
    return recorded is None or recorded == pid_namespace()


def reconcile(record: RunRecord, run_dir: Path) -> Reconciled:
    """Hold ``record`` (read from ``run_dir``) against this host, its processes and the Docker engine."""
    if (record.slurm or {}).get("job_id"):
        return _reconcile_slurm(record)
    here = same_namespace(record)
    live = [p for p in (find_live(r, str(record.run_id)) for r in record.processes) if p is not None] if here else []
    result = Reconciled(record.state, record.state, live=live, liveness="live" if here else "unknown")
    if record.terminal:
        return result
    current_boot = boot_id()
    if record.boot_id and current_boot and record.boot_id != current_boot:
        result.state, result.live, result.liveness = RunState.NODE_LOST, [], "gone"
        result.note = "the host rebooted (boot id changed) since the run was recorded live"
        return result
    if here and _restarted_since(record, namespace_started()):  # a restarted container may reuse its ns id
        result.state, result.live, result.liveness = RunState.NODE_LOST, [], "gone"
        result.note = "its container was restarted since the run was recorded live"
        return result
    if record.container:
        view = inspect_container(record.container)
        result.container_state, result.container_view, commands = view.state, view, view.commands
        name = record.container.get("name") or record.container.get("id")
        if result.container_state is not None and result.container_state not in CONTAINER_ALIVE:
            result.state, result.liveness = RunState.NODE_LOST, "gone"
            result.note = f"container {name} is {result.container_state}"
            return result
        if _restarted_since(record, view.started):
            result.state, result.liveness = RunState.NODE_LOST, "gone"
            result.note = f"container {name} was restarted since the run was recorded live"
            return result
        if not here:
            if result.container_state is None:
                result.note = f"container {name}: state unknown (no answer from a Docker engine)"
            elif commands is not None and not any("launcher" in c for c in commands):
                result.state, result.liveness = RunState.SUPERVISOR_LOST, "gone"
                result.note = f"container {name} is {result.container_state} but no launcher process runs in it"
            else:
                result.liveness = "live"  # the engine vouches for the container and its launcher
            return result
    elif not here:
        result.note = "recorded in another pid namespace and in no known container: liveness unknown"
        return result
    if find_live(record.supervisor or {}, "launcher") is None:
        result.state, result.liveness = RunState.SUPERVISOR_LOST, "gone"
        result.note = "the supervisor is gone" + (
            f"; {len(live)} training process(es) still alive (`launcher stop` cleans them up)" if live else ""
        )
    return result


def _reconcile_slurm(record: RunRecord) -> Reconciled:
    """A run submitted to Slurm: its processes live on the job's nodes, so liveness comes from Slurm. A job
    Slurm ended (or forgot) while the record says live: ``NODE_LOST`` when Slurm says a node failed, else
    ``SUPERVISOR_LOST`` (node 0's launcher ended without recording an end)."""
    view = query_job((record.slurm or {})["job_id"])  # shown by `launcher status` in its own row
    result = Reconciled(record.state, record.state, liveness="live", slurm_view=view)
    if view.live is None:
        result.liveness = "unknown"
        result.note = f"Slurm {view.describe()}"
    elif view.live:
        pass  # queued or running: the record says how far the run is
    elif not record.terminal:
        result.liveness = "gone"
        result.state = RunState.NODE_LOST if view.state == "NODE_FAIL" else RunState.SUPERVISOR_LOST
        result.note = f"Slurm {view.describe()}, and the run recorded no end"
    else:
        result.liveness = "gone"
    return result
