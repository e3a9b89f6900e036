"""Host verbs without RUN right after ``docker compose up -d``: the engine shows a container starting a run on the
runs folder before its launcher holds the lock, and they wait for that run instead of showing the previous one.

No engine runs here: the docker SDK's client is a stand-in answering as the SDK does (``api.containers`` the
engine's list, ``containers.get`` an object with ``id``, ``name``, ``attrs``, ``status``, ``reload``). The real
engine's case: tests/containers/test_containers.py, ``test_two_checkouts_up_side_by_side_...``.
"""

from __future__ import annotations

import argparse
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from launcher.cli.registry import run_dir
from launcher.state import starting
from tests.support.fake_runs import write_record

OLD, NEW = "a" * 64, "b" * 64


class _Container:
    def __init__(self, id: str, started: float, on_reload=None):
        self.id, self.name, self.status = id, f"proj-train-cpu-1-{id[:4]}", "running"
        iso = datetime.fromtimestamp(started, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        self.attrs = {"State": {"StartedAt": iso}}
        self.on_reload, self.reloads = on_reload, 0

    def reload(self) -> None:
        self.reloads += 1
        if self.on_reload:
            self.on_reload(self)


class _Client:
    """``api.containers(filters=...)``: the engine's list; ``containers.get(id)``: the container."""

    def __init__(self, listed: list[dict], containers: dict[str, _Container]):
        self.api = type("Api", (), {"containers": lambda _self, filters=None: listed})()
        self.containers = type("Containers", (), {"get": lambda _self, id: containers[id]})()


def _engine(
    monkeypatch, outputs: Path, container: _Container, command: str = "launcher-entrypoint launcher run x.yaml"
):
    listed = [
        {"Id": container.id, "Command": command, "Mounts": [{"Type": "bind", "Source": str(outputs)}]},
    ]
    client = _Client(listed, {container.id: container})
    monkeypatch.setattr(starting, "_client", lambda: client)
    return client


def _record(root: Path, run_id: str, container_id: str, began: float) -> Path:
    return write_record(
        root / run_id,
        run_id,
        state="RUNNING",
        container={"name": "proj-train-cpu-1", "id": container_id},
        supervisor={"pid": 1, "create_time": began, "cmdline": "launcher run"},
    )


@pytest.fixture
def outputs(tmp_path) -> Path:
    root = tmp_path / "outputs" / "runs"
    _record(root, "demo-cpu-old", OLD, time.time() - 600)
    return tmp_path / "outputs"


def test_a_started_container_with_no_run_yet_is_being_set_up(monkeypatch, outputs) -> None:
    root = outputs / "runs"
    now = time.time()
    box = _Container(NEW, now)
    _engine(monkeypatch, outputs, box)
    found = starting.starting_container(root)
    assert found is not None and found.name == box.name and abs(found.started - now) < 0.01
    # its run recorded (this container's id, a supervisor that began after the start): nothing is starting
    _record(root, "demo-cpu-new", NEW, now + 1)
    assert starting.starting_container(root) is None
    assert starting.recorded_run(root, found) == root / "demo-cpu-new"


def test_the_same_container_restarted_is_starting_again(monkeypatch, outputs) -> None:
    """`docker compose up` after a kill starts the same container (same id): the old run is not its run now."""
    root = outputs / "runs"
    _engine(monkeypatch, outputs, _Container(OLD, time.time()))
    assert starting.starting_container(root) is not None


@pytest.mark.parametrize(
    "command, mounted",
    [
        ("launcher-entrypoint launcher evaluate /outputs/runs/x", True),  # not a training run
        ("launcher-entrypoint bash", True),
        ("launcher-entrypoint launcher run x.yaml", False),  # another runs folder
    ],
)
def test_other_containers_are_not_runs_being_set_up(monkeypatch, outputs, tmp_path, command, mounted) -> None:
    box = _Container(NEW, time.time())
    _engine(monkeypatch, outputs if mounted else tmp_path / "elsewhere", box, command)
    assert starting.starting_container(outputs / "runs") is None


def test_no_engine_is_nothing_starting(monkeypatch, outputs) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{outputs}/no-engine.sock")
    assert starting._client() is None and starting.starting_container(outputs / "runs") is None


def test_status_without_run_waits_for_the_starting_containers_run(monkeypatch, outputs, capsys) -> None:
    """The run appears while the verb waits (on the container's third reload): that run, never the old one."""
    root = outputs / "runs"
    now = time.time()

    def records_on_third(box: _Container) -> None:
        if box.reloads == 3:
            _record(root, "demo-cpu-new", NEW, now + 1)

    _engine(monkeypatch, outputs, _Container(NEW, now, records_on_third))
    ns = argparse.Namespace(run=None, root=root, root_config=None)
    assert run_dir(ns) == (root / "demo-cpu-new").resolve()
    said = capsys.readouterr().err
    assert said.startswith(f"waiting for the run being set up under {root} (container proj-train-cpu-1-bbbb, "), said


def test_a_container_that_ends_without_a_run_shows_the_newest(monkeypatch, outputs, capsys) -> None:
    root = outputs / "runs"

    def exits(box: _Container) -> None:
        box.status = "exited"

    _engine(monkeypatch, outputs, _Container(NEW, time.time(), exits))
    ns = argparse.Namespace(run=None, root=root, root_config=None)
    assert run_dir(ns) == (root / "demo-cpu-old").resolve()
    assert "warning: no run folder came of it; showing the newest run" in capsys.readouterr().err
