"""The one owner of run state: the transition table, the end-state rule, the typed record and its writer,
and reconcile's answers for records from this host, another boot, and another pid namespace."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil
import pytest

from launcher.run.placement import reconcile
from launcher.state.procs import boot_id, identity, self_identity
from launcher.state.record import SCHEMA_VERSION, RecordUnreadable, RunRecord, RunStore, read_record
from launcher.state.states import (
    RESUMABLE,
    TERMINAL,
    TRANSITIONS,
    IllegalTransition,
    RunState,
    check_transition,
    end_state,
)
from tests.support.fake_runs import spawn, write_record

# --- transitions ------------------------------------------------------------------------------------


def test_every_state_has_a_row_and_terminal_states_lead_only_to_a_new_attempt():
    assert set(TRANSITIONS) == set(RunState)
    for state in TERMINAL:
        assert TRANSITIONS[state] <= {RunState.PENDING}
        assert (TRANSITIONS[state] == {RunState.PENDING}) == (state in RESUMABLE)


@pytest.mark.parametrize(
    ("current", "new"),
    [
        (RunState.SUCCEEDED, RunState.RUNNING),
        (RunState.SUCCEEDED, RunState.PENDING),  # a success is never resumed
        (RunState.FAILED_SETUP, RunState.RUNNING),
        (RunState.PENDING, RunState.FINISHING),
        (RunState.FINISHING, RunState.RUNNING),
        (RunState.PENDING, RunState.SUCCEEDED),  # success needs a job that ran
        (RunState.CANCELLED, RunState.RUNNING),
    ],
)
def test_a_transition_outside_the_table_raises(current, new):
    with pytest.raises(IllegalTransition, match=f"{current.value} -> {new.value}"):
        check_transition(current, new)


def test_staying_in_a_state_is_not_a_transition():
    for state in RunState:
        check_transition(state, state)


# --- the end-state rule --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ({"exit_code": 0, "signal": None, "accepted": True}, RunState.SUCCEEDED),
        ({"exit_code": 0, "signal": None, "accepted": False}, RunState.FAILED_ACCEPTANCE),
        ({"exit_code": 0, "signal": None, "accepted": None}, RunState.SUCCEEDED),  # another node checks
        ({"exit_code": 1, "signal": None}, RunState.FAILED),
        ({"exit_code": None, "signal": 9}, RunState.FAILED),
        ({"exit_code": 1, "signal": None, "out_of_memory": True}, RunState.OUT_OF_MEMORY),
        ({"exit_code": 1, "signal": None, "stop": "user"}, RunState.CANCELLED),
        ({"exit_code": 0, "signal": None, "stop": "external", "accepted": True}, RunState.TERMINATED),
        ({"exit_code": None, "signal": 15, "stop": "external"}, RunState.TERMINATED),
    ],
)
def test_end_state_is_a_function_of_how_the_job_ended(how, expected):
    assert end_state(**how) is expected
    assert end_state(**how) in TERMINAL


# --- the record and its writer ---------------------------------------------------------------------------


def test_record_end_writes_status_before_the_event(tmp_path, monkeypatch):
    store = RunStore.create(tmp_path, "r")
    store.transition(RunState.RUNNING, job_pid=7)
    seen_at_event: list[str] = []
    real = RunStore.event

    def event(self, kind, **values):
        if kind == "ended":
            seen_at_event.append(read_record(tmp_path).state.value)  # what a reader sees when the event lands
        return real(self, kind, **values)

    monkeypatch.setattr(RunStore, "event", event)
    store.record_end(RunState.FAILED, exit_code=3, reason="rank 0 raised")
    assert seen_at_event == ["FAILED"]
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["state", "ended"]
    assert events[-1]["state"] == "FAILED" and events[-1]["exit_code"] == 3 and events[-1]["ended"]
    record = read_record(tmp_path)
    assert record.exit_code == 3 and record.ended and record.schema == SCHEMA_VERSION


def test_the_writer_refuses_what_the_table_refuses(tmp_path):
    store = RunStore.create(tmp_path, "r")
    with pytest.raises(ValueError, match="not a terminal state"):
        store.record_end(RunState.RUNNING)
    with pytest.raises(IllegalTransition):
        store.record_end(RunState.SUCCEEDED)  # PENDING -> SUCCEEDED: no job ran
    with pytest.raises(AttributeError, match="no field 'colour'"):
        store.save(colour="blue")
    with pytest.raises(TypeError, match="transition"):
        store.save(state=RunState.RUNNING)
    assert not (tmp_path / "status.json").exists()  # nothing half-done was written


def test_new_files_follow_the_umask(tmp_path):
    RunStore.create(tmp_path, "r").save(job_pid=1)
    assert (tmp_path / "status.json").stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_schema_1_record_reads_with_its_paths_re_rooted(tmp_path):
    """Schema 1 kept absolute paths (and the container's name as a string); they resolve under the folder
    the record is found in now, e.g. a run written in a container under /outputs read on the host."""
    run_dir = tmp_path / "host" / "runs" / "r1"
    run_dir.mkdir(parents=True)
    old = {
        "schema": 1,
        "run_id": "r1",
        "state": "RUNNING",
        "run_dir": "/outputs/runs/r1",
        "trainer_log": "/outputs/runs/r1/output/trainer_log.jsonl",
        "container": "deltanet-train",
    }
    (run_dir / "status.json").write_text(json.dumps(old))
    record = read_record(run_dir)
    assert record.resolve(run_dir, record.trainer_log) == run_dir / "output" / "trainer_log.jsonl"
    assert record.container == {"name": "deltanet-train"}
    assert RunRecord(run_id="x").trainer_log == "output/trainer_log.jsonl"  # written relative now


def test_a_newer_schema_is_unreadable_not_guessed(tmp_path):
    (tmp_path / "status.json").write_text(json.dumps({"schema": SCHEMA_VERSION + 1, "run_id": "r", "state": "RUNNING"}))
    with pytest.raises(RecordUnreadable, match="unreadable: .*status.json"):
        read_record(tmp_path)


# --- reconcile ---------------------------------------------------------------------------------------------


@pytest.fixture
def supervisor_stand_in():
    proc = spawn([sys.executable, "-c", "import time; time.sleep(60)", "launcher"], "launcher")
    yield psutil.Process(proc.pid)
    proc.kill()
    proc.wait()


def test_a_live_supervisor_keeps_the_recorded_state(tmp_path, supervisor_stand_in):
    write_record(
        tmp_path,
        state="RUNNING",
        boot_id=boot_id(),
        supervisor={**identity(supervisor_stand_in), "pid_ns": self_identity()["pid_ns"]},
    )
    seen = reconcile(read_record(tmp_path), tmp_path)
    assert seen.state is RunState.RUNNING and seen.liveness == "live" and seen.note is None


def test_a_gone_supervisor_here_is_supervisor_lost(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_record(tmp_path, state="RUNNING", boot_id=boot_id(), supervisor={"pid": dead.pid, "create_time": time.time()})
    seen = reconcile(read_record(tmp_path), tmp_path)
    assert seen.state is RunState.SUPERVISOR_LOST and seen.liveness == "gone"


def test_another_boot_is_node_lost(tmp_path):
    write_record(tmp_path, state="RUNNING", boot_id="00000000-0000-4000-8000-000000000000")
    seen = reconcile(read_record(tmp_path), tmp_path)
    assert seen.state is RunState.NODE_LOST and "rebooted" in seen.note


def test_another_pid_namespace_without_an_engine_is_unknown_never_supervisor_lost(tmp_path, monkeypatch):
    """A run recorded inside a container, read on the host where no Docker engine answers: its pids mean
    nothing here, so liveness is unknown and the recorded state stands."""
    import docker
    from docker.errors import DockerException

    def no_engine(**_):
        raise DockerException("no engine")

    monkeypatch.setattr(docker, "from_env", no_engine)
    write_record(
        tmp_path,
        state="RUNNING",
        boot_id=boot_id(),
        container={"name": "deltanet-train-cpu"},
        supervisor={"pid": 1, "create_time": 1.0, "pid_ns": "pid:[1]"},
    )
    seen = reconcile(read_record(tmp_path), tmp_path)
    assert seen.state is RunState.RUNNING and seen.liveness == "unknown"
    assert "state unknown" in seen.note and "deltanet-train-cpu" in seen.note


def test_under_the_lock_a_run_from_a_vanished_container_is_node_lost(tmp_path, monkeypatch):
    """A new container's supervisor holds the run lock; an earlier run recorded RUNNING in another container
    (other pid namespace, no engine to ask from inside) cannot be live, or it would hold the lock."""
    import docker
    from docker.errors import DockerException

    from launcher.run.setup import check_earlier_runs

    def no_engine(**_):
        raise DockerException("no engine")

    monkeypatch.setattr(docker, "from_env", no_engine)
    run_dir = write_record(
        tmp_path / "runs" / "old",
        "old",
        state="RUNNING",
        boot_id=boot_id(),
        container={"name": "deltanet-train-cpu"},
        supervisor={"pid": 1, "create_time": 1.0, "pid_ns": "pid:[1]"},
    )
    warnings = check_earlier_runs(tmp_path / "runs")
    assert len(warnings) == 1 and "run old" in warnings[0] and "deltanet-train-cpu" in warnings[0]
    record = read_record(run_dir)
    assert record.state is RunState.NODE_LOST and record.ended and "run lock was free" in record.reason


def test_a_restarted_container_is_node_lost_although_its_namespace_id_came_back(tmp_path):
    """`docker compose up` after `docker kill` restarts the same container: same id, and the kernel may hand
    the new pid namespace the old one's number. A supervisor older than this namespace's init is gone."""
    from launcher.state.procs import namespace_started

    started = namespace_started()
    write_record(
        tmp_path,
        state="RUNNING",
        boot_id=boot_id(),
        supervisor={"pid": 7, "create_time": started - 60, "pid_ns": self_identity()["pid_ns"]},
    )
    seen = reconcile(read_record(tmp_path), tmp_path)
    assert seen.state is RunState.NODE_LOST and "restarted" in seen.note
