"""Where a run lives is chosen once (``run/placement``), and the stop's grace is one rule in every placement.

The local run is real (the launcher, its supervisor and fake ranks). The Slurm stop uses stand-ins for
``scontrol`` and ``scancel`` on PATH (the real cluster: tests/slurm/); the container stop's engine is the docker
SDK stand-in of tests/containers/test_status_docker.py, which also checks its grace."""

from __future__ import annotations

import inspect
import json
import os
import threading
from pathlib import Path

import pytest

from launcher.run import placement as placement_package
from launcher.run.control import stop_run
from launcher.run.placement import PLACEMENTS, placement_of
from launcher.run.placement.container import ContainerPlacement
from launcher.run.placement.local import LocalPlacement
from launcher.run.placement.slurm import END_MARGIN_S, SlurmPlacement
from launcher.state.procs import boot_id, self_identity
from launcher.state.record import RunStore, read_record
from launcher.state.states import RunState
from launcher.state.stop import DEFAULT_STOP_GRACE_S, stop_grace
from tests.run.test_stop import stalled
from tests.support import fake_runs as fr

OTHER_NS = {"pid": 7, "create_time": 1.0, "pid_ns": "pid:[1]"}


def _record(tmp_path: Path, name: str, **fields):
    return read_record(fr.write_record(tmp_path / name, name, state="RUNNING", boot_id=boot_id(), **fields))


def test_each_record_has_one_placement_seen_from_here(tmp_path, monkeypatch):
    """A process of this namespace is local; a container's run seen from the host goes through the engine; the
    same run seen from inside another container cannot be reached (local, liveness unknown); a Slurm job is
    Slurm's, whatever runtime its nodes used."""
    monkeypatch.delenv("LAUNCHER_CONTAINER", raising=False)
    container = {"name": "deltanet-train-cpu", "id": "c" * 64}
    local = _record(tmp_path, "local", supervisor=self_identity())
    in_container = _record(tmp_path, "box", supervisor=OTHER_NS, container=container)
    slurm = _record(tmp_path, "job", supervisor=OTHER_NS, container=container, slurm={"job_id": "42", "nodes": 2})
    assert type(placement_of(local)) is LocalPlacement
    assert type(placement_of(in_container)) is ContainerPlacement
    assert type(placement_of(slurm)) is SlurmPlacement
    monkeypatch.setenv("LAUNCHER_CONTAINER", "another-container")  # this verb now runs in a container itself
    seen_from_a_container = placement_of(in_container)
    assert type(seen_from_a_container) is LocalPlacement
    assert seen_from_a_container.where() == "container deltanet-train-cpu"
    seen = seen_from_a_container.reconcile(tmp_path / "box")
    assert seen.liveness == "unknown" and seen.state is RunState.RUNNING and "cannot be reached" in seen.note
    assert PLACEMENTS[-1] is LocalPlacement  # the fallback comes last


@pytest.mark.parametrize("kind", [LocalPlacement, ContainerPlacement, SlurmPlacement])
@pytest.mark.parametrize(
    ("given", "recorded", "grace"),
    [(None, 0.0, 0.0), (5.0, 0.0, 5.0), (0.0, 300.0, 0.0), (None, 30.0, 30.0), (None, None, DEFAULT_STOP_GRACE_S)],
)
def test_every_placement_takes_the_one_grace_rule(tmp_path, kind, given, recorded, grace):
    record = _record(tmp_path, "run", supervisor=OTHER_NS, stop_grace_s=recorded)
    assert kind(record).grace(given) == grace == stop_grace(given, recorded)


def test_the_grace_rule_is_asked_in_one_place():
    """``Placement.stop`` asks ``stop_grace`` and hands the answer to each placement's ``_stop``: no placement
    module asks it again or writes a default of its own."""
    base = Path(inspect.getfile(placement_package)).parent
    for module in sorted(base.glob("*.py")):
        text = module.read_text()
        assert ("stop_grace(" in text) == (module.name == "base.py"), module.name
        assert "stop_grace_s or" not in text and "DEFAULT_STOP_GRACE_S" not in text, module.name


def _fake_slurm(bin_dir: Path, log: Path) -> None:
    """Stand-ins: ``scontrol`` says the job runs; ``scancel`` writes its arguments to ``log``."""
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho 'JobId=42 JobState=RUNNING Reason=None NodeList=n[1-2]'\n")
    (bin_dir / "scancel").write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)


