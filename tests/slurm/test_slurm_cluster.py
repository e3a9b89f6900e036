"""A real Slurm cluster (scripts/slurm-cluster.sh: slurmctld and two slurmd nodes on this host) runs the
CPU demo on 2 nodes with gloo: `launcher submit`, `status`, `stop`, a node lost mid-run (n2's slurmd
SIGKILLed: NODE_LOST, and the requeue after it); only with LAUNCHER_SLURM_TESTS=1.

Both nodes are this host, so node 0 and node 1 share the filesystem as on shared storage: node 0 supervises
in the run folder, node 1 under its nodes/node1/ (its own record and lock).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.support.common import REPO, launcher_cmd, make_config, only_run_dir
from tests.support.fake_runs import wait_for

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(os.environ.get("LAUNCHER_SLURM_TESTS") != "1",
                       reason="needs a real Slurm cluster: LAUNCHER_SLURM_TESTS=1 (bash scripts/slurm-cluster.sh "
                              "install && bash scripts/slurm-cluster.sh start)"),  # fmt: skip
]
SCRIPT = REPO / "scripts" / "slurm-cluster.sh"


def _cluster_dir() -> str:
    """The cluster's folder: SLURM_CLUSTER_DIR, else SLURM_CONF's, else the script's default."""
    conf = os.environ.get("SLURM_CONF")
    return os.environ.get("SLURM_CLUSTER_DIR") or (str(Path(conf).parent) if conf else "")


