"""`launcher status` asks the Docker engine about the run's container and reconciles the record.

No Docker engine runs here, so the docker SDK's client is replaced by a stand-in that answers like
the SDK does (`containers.get` returning an object with `.status`, or raising `NotFound`).
"""

from __future__ import annotations

import json
import sys

import docker
import psutil
import pytest
from docker.errors import DockerException, NotFound

from launcher.errors import ExitCode, LauncherError
from launcher.monitor.status import collect, render
from launcher.run.control import stop_run
from launcher.run.placement.container import END_MARGIN_S
from launcher.state.procs import boot_id, identity
from launcher.state.record import RunStore
from launcher.state.states import RunState
from tests.support.fake_runs import read_status, spawn, write_record


class _Containers:
    def __init__(self, answer):
        self.answer = answer

    def get(self, name):
        if isinstance(self.answer, Exception):
            raise self.answer
        return type("Container", (), {"status": self.answer, "name": name})()


class _Client:
    def __init__(self, answer):
        self.containers = _Containers(answer)


@pytest.fixture
def running_record(tmp_path):
    """A RUNNING record whose supervisor is alive (a sleeping stand-in), so only the container decides."""
    proc = spawn([sys.executable, "-c", "import time; time.sleep(60)", "launcher"], "launcher")
    try:
        write_record(
            tmp_path,
            "run-1",
            state="RUNNING",
            supervisor=identity(psutil.Process(proc.pid)),
            boot_id=boot_id(),
            container={"name": "deltanet-train"},
        )
        yield tmp_path
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize(
    ("answer", "state"),
    [("running", "RUNNING"), (NotFound("no such container"), "NODE_LOST"), (DockerException("no engine"), "RUNNING")],
    ids=["running", "gone", "engine-unreachable"],
)
def test_container_state_is_reconciled_with_the_record(running_record, monkeypatch, answer, state):
    monkeypatch.setattr(docker, "from_env", lambda **_: _Client(answer))
    info = collect(running_record)
    assert info["state"] == state
    assert info["recorded_state"] == "RUNNING"
    if state == "NODE_LOST":
        assert "deltanet-train is gone" in info["note"]


def test_engine_missing_entirely_keeps_the_recorded_state(running_record, monkeypatch):
    def no_engine(**_):
        raise DockerException("Error while fetching server API version")

    monkeypatch.setattr(docker, "from_env", no_engine)
    assert collect(running_record)["state"] == "RUNNING"


# --- a run in a container, seen from the host: status after its end, `launcher stop` through the engine ------

CONTAINER_ID = "c" * 64


class _Engine:
    """A docker SDK client whose one container answers like the SDK's: ``status``, ``attrs``, ``top()``,
    ``stop(timeout=)`` (which runs ``on_stop``, as the container's supervisor would before exiting)."""

    def __init__(self, status: str, exit_code: int = 0, on_stop=None):
        self.stops: list[float] = []
        engine = self

        class Container:
            name, id = "deltanet-train-cpu", CONTAINER_ID

            @property
            def status(self):
                return engine.status

            @property
            def attrs(self):
                return {"State": {"ExitCode": engine.exit_code, "StartedAt": "0001-01-01T00:00:00Z"}}

            def top(self):
                return {"Titles": ["PID", "CMD"], "Processes": [["7", "python -m launcher run demo.yaml"]]}

            def stop(self, timeout):
                engine.stops.append(timeout)
                if on_stop is not None:
                    on_stop()
                engine.status, engine.exit_code = "exited", 143

        self.status, self.exit_code, self.container = status, exit_code, Container()
        self.containers = self

    def get(self, ref):
        if ref not in (self.container.name, self.container.id):
            raise NotFound(f"no such container: {ref}")
        return self.container

    def ping(self):
        return True


def _container_record(run_dir, state="RUNNING", stop_grace_s=30.0, **fields):
    """A record written by a supervisor in a container: another pid namespace, the container's name and id."""
    write_record(
        run_dir,
        "run-1",
        state=state,
        boot_id=boot_id(),
        stop_grace_s=stop_grace_s,
        supervisor={"pid": 7, "create_time": 1.0, "pid_ns": "pid:[1]"},
        container={"name": "deltanet-train-cpu", "id": CONTAINER_ID},
        **fields,
    )
    record = read_status(run_dir)
    (run_dir / "status.json").write_text(json.dumps({**record, "run_dir": "/outputs/runs/run-1"}))
    return run_dir


def test_status_after_the_container_ended_shows_the_engines_state(tmp_path, monkeypatch):
    engine = _Engine("exited", exit_code=0)
    monkeypatch.setattr(docker, "from_env", lambda **_: engine)
    info = collect(_container_record(tmp_path, state="SUCCEEDED"))
    assert info["container_status"] == "Exited (0)" and info["container_name"] == "deltanet-train-cpu"
    assert "deltanet-train-cpu (Exited (0))" in render(info)


