"""A run that lives in a container, seen from the host: liveness, ``launcher stop`` and ``launcher resume``
through the Docker engine.

The run's processes live in the container's pid namespace: they cannot be signalled (or even seen) from the
host. What can be reached is the Docker engine (the docker SDK), and it does what compose does:

- liveness: the container found by its recorded id (by name only when no id was recorded); gone or no longer
  running is ``NODE_LOST``, restarted since the run's supervisor started too; running without a launcher
  process is ``SUPERVISOR_LOST``; without an engine answer the recorded state is shown, liveness unknown;

- stop: the stop request is written first (the supervisor reads it when the SIGTERM arrives, so it saves a
  checkpoint unless ``--now``, and records ``launcher stop`` as the sender), then ``docker stop`` with the
  run's grace plus a margin for the end record: the image's init forwards the SIGTERM to the supervisor;
- resume: a new container made from the run's own (exited) one: the same image, mounts, user, devices and
  security settings, running ``launcher resume RUN --foreground``.

Without an engine answer nothing is changed: the command to run where one answers is printed and the exit
code is non-zero. An end is recorded here only once the engine says the container is no longer running.
"""

from __future__ import annotations

import math
import re
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.errors import ExitCode, LauncherError
from launcher.run.placement.base import Placement, StopAsk, Supervise
from launcher.run.placement.local import LocalPlacement
from launcher.run.signals import drop_hold
from launcher.state.procs import container_identity
from launcher.state.reconcile import (
    ContainerView,
    Reconciled,
    engine_time,
    first_look,
    restarted_since,
    same_namespace,
)
from launcher.state.record import RecordUnreadable, RunRecord, RunStore, read_record
from launcher.state.runs import follow_up
from launcher.state.states import RunState
from launcher.state.stop import clear_stop_request, request_stop

if TYPE_CHECKING:
    from launcher.run.resume import ResumePlan

END_MARGIN_S = 60.0  # after the grace: the supervisor stops what is left of the job and writes the end record
HANDSHAKE_TIMEOUT_S = 300.0
RESUME_SUFFIX = "-resume"
# Docker's container states in which the run's processes can still be alive
CONTAINER_ALIVE = frozenset({"running", "paused", "restarting", "created"})
COMPOSE_LABELS = "com.docker.compose."  # compose's own labels (project, service, config hash...): emptied


class NoEngine(Exception):
    """No Docker engine answers here (the docker SDK's own error, in words)."""


def _client() -> Any:
    try:
        import docker
        from docker.errors import DockerException
    except ImportError as err:
        raise NoEngine(f"the docker SDK is not installed ({err})") from err
    try:
        client = docker.from_env(timeout=30)
        client.ping()
        return client
    except (DockerException, OSError) as err:
        raise NoEngine(str(err)) from err


def _label(record: RunRecord) -> str:
    container = record.container or {}
    return str(container.get("name") or container.get("id") or "its container")


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
        engine_time(state.get("StartedAt")),
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


