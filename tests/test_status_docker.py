"""`launcher status` asks the Docker engine about the run's container and reconciles the record.

No Docker engine runs here, so the docker SDK's client is replaced by a stand-in that answers like
the SDK does (`containers.get` returning an object with `.status`, or raising `NotFound`).
"""

from __future__ import annotations

import sys

import docker
import psutil
import pytest
from docker.errors import DockerException, NotFound

from launcher.monitor.status import collect
from launcher.procs import boot_id, identity
from tests.fake_runs import spawn, write_record


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
        write_record(tmp_path, "run-1", state="RUNNING", supervisor=identity(psutil.Process(proc.pid)),
                     boot_id=boot_id(), container={"name": "deltanet-train"})  # fmt: skip
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