def test_host_stop_of_a_live_container_run_goes_through_the_engine_never_a_false_end(tmp_path, monkeypatch):
    """The engine vouches for the container and its launcher: `launcher stop` leaves the stop request (so the
    supervisor names it), docker-stops the container with the grace plus a margin, and records nothing itself
    when the supervisor recorded the end (here: the stand-in's stop writes it, as the supervisor does)."""
    run_dir = _container_record(tmp_path)

    def supervisor_ends():
        request = json.loads((run_dir / "stop_request.json").read_text())
        assert request["now"] is False and request["by"].startswith("launcher stop (pid ")
        RunStore.open(run_dir).record_end(RunState.CANCELLED, stopped_by=request["by"], processes=[])

    engine = _Engine("running", on_stop=supervisor_ends)
    monkeypatch.setattr(docker, "from_env", lambda **_: engine)
    assert stop_run(run_dir, None) == 0
    assert engine.stops == [30 + END_MARGIN_S]
    assert read_status(run_dir)["state"] == "CANCELLED"
    ended = [ln for ln in (run_dir / "events.jsonl").read_text().splitlines() if '"ended"' in ln]
    assert len(ended) == 1 and "docker stop deltanet-train-cpu" in ended[0]


@pytest.mark.parametrize(("given", "timeout"), [(None, END_MARGIN_S), (5.0, 5 + END_MARGIN_S)])
def test_a_host_stop_of_a_run_with_a_zero_grace_gives_the_engine_the_margin_only(tmp_path, monkeypatch, given, timeout):
    """``stop_grace_s: 0``: docker stop gets only the margin for the end record, as a local or Slurm stop waits 0 s
    for the save (tests/run/test_placement.py); ``--grace 5`` adds five seconds."""
    run_dir = _container_record(tmp_path, stop_grace_s=0.0)

    def supervisor_ends():
        RunStore.open(run_dir).record_end(RunState.CANCELLED, stopped_by="launcher stop", processes=[])

    engine = _Engine("running", on_stop=supervisor_ends)
    monkeypatch.setattr(docker, "from_env", lambda **_: engine)
    assert stop_run(run_dir, given) == 0
    assert engine.stops == [timeout]


def test_host_stop_without_an_engine_changes_nothing_and_names_the_command(tmp_path, monkeypatch):
    run_dir = _container_record(tmp_path)

    def no_engine(**_):
        raise DockerException("Error while fetching server API version")

    monkeypatch.setattr(docker, "from_env", no_engine)
    with pytest.raises(LauncherError) as raised:
        stop_run(run_dir, 5.0, now=True)
    assert raised.value.exit_code == ExitCode.FAILED
    assert str(raised.value).endswith(
        "run: docker exec deltanet-train-cpu launcher stop /outputs/runs/run-1 --now --grace=5"
    ), str(raised.value)
    assert read_status(run_dir)["state"] == "RUNNING"
    assert not (run_dir / "stop_request.json").exists() and not (run_dir / "events.jsonl").exists()


def test_host_stop_whose_request_cannot_be_written_still_stops_through_the_engine(tmp_path, monkeypatch, capsys):
    """A run folder the container wrote as root is read-only to a host user in the docker group: the stop
    request cannot be left (here its path is taken by a folder, which refuses the write for root too), so
    `launcher stop` warns and stops the container anyway, as `docker stop` would; no traceback."""
    run_dir = _container_record(tmp_path)
    (run_dir / "stop_request.json").mkdir()

    def supervisor_ends():
        RunStore.open(run_dir).record_end(RunState.TERMINATED, processes=[])

    engine = _Engine("running", on_stop=supervisor_ends)
    monkeypatch.setattr(docker, "from_env", lambda **_: engine)
    assert stop_run(run_dir, None) == 0
    assert engine.stops == [30 + END_MARGIN_S] and read_status(run_dir)["state"] == "TERMINATED"
    assert "warning: cannot write the stop request" in capsys.readouterr().err


def test_a_later_container_of_the_same_name_is_never_taken_for_the_runs_own(tmp_path, monkeypatch):
    """Compose gives every run's container the same fixed name: once the run's own container (its recorded id)
    is gone, host `stop` must not docker-stop a later run's container of that name."""
    run_dir = _container_record(tmp_path)
    record = json.loads((run_dir / "status.json").read_text())
    record["container"]["id"] = "d" * 64  # the run's own container, which the engine no longer has
    (run_dir / "status.json").write_text(json.dumps(record))
    engine = _Engine("running")  # a later run's container, named deltanet-train-cpu
    monkeypatch.setattr(docker, "from_env", lambda **_: engine)
    assert stop_run(run_dir, None) == 0
    assert engine.stops == [] and read_status(run_dir)["state"] != "RUNNING"
