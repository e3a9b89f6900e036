"""A run container starting on a runs folder, seen from the host through the Docker engine.

``docker compose up -d`` returns once the container is started; its launcher takes the run lock a second or more
later (Python starts, the config is read), and names its run folder later still. In between, the newest folder
under the runs folder is the previous run, and nothing on disk says a new one is coming. The engine does: a
running container that mounts the runs folder and runs ``launcher run`` (or ``launcher resume``), whose current
start no run there records yet, is a run being set up. Host verbs without RUN wait for it as they wait for a held
lock (``launcher.cli.registry.run_dir``).

No engine here (no socket, no docker SDK, no answer): nothing is starting, as far as this module can tell.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.state.reconcile import engine_time, restarted_since
from launcher.state.record import RecordUnreadable, read_record
from launcher.state.runs import STATUS_FILE, list_runs

DEFAULT_SOCKET = Path("/var/run/docker.sock")
START_WAIT_S = 120.0  # from the container's start to its launcher holding the lock (or recording its run)
TRAINING_VERBS = ("run", "resume")


@dataclass
class Starting:
    """A running container that will record a run under the runs folder: the engine's object, its name, when it
    started (epoch seconds)."""

    container: Any
    name: str
    started: float | None


def _client() -> Any | None:
    """The docker SDK's client of an engine that answers; None without one (checked cheaply first: no
    ``DOCKER_HOST`` and no default socket means no engine, and the SDK is not even imported)."""
    if not os.environ.get("DOCKER_HOST") and not DEFAULT_SOCKET.exists():
        return None
    try:
        import docker
        from docker.errors import DockerException
    except ImportError:
        return None
    try:
        client = docker.from_env(timeout=5)
        client.ping()
        return client
    except (DockerException, OSError):
        return None


def _runs_training(command: Any) -> bool:
    """Whether a container's command (the engine's one string) is ``launcher run ...`` or ``launcher resume ...``."""
    words = str(command or "").split()
    pairs = zip(words, words[1:], strict=False)
    return any(a.rsplit("/", 1)[-1] == "launcher" and b in TRAINING_VERBS for a, b in pairs)


def _mounts_root(mounts: Any, root: Path) -> bool:
    """Whether one of the container's mounts (the engine's list) holds ``root`` on this host."""
    for mount in mounts or []:
        source = mount.get("Source") if isinstance(mount, dict) else None
        if source and root.is_relative_to(os.path.realpath(source)):
            return True
    return False


def recorded_run(root: Path, starting: Starting) -> Path | None:
    """The run under ``root`` that ``starting``'s current start records (its container id, a supervisor that began
    after the container did), or None yet. Only records written since that start are read."""
    since = (starting.started or 0.0) - 5.0
    for run in reversed(list_runs(root)):
        try:
            if (run / STATUS_FILE).stat().st_mtime < since:
                continue
            record = read_record(run)
        except (OSError, RecordUnreadable):
            continue
        if (record.container or {}).get("id") == starting.container.id and not restarted_since(
            record, starting.started
        ):
            return run
    return None


def starting_container(root: Path) -> Starting | None:
    """A running container that mounts ``root``, runs ``launcher run`` or ``launcher resume``, and whose current
    start no run under ``root`` records yet; None when there is none, or no engine answers."""
    client = _client()
    if client is None:
        return None
    from docker.errors import DockerException, NotFound

    real = Path(os.path.realpath(root))
    try:
        listed = client.api.containers(filters={"status": "running"})
        for summary in listed:
            if not (_runs_training(summary.get("Command")) and _mounts_root(summary.get("Mounts"), real)):
                continue
            try:
                container = client.containers.get(summary["Id"])
            except NotFound:  # it ended since the list
                continue
            state = (container.attrs or {}).get("State") or {}
            starting = Starting(container, str(container.name), engine_time(state.get("StartedAt")))
            if recorded_run(root, starting) is None:
                return starting
    except (DockerException, OSError, KeyError, TypeError):
        return None
    return None


def wait_for_container(root: Path, starting: Starting, is_set_up: Any, timeout_s: float = START_WAIT_S) -> Path | None:
    """Wait until ``starting``'s run is recorded under ``root`` (its run folder is returned), or ``is_set_up()``
    says a supervisor holds the lock and sets its run up (None: the caller waits on the lock), or the container no
    longer runs (None), or ``timeout_s`` passed (None)."""
    from docker.errors import DockerException, NotFound

    deadline = time.monotonic() + timeout_s
    while True:
        found = recorded_run(root, starting)
        if found is not None or is_set_up():
            return found
        try:
            starting.container.reload()
            running = starting.container.status == "running"
        except NotFound:
            running = False
        except (DockerException, OSError):
            return None
        if not running:
            return recorded_run(root, starting)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.5)
