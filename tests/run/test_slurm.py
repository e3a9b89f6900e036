"""`launcher submit` without a cluster: the batch script, Slurm's variables -> the node spec, the record's job
id and `status` showing Slurm's state (a fake sbatch and scontrol on PATH). The real cluster: tests/slurm/."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from launcher.run.job import NodeSpec, first_host, slurm_port
from launcher.run.placement.slurm import batch_script, stop_promise, task_command
from launcher.run.slurm_node import requeue, wants_requeue
from launcher.state.slurmjob import lost_node, lost_nodes, parse_show_job
from launcher.state.states import RunState
from tests.support.common import launcher_cmd, make_config, only_run_dir


def test_slurm_variables_place_the_node():
    env = {"SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[07-08]"}
    node = NodeSpec.from_slurm(env)
    assert node == NodeSpec(nnodes=2, node_rank=1, master_addr="gpu07", master_port=slurm_port(4242))
    node = NodeSpec.from_slurm({**env, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
    assert (node.master_addr, node.master_port) == ("10.0.0.1", 29500)
    assert [first_host(x) for x in ("n[1-2]", "a,b", "x[3,5]", "solo")] == ["n1", "a", "x3", "solo"]
    with pytest.raises(ValueError, match="not inside a Slurm job step"):
        NodeSpec.from_slurm({})


def test_the_batch_script_runs_one_launcher_per_node(tmp_path):
    run_dir = tmp_path / "runs" / "demo-1"
    task = task_command("host", None, run_dir)
    script = batch_script("demo-1", run_dir, 2, task, partition="npu", time_limit="1-00:00:00", grace_s=120)
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=1" in script
    assert "#SBATCH --partition=npu" in script and "#SBATCH --time=1-00:00:00" in script
    assert "#SBATCH --signal=B:USR1@180" in script  # the grace plus the margin before the time limit
    assert f"#SBATCH --output={run_dir / 'slurm.out'}" in script and "#SBATCH --no-requeue" in script
    assert "srun --nodes=2 --ntasks-per-node=1" in script and f"_slurm-node {run_dir}" in script
    assert "trap stop_run USR1" in script and " stop " in script  # the time limit stops the run as `launcher stop` does
    assert "MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))" in script
    requeue = batch_script("demo-1", run_dir, 2, task, requeue=True, grace_s=120)
    assert "#SBATCH --requeue" in requeue and "#SBATCH --signal" not in requeue
    docker = task_command("docker", "deltanet:npu", run_dir)
    assert docker[:2] == ["docker", "run"] and "--network" in docker and "deltanet:npu" in docker
    assert task_command("apptainer", "x.sif", run_dir)[:2] == ["apptainer", "exec"]
    with pytest.raises(Exception, match="needs --image"):
        task_command("apptainer", None, run_dir)


@pytest.mark.parametrize(
    ("end", "restarts", "max_restarts", "wanted"),
    [
        (RunState.NODE_LOST, 0, 1, True),
        (RunState.NODE_LOST, 1, 2, True),
        (RunState.NODE_LOST, 1, 1, False),  # the restarts are spent
        (RunState.NODE_LOST, 0, None, False),  # no launcher.restart
        (RunState.FAILED, 0, 2, False),  # a failure of the training itself is not requeued
        (RunState.CANCELLED, 0, 2, False),
    ],
)
def test_node_0_requeues_only_a_lost_node_while_restarts_remain(end, restarts, max_restarts, wanted):
    assert wants_requeue(end, restarts, max_restarts) is wanted


def test_requeue_asks_scontrol_and_survives_a_refusal_or_no_slurm(tmp_path, monkeypatch, capsys):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    refuse = '[ "$2" = 42 ] || { echo "Job is pending execution" >&2; exit 1; }\n'
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "asked"}\n{refuse}')
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    assert requeue("42") is True and "node 0: Slurm job 42 requeued" in capsys.readouterr().out
    assert requeue("43") is False and "requeue 43 refused: Job is pending execution" in capsys.readouterr().out
    assert (tmp_path / "asked").read_text().splitlines() == ["requeue 42", "requeue 43"]
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    assert requeue("42") is False and "did not run (no scontrol on this machine)" in capsys.readouterr().out


def test_scontrol_answer_is_read():
    view = parse_show_job(
        "7",
        "JobId=7 JobName=x UserId=root(0) JobState=PENDING Reason=Resources Dependency=(null) "
        "NodeList=(null) ExitCode=0:0",
    )
    assert view.live and view.describe() == "job 7 PENDING (Resources)"
    done = parse_show_job("7", "JobId=7 JobState=NODE_FAIL Reason=NodeDown NodeList=n[1-2] ExitCode=0:0")
    assert done.live is False and "NODE_FAIL" in done.describe()


def test_a_lost_node_is_read_from_scontrol(tmp_path, monkeypatch):
    states = {"n1": "MIXED", "n2": "DOWN+NOT_RESPONDING", "n3": "IDLE*", "n4": "ALLOCATED+DRAIN"}
    assert lost_nodes(states) == {"n2": "DOWN+NOT_RESPONDING", "n3": "IDLE*"}
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        "#!/bin/sh\n"
        'if [ "$2" = job ]; then echo "JobId=5 JobState=RUNNING Reason=None NodeList=n[1-2]"; exit 0; fi\n'
        'echo "NodeName=n1 Arch=x State=MIXED CPUTot=2"; echo "NodeName=n2 Arch=x State=$(cat '
        + str(tmp_path / "n2")
        + ') CPUTot=2"\n'
    )
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    (tmp_path / "n2").write_text("MIXED")
    assert lost_node("5", wait_s=0.5, poll_s=0.1) is None  # nothing lost: asked until the wait is over
    (tmp_path / "n2").write_text("MIXED+NOT_RESPONDING")
    assert lost_node("5", wait_s=0) == "Slurm job 5 RUNNING; node n2 MIXED+NOT_RESPONDING"
    (tmp_path / "n2").write_text("DOWN+NOT_RESPONDING")  # the allocation names the node the job no longer does
    assert lost_node("5", nodes="n[1-2]", wait_s=0) == "Slurm job 5 RUNNING; node n2 DOWN+NOT_RESPONDING"


def _fake_slurm(bin_dir: Path, state: str) -> None:
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho '4242;cluster'\n")
    answer = f"JobId=4242 JobState={state} Reason=Priority NodeList=(null)"
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho '{answer}'\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)


def test_submit_records_the_job_and_status_shows_its_queue_state(tmp_path, demo_assets, monkeypatch):
    _fake_slurm(tmp_path / "bin", "PENDING")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    cfg = make_config(tmp_path, demo_assets)
    done = launcher_cmd("submit", cfg, "--nodes", "2", "--partition", "cpu")
    assert done.returncode == 0, done.stdout + done.stderr
    run_dir = only_run_dir(tmp_path / "runs")
    record = json.loads((run_dir / "status.json").read_text())
    assert record["state"] == "PENDING" and record["slurm"]["job_id"] == "4242"
    assert record["slurm"]["nodes"] == 2 and record["slurm"]["partition"] == "cpu"
    assert (run_dir / "slurm.sbatch").is_file() and (run_dir / "config.yaml").is_file()
    shown = launcher_cmd("status", run_dir)
    assert "PENDING" in shown.stdout and "job 4242 PENDING (Priority)" in shown.stdout, shown.stdout
    as_json = json.loads(launcher_cmd("status", run_dir, "--json").stdout)
    assert as_json["slurm_state"] == "PENDING" and as_json["liveness"] == "live"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nodes", "0"], "--nodes 0: a run needs at least 1 node"),
        (["--nodes", "2", "--runtime", "docker"], "--runtime docker needs --image"),
        (["--nodes", "2", "--runtime", "podman"], "invalid choice: 'podman'"),  # argparse's own line
    ],
)
def test_bad_submit_arguments_are_one_message_and_leave_no_run_folder(
    tmp_path, demo_assets, monkeypatch, args, message
):
    _fake_slurm(tmp_path / "bin", "PENDING")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    cfg = make_config(tmp_path, demo_assets)
    done = launcher_cmd("submit", cfg, *args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr and done.stderr.count("error:") == 1, done.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_a_stop_promises_a_save_only_when_every_node_announced_one_in_this_attempt(tmp_path):
    """What ``launcher stop`` tells of a running Slurm run: node 0's announcement in the run folder, node N's in its
    newest ``nodes/nodeN/`` run folder, each counted only when made after this attempt started (a lost node's
    folder of the attempt before still holds its old one)."""
    import time
    import types
    from datetime import UTC, datetime

    started = time.time() - 60
    record = types.SimpleNamespace(
        started=datetime.fromtimestamp(started, UTC).isoformat(timespec="seconds"), slurm={"nodes": 2, "job_id": "7"}
    )
    run_dir = tmp_path / "run"
    nodes = run_dir / "nodes" / "node1"
    old, new = nodes / "run-attempt1", nodes / "run-attempt2"
    for folder in (run_dir, old, new):
        folder.mkdir(parents=True)
        (folder / "status.json").write_text("{}")
    os.utime(old / "status.json", (started - 600, started - 600))  # list_runs: oldest first by record time

    def announce(folder: Path, at: float) -> None:
        (folder / "save_on_stop.json").write_text(json.dumps({"pid": 1, "time": at, "step": 3}))

    assert stop_promise(run_dir, record, now=True) == "no save"
    assert stop_promise(run_dir, record, now=False).endswith(
        "training has not begun on node 0, 1 (no save-on-stop announcement there yet)"
    )
    announce(run_dir, started + 30)
    announce(old, started - 300)  # attempt 1's, on the node that was lost
    assert "training has not begun on node 1 " in stop_promise(run_dir, record, now=False)
    announce(new, started + 31)
    assert stop_promise(run_dir, record, now=False) == "a checkpoint at the next step, then exit"
    announce(run_dir, started - 1)  # node 0's from before this attempt (its supervisor clears it; here it did not)
    assert "training has not begun on node 0 " in stop_promise(run_dir, record, now=False)