class ContainerPlacement(LocalPlacement):
    """A run recorded in a container, asked about from the host (outside every container): through the engine.
    A record that names no pid namespace of its own (or this one) is checked here as well, as a local run."""

    kind = "container"
    own_files = True  # the run saw its model, data and outputs through the container's mounts

    @staticmethod
    def holds(record: RunRecord) -> bool:
        return bool(record.container) and container_identity() is None

    @classmethod
    def start(cls, config: Any, **options: Any) -> int:
        raise LauncherError(
            "a container run is started by compose, not by the launcher: docker compose up -d train "
            "(README, docs/containers.md)",
            ExitCode.USAGE,
        )

    def where(self) -> str:
        return f"container {_label(self.record)}"

    def reconcile(self, run_dir: Path) -> Reconciled:
        record = self.record
        here = same_namespace(record)
        result = super().reconcile(run_dir) if here else first_look(record, [], here=False)
        if record.terminal or result.state is RunState.NODE_LOST:
            return result
        view = inspect_container(record.container)
        result.container_state, result.container_view = view.state, view
        name = _label(record)
        if view.state is not None and view.state not in CONTAINER_ALIVE:
            result.state, result.live, result.liveness = RunState.NODE_LOST, [], "gone"
            result.note = f"container {name} is {view.state}"
        elif restarted_since(record, view.started):
            result.state, result.live, result.liveness = RunState.NODE_LOST, [], "gone"
            result.note = f"container {name} was restarted since the run was recorded live"
        elif here:
            pass  # its pids were checked here
        elif view.state is None:
            result.note = f"container {name}: state unknown (no answer from a Docker engine)"
        elif view.commands is not None and not any("launcher" in c for c in view.commands):
            result.state, result.liveness = RunState.SUPERVISOR_LOST, "gone"
            result.note = f"container {name} is {view.state} but no launcher process runs in it"
        else:
            result.liveness = "live"  # the engine vouches for the container and its launcher
        return result

    def status_fields(self, seen: Reconciled) -> dict[str, Any]:
        """What the engine says now of the container the run's latest attempt lives in: its name (by the recorded
        id: a `docker compose run` container has a name of its own) and its state, also after the run ended
        (``Exited (0)``)."""
        view = seen.container_view or inspect_container(self.record.container)
        return Placement.status_fields(self, seen) | {
            "container_name": view.name or _label(self.record),
            "container_status": view.describe(),
        }

    def _stop(self, run_dir: Path, store: RunStore, seen: Reconciled, ask: StopAsk) -> int:
        if same_namespace(self.record):  # its pids can be signalled here
            return super()._stop(run_dir, store, seen, ask)
        return _stop_container(run_dir, store, seen, ask)

    def resume(self, run_dir: Path, plan: ResumePlan, adapter_only: bool, in_process: Supervise | None) -> int:
        drop_hold()  # a --foreground resume held the stop signals for a supervisor this process will not be
        return resume_in_container(run_dir, self.record, adapter_only)


def in_container_command(record: RunRecord, verb: str, *args: str) -> str:
    """``docker exec NAME launcher VERB RUN_DIR ...``: the command that does it inside the run's container."""
    where = record.run_dir or record.run_id
    return shlex.join(["docker", "exec", _label(record), "launcher", verb, where, *args])


# --- stop -------------------------------------------------------------------------------------------------


def _stop_container(run_dir: Path, store: RunStore, seen: Reconciled, ask: StopAsk) -> int:
    """Stop a run that lives in a container through the Docker engine (``docker stop``), as compose does: the
    engine's SIGKILL comes ``ask.grace`` seconds (the one rule, ``Placement.grace``) plus ``END_MARGIN_S`` after."""
    record = store.record
    name = _label(record)
    if seen.container_state is not None and seen.container_state not in CONTAINER_ALIVE:  # exited or gone
        if not record.terminal:
            store.record_end(seen.state, reason=f"{seen.note}; recorded by {ask.by}", processes=[])
        print(f"run {record.run_id}: {seen.note}; nothing to stop; recorded {store.state.value}")
        return ExitCode.OK
    flags = (["--now"] if ask.now else []) + ([f"--grace={ask.given:g}"] if ask.given is not None else [])
    try:
        container = find_container(_client(), record.container or {})
    except NoEngine as err:
        raise LauncherError(
            f"run {record.run_id} lives in container {name}, and no Docker engine answers here ({err}); nothing "
            f"was stopped. Where the engine answers, run: {in_container_command(record, 'stop', *flags)}",
            ExitCode.FAILED,
        ) from err
    if container is None:  # the engine lost it between the two questions
        return _stop_container(run_dir, store, ContainerPlacement(record).reconcile(run_dir), ask)
    timeout = math.ceil(ask.grace + END_MARGIN_S)
    by = f"{ask.by} through the Docker engine (docker stop {container.name})"
    try:  # read by the supervisor (and, for --now, the ranks) when the SIGTERM arrives
        request_stop(run_dir, ask.given, by=by, now=ask.now)
        asked = True
    except OSError as err:  # e.g. a run folder a container wrote as root: the engine still stops the run
        print(
            f"warning: cannot write the stop request in {run_dir} ({err}); stopping the container anyway, as "
            "`docker stop` would: the job saves on the engine's SIGTERM (--now cannot be passed on), and the "
            "record names that SIGTERM's sender",
            file=sys.stderr,
        )
        asked = False
    what = "SIGTERM, no save" if ask.now else "a checkpoint at the next step, then exit"
    print(
        f"stopping run {record.run_id}: docker stop of container {container.name} ({what}; the engine sends "
        f"SIGKILL after {timeout} s)",
        flush=True,
    )
    from docker.errors import DockerException

    try:
        container.stop(timeout=timeout)
    except DockerException as err:
        if asked:  # nothing was stopped: a later SIGTERM must not be taken for this request
            clear_stop_request(run_dir)
        raise LauncherError(f"docker stop of container {container.name} failed: {err}", ExitCode.FAILED) from err
    return _report_stop(run_dir, store, record, container.name, by)