@pytest.mark.parametrize(("recorded", "given", "limit"), [(0.0, None, END_MARGIN_S), (0.0, 5.0, 5 + END_MARGIN_S)])
def test_a_slurm_stop_takes_the_grace_as_every_placement_does(tmp_path, monkeypatch, capsys, recorded, given, limit):
    """``stop_grace_s: 0`` gives the nodes no grace beyond the margin for their end records; ``--grace 5`` five
    seconds more. Node 0's supervisor is played by a thread: it records the end once the request is there."""
    _fake_slurm(tmp_path / "bin", tmp_path / "scancel.log")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    run_dir = fr.write_record(
        tmp_path / "runs" / "job",
        "job",
        state="RUNNING",
        boot_id=boot_id(),
        supervisor=OTHER_NS,
        stop_grace_s=recorded,
        slurm={"job_id": "42", "nodes": 1},
    )

    def node_0():
        fr.wait_for("the stop request", lambda: (run_dir / "stop_request.json").exists(), timeout=60)
        request = json.loads((run_dir / "stop_request.json").read_text())
        RunStore.open(run_dir).record_end(RunState.CANCELLED, stopped_by=request["by"], processes=[])

    thread = threading.Thread(target=node_0)
    thread.start()
    try:
        assert stop_run(run_dir, given) == 0
    finally:
        thread.join()
    said = capsys.readouterr().out
    assert f"scancel after {limit:.0f} s" in said, said
    assert json.loads((run_dir / "stop_request.json").read_text())["grace_s"] == given
    assert not (tmp_path / "scancel.log").exists()  # it ended within the limit: nothing cancelled


def test_a_local_stop_with_a_zero_grace_asks_the_save_and_does_not_wait_for_it(tmp_path, demo_assets):
    """``stop_grace_s: 0`` in the config: the frozen job is asked to save, the grace of 0 s runs out at once, and
    the run ends CANCELLED without a checkpoint (a container or Slurm stop takes the same 0)."""
    run_dir, env = stalled(tmp_path, demo_assets, stop_grace_s=0.0)
    stopped = fr.launcher("stop", run_dir, env=env, timeout=180)
    assert stopped.returncode == 0 and "ended CANCELLED" in stopped.stdout, stopped.stdout + stopped.stderr
    (stopping,) = [e for e in fr.events(run_dir) if e["event"] == "stopping"]
    assert stopping["grace_s"] == 0.0 and stopping["save"] is True
    kinds = [e["event"] for e in fr.events(run_dir)]
    assert kinds.index("stopping") < kinds.index("save_timeout") < kinds.index("ended")


def test_a_slurm_run_is_resumed_through_slurm_never_on_this_machine(tmp_path, monkeypatch):
    """``launcher resume`` of a Slurm run starts nothing here (its nodes are Slurm's): one message naming the
    checkpoint and the ``launcher submit`` that continues it; nothing written."""
    from launcher.errors import LauncherError
    from launcher.run.control import resume_run
    from tests.run.test_resume import crafted_run

    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm"))  # scontrol does not answer: the record stands
    run_dir = crafted_run(tmp_path, "CANCELLED", {2: True})
    record = json.loads((run_dir / "status.json").read_text())
    (run_dir / "status.json").write_text(json.dumps({**record, "slurm": {"job_id": "42", "nodes": 2}}))
    before = sorted(p.name for p in run_dir.rglob("*"))
    with pytest.raises(LauncherError) as info:
        resume_run(run_dir)
    said = str(info.value)
    assert "Slurm job 42" in said and "nothing was started" in said, said
    assert "launcher submit" in said and "--nodes 2" in said and "resume_from_checkpoint=" in said, said
    assert sorted(p.name for p in run_dir.rglob("*")) == before


def test_status_of_a_slurm_run_whose_nodes_ran_in_containers_shows_the_job(tmp_path, monkeypatch):
    """Each node of the Slurm run ran in a container (its record names one): status shows Slurm's row, and no
    container row for a container the host cannot ask about."""
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm"))
    run_dir = fr.write_record(
        tmp_path / "job",
        "job",
        state="SUCCEEDED",
        boot_id=boot_id(),
        supervisor=OTHER_NS,
        container={"name": None, "id": "c" * 64},
        slurm={"job_id": "42", "nodes": 2},
    )
    from launcher.monitor.status import collect, render

    info = collect(run_dir)
    shown = render(info)
    assert "job 42" in shown and "SUCCEEDED" in shown and "\ncontainer " not in shown, shown