@pytest.fixture(scope="module")
def cluster() -> str:
    """The cluster started (idempotent); its SLURM_CONF."""
    done = subprocess.run(["bash", str(SCRIPT), "start", _cluster_dir()], capture_output=True, text=True, timeout=120,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip().rsplit("SLURM_CONF=", 1)[-1]


@pytest.fixture
def slurm_env(cluster, monkeypatch) -> str:
    monkeypatch.setenv("SLURM_CONF", cluster)
    return cluster


def _status(run_dir: Path) -> dict:
    done = launcher_cmd("status", run_dir, "--json", timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def _submit(tmp_path: Path, demo_assets, **lf) -> Path:
    cfg = make_config(tmp_path, demo_assets, launcher={"nnodes": 2}, **lf)
    done = launcher_cmd("submit", cfg, "--nodes", "2", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "as Slurm job" in done.stdout
    return only_run_dir(tmp_path / "runs")


def _ended(run_dir: Path, timeout: float = 600) -> dict:
    wait_for("the run to end", lambda: json.loads((run_dir / "status.json").read_text())["state"]
             in ("SUCCEEDED", "FAILED", "CANCELLED", "TERMINATED", "NODE_LOST", "FAILED_SETUP", "SUPERVISOR_LOST",
                 "FAILED_ACCEPTANCE"), timeout=timeout, every=1)  # fmt: skip
    return json.loads((run_dir / "status.json").read_text())


def test_two_nodes_train_the_demo_to_succeeded(slurm_env, tmp_path, demo_assets):
    run_dir = _submit(tmp_path, demo_assets, max_steps=2, save_steps=2, eval_steps=2)
    record = json.loads((run_dir / "status.json").read_text())
    job_id = record["slurm"]["job_id"]
    assert job_id and (run_dir / "slurm.sbatch").is_file()
    first = _status(run_dir)
    assert first["slurm_state"] in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "COMPLETED"), first
    end = _ended(run_dir)
    out = (run_dir / "slurm.out").read_text() if (run_dir / "slurm.out").exists() else ""
    assert end["state"] == "SUCCEEDED", (end, out[-3000:], (run_dir / "launcher.log").read_text()[-3000:])
    assert end["node"]["nnodes"] == 2 and end["node"]["node_rank"] == 0
    assert "--node-rank" in end["command"]
    assert (run_dir / "output" / "adapter_model.safetensors").is_file()
    (node1,) = [p for p in (run_dir / "nodes" / "node1").iterdir() if (p / "status.json").is_file()]
    wait_for("node 1's end", lambda: json.loads((node1 / "status.json").read_text())["state"] == "SUCCEEDED",
             timeout=60)  # fmt: skip
    verify = launcher_cmd("verify", run_dir)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    wait_for("Slurm's COMPLETED", lambda: _status(run_dir)["slurm_state"] == "COMPLETED", timeout=60, every=1)
    shown = launcher_cmd("status", run_dir).stdout
    assert f"job {job_id} COMPLETED" in shown and "SUCCEEDED" in shown


def test_stop_saves_a_checkpoint_on_both_nodes(slurm_env, tmp_path, demo_assets):
    run_dir = _submit(tmp_path, demo_assets, max_steps=400, save_steps=1000, eval_steps=1000, logging_steps=1)
    wait_for("training steps", lambda: (_status(run_dir).get("step") or 0) >= 2, timeout=400, every=1)
    done = launcher_cmd("stop", run_dir, "--grace", "120", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    end = json.loads((run_dir / "status.json").read_text())
    assert end["state"] == "CANCELLED", end
    saved = end["saved_checkpoint"]
    assert saved and (run_dir / saved["path"] / "adapter_model.safetensors").is_file(), end
    assert "through Slurm" in end["stopped_by"]
    assert "saved at step" in done.stdout


def _job_processes(job_id: str) -> list[psutil.Process]:
    """Every live process of Slurm job ``job_id`` on this host (its environment names the job), with the node."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("SLURM_JOB_ID") == job_id and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def _node_of(proc: psutil.Process) -> str | None:
    try:
        return proc.environ().get("SLURMD_NODENAME")
    except (psutil.Error, OSError):
        return None


def _scontrol(*args: str) -> str:
    return subprocess.run(["scontrol", "show", *args, "-o"], capture_output=True, text=True, check=False).stdout


def _kill_n2_mid_run(run_dir: Path, job_id: str) -> tuple[dict, list]:
    """SIGKILL n2's slurmd once training has logged a step; wait for node 0's end record: (the record, what
    was seen each second after the kill: seconds, run state, job state, node states)."""
    trainer_log = run_dir / "output" / "trainer_log.jsonl"
    wait_for("a trainer-log line", lambda: trainer_log.is_file() and trainer_log.read_text().strip(), timeout=400,
             every=1)  # fmt: skip
    pid = int(subprocess.run(["bash", str(SCRIPT), "pid", "n2", _cluster_dir()], capture_output=True, text=True,
                             check=True).stdout)  # fmt: skip
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    seen = []

    def ended():
        seen.append((round(time.monotonic() - killed_at, 1), json.loads((run_dir / "status.json").read_text())
                     ["state"], _scontrol("job", job_id).split("JobState=")[-1].split()[0],
                     [line.split("State=")[1].split()[0] for line in _scontrol("node").splitlines()]))  # fmt: skip
        return seen[-1][1] in ("SUCCEEDED", "FAILED", "CANCELLED", "TERMINATED", "NODE_LOST", "SUPERVISOR_LOST")

    wait_for("the run's end", ended, timeout=300, every=1)
    print("seen after the kill (s, run state, job state, node states):", *seen, sep="\n")
    return json.loads((run_dir / "status.json").read_text()), seen


def _kill_job_processes(job_id: str, node: str | None = None) -> None:
    for proc in _job_processes(job_id):
        if node is None or _node_of(proc) == node:
            try:
                proc.kill()
            except psutil.Error:
                pass


def _restart_cluster() -> None:
    """Leave the cluster up and idle, n2 back (ReturnToService=2)."""
    subprocess.run(["bash", str(SCRIPT), "stop", _cluster_dir()], capture_output=True, timeout=120, check=False)
    subprocess.run(["bash", str(SCRIPT), "start", _cluster_dir()], capture_output=True, timeout=120, check=False)


def test_a_node_lost_mid_run_ends_node_lost(slurm_env, tmp_path, demo_assets):
    run_dir = _submit(tmp_path, demo_assets, max_steps=400, save_steps=1000, eval_steps=1000, logging_steps=1)
    job_id = json.loads((run_dir / "status.json").read_text())["slurm"]["job_id"]
    try:
        end, seen = _kill_n2_mid_run(run_dir, job_id)
        # node 0 (n1) leaves nothing behind; n2's processes outlive its slurmd (proctrack/linuxproc, one host)
        wait_for("node 0's processes to end", lambda: not [p for p in _job_processes(job_id) if _node_of(p) == "n1"],
                 timeout=120, every=1)  # fmt: skip
    finally:
        _kill_job_processes(job_id)
        _restart_cluster()
    wait_for("no process of the run", lambda: not _job_processes(job_id), timeout=60, every=1)
    assert end["state"] == "NODE_LOST", (end, seen)
    assert end["run_exit_code"] == 7, end
    assert "node n2 " in end["reason"], end
    events = (run_dir / "events.jsonl").read_text()
    assert '"event": "node_lost"' in events


def test_a_node_lost_is_requeued_and_resumed(slurm_env, tmp_path, demo_assets):
    """launcher.restart: the job is --requeue; the lost node's attempt ends NODE_LOST, Slurm requeues the job
    (eligible about 2 minutes later), and once n2 is back attempt 2 resumes from the checkpoint saved on the
    SIGTERM."""
    cfg = make_config(tmp_path, demo_assets, launcher={"nnodes": 2, "restart": {"max_restarts": 1, "backoff_s": 0}},
                      max_steps=400, save_steps=1000, eval_steps=1000, logging_steps=1)  # fmt: skip
    done = launcher_cmd("submit", cfg, "--nodes", "2", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    run_dir = only_run_dir(tmp_path / "runs")
    job_id = json.loads((run_dir / "status.json").read_text())["slurm"]["job_id"]
    assert "--requeue" in (run_dir / "slurm.sbatch").read_text()
    try:
        end, seen = _kill_n2_mid_run(run_dir, job_id)
        assert end["state"] == "NODE_LOST" and end["saved_checkpoint"], (end, seen)
        _kill_job_processes(job_id, "n2")  # before n2 comes back: the requeued job starts on it
        subprocess.run(["/usr/sbin/slurmd", "-N", "n2", "-f", slurm_env], check=True, timeout=60)
        record = wait_for("attempt 2 running", lambda: (r := json.loads((run_dir / "status.json").read_text()))
                          ["attempt"] == 2 and r["state"] == "RUNNING" and r, timeout=300, every=1)  # fmt: skip
        assert record["resumed_from"] == end["saved_checkpoint"]["path"], record
        stop = launcher_cmd("stop", run_dir, "--grace", "120", timeout=300)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        final = json.loads((run_dir / "status.json").read_text())
        assert final["state"] == "CANCELLED" and final["attempt"] == 2, final
    finally:
        _kill_job_processes(job_id)
        _restart_cluster()
    wait_for("no process of the run", lambda: not _job_processes(job_id), timeout=60, every=1)