def stopped_line(ended: RunRecord) -> str:
    """How a stopped run ended, in one line: its state, who stopped it, the checkpoint saved on the stop."""
    saved = ended.saved_checkpoint
    line = f"run {ended.run_id} ended {ended.state.value}; stopped by {ended.stopped_by}"
    if saved:
        line += f"; checkpoint {saved.get('path')} saved at step {saved.get('step')} on the stop"
    return line


def _report_stop(run_dir: Path, store: RunStore, record: RunRecord, name: str, by: str) -> int:
    """The container has stopped: say how the run ended (its supervisor recorded it), or record what it is."""
    try:
        ended = read_record(run_dir)
    except RecordUnreadable:
        ended = None
    if ended is not None and ended.terminal:
        print(stopped_line(ended))
        return ExitCode.OK
    seen = ContainerPlacement(read_record(run_dir)).reconcile(run_dir)
    store.record_end(
        seen.state if seen.state.terminal else RunState.NODE_LOST,
        processes=[],
        reason=f"container {name} was stopped by {by}; its supervisor recorded no end",
    )
    print(
        f"run {record.run_id}: container {name} stopped, but its supervisor recorded no end; recorded "
        f"{store.state.value}"
    )
    return ExitCode.FAILED


# --- resume -----------------------------------------------------------------------------------------------


def resume_command(record: RunRecord, adapter_only: bool) -> list[str]:
    """``launcher resume RUN_DIR --foreground`` with the run directory as the container sees it."""
    return [
        "launcher",
        "resume",
        record.run_dir or record.run_id,
        "--foreground",
        *(["--adapter-only"] if adapter_only else []),
    ]


# compose.yaml's services; compose names a service's container <project>-<service>-<n> (a host resume's clone adds
# -resume), and runs before the project carried the checkout's name were deltanet-<service>
COMPOSE_SERVICES = ("train", "train-cann9", "train-cuda", "train-cpu")
_SERVICE_IN_NAME = re.compile(rf"(?:^|-)({'|'.join(map(re.escape, COMPOSE_SERVICES))})(?:-\d+)?$")


def _compose_service(record: RunRecord) -> tuple[list[str], str]:
    """The ``--profile`` options and the compose service of the run's container, from its recorded name
    (``<project>-train-cpu-1``; the cuda, cann9 and cpu services need their profile). ``train`` when the name is
    none of compose's."""
    found = _SERVICE_IN_NAME.search(_label(record).removesuffix(RESUME_SUFFIX))
    service = found.group(1) if found else "train"
    profile = service.removeprefix("train-") if service.startswith("train-") else None
    return (["--profile", profile] if profile else []), service


def compose_resume_command(record: RunRecord, adapter_only: bool) -> str:
    """The compose command that resumes the run in its service's container (compose.yaml's RESUME_RUN)."""
    profile, service = _compose_service(record)
    env = [f"RESUME_RUN={record.run_dir or record.run_id}", *(["RESUME_ADAPTER_ONLY=1"] if adapter_only else [])]
    return shlex.join([*env, "docker", "compose", *profile, "up", "--detach", service])


def compose_run_command(record: RunRecord, verb: str, *args: str) -> str:
    """``docker compose run --rm SERVICE launcher VERB RUN_DIR ...``: the verb in a new container of the run's
    service (its image and mounts), on the run directory as the container sees it."""
    profile, service = _compose_service(record)
    return shlex.join(
        [
            "docker",
            "compose",
            *profile,
            "run",
            "--rm",
            service,
            "launcher",
            verb,
            record.run_dir or record.run_id,
            *args,
        ]
    )


def container_mounts(record: RunRecord) -> tuple[list[tuple[str, str]], str | None]:
    """The run's container's mounts as ``(path in the container, path here)``, as the engine reports them (the
    container of the run's latest attempt: a resume's clone has the same mounts); else no mounts and why."""
    try:
        container = find_container(_client(), record.container or {})
    except NoEngine as err:
        return [], f"no Docker engine answers here to tell its mounts ({err})"
    if container is None:
        return [], f"the engine no longer has container {_label(record)} to tell its mounts"
    mounts = [
        (str(m.get("Destination")), str(m.get("Source")))
        for m in container.attrs.get("Mounts") or []
        if m.get("Destination") and m.get("Source")
    ]
    return mounts, None


def resume_in_container(run_dir: Path, record: RunRecord, adapter_only: bool) -> int:
    """Start ``launcher resume`` for a container run in a new container made from the run's own one."""
    try:
        client = _client()
        old = find_container(client, record.container or {})
    except NoEngine as err:
        raise LauncherError(
            f"run {record.run_id} ran in container {_label(record)}, and no Docker engine answers here ({err}); "
            f"nothing was started. From the compose folder, with the run's OUTPUTS_DIR, run: "
            f"{compose_resume_command(record, adapter_only)}",
            ExitCode.FAILED,
        ) from err
    if old is None:
        raise LauncherError(
            f"run {record.run_id}: its container {_label(record)} no longer exists, so its settings cannot be "
            f"reused; nothing was started. From the compose folder, with the run's OUTPUTS_DIR, run: "
            f"{compose_resume_command(record, adapter_only)}",
            ExitCode.FAILED,
        )
    name = old.name.removesuffix(RESUME_SUFFIX) + RESUME_SUFFIX
    _remove_exited(client, name)
    new = _clone(client, old, name, resume_command(record, adapter_only))
    print(f"resuming run {record.run_id} in container {name} (made from {old.name}: same image, mounts and user)")
    _wait_for_attempt(run_dir, record, new)
    print(follow_up(record.run_id, run_dir.parent, f"docker logs -f {name}"))
    return ExitCode.OK


def _remove_exited(client: Any, name: str) -> None:
    """An earlier resume's container of that name, once it has ended (a live one is refused)."""
    from docker.errors import NotFound

    try:
        earlier = client.containers.get(name)
    except NotFound:
        return
    if earlier.status in CONTAINER_ALIVE:
        raise LauncherError(
            f"container {name} is {earlier.status}: another resume of this run may be starting; "
            f"see `docker logs {name}`",
            ExitCode.FAILED,
        )
    earlier.remove()


def _clone(client: Any, old: Any, name: str, command: list[str]) -> Any:
    """A container like ``old`` (image, mounts, user, devices, security, network, environment), running
    ``command``, named ``name``; started. Compose's labels are empty on it, so no compose command of the project
    lists it, counts it as one of its services' or warns about it as an orphan (a one-off of the project was
    reported as "Found orphan containers" after a host resume); the next resume of the run removes it
    (``_remove_exited``), else ``docker rm NAME``."""
    config, host = old.attrs["Config"], dict(old.attrs["HostConfig"])
    env = [e for e in config.get("Env") or [] if not e.startswith("LAUNCHER_CONTAINER=")]
    # emptied, not left out: a container takes its image's labels, and compose's build labels the image too
    labels = {k: "" if k.startswith(COMPOSE_LABELS) else v for k, v in (config.get("Labels") or {}).items()}
    created = client.api.create_container(
        old.attrs["Image"],
        command=command,
        name=name,
        entrypoint=config.get("Entrypoint"),
        environment=[*env, f"LAUNCHER_CONTAINER={name}"],
        user=config.get("User") or None,
        working_dir=config.get("WorkingDir") or None,
        labels=labels,
        host_config=host,
        stop_signal=config.get("StopSignal"),
        stop_timeout=config.get("StopTimeout"),
    )
    client.api.start(created["Id"])
    return client.containers.get(created["Id"])


def _wait_for_attempt(run_dir: Path, record: RunRecord, container: Any) -> None:
    """Until the record shows the new attempt, or the container ends first (then its last lines are shown)."""
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            now = read_record(run_dir)
        except RecordUnreadable:
            now = None
        if now is not None and now.attempt > record.attempt:
            print(f"run {record.run_id}: attempt {now.attempt} is {now.state.value}")
            return
        container.reload()
        if container.status not in CONTAINER_ALIVE:
            tail = container.logs(tail=20).decode(errors="replace").strip()
            raise LauncherError(f"container {container.name} ended before the resume began:\n{tail}", ExitCode.FAILED)
        time.sleep(0.5)
    raise LauncherError(
        f"container {container.name} has not begun the resume after {HANDSHAKE_TIMEOUT_S:.0f} s; "
        f"see `docker logs {container.name}`",
        ExitCode.FAILED,
    )
