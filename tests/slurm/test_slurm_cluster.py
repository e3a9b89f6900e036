"""A real Slurm cluster of containers (scripts/slurm-cluster.sh: slurmctld and two slurmd nodes, each a
container of the cpu image with Debian's Slurm, one munge key, the host's network) runs the CPU demo on 2
nodes with gloo: `launcher submit` on the controller's container with the image's own launcher; `status`,
`verify` and `stop` from this machine, the login node; a node lost mid-run (n2's container killed: NODE_LOST,
node 0's requeue, the resume) and a stop with its saved checkpoint.

Only with LAUNCHER_SLURM_TESTS=1 and LAUNCHER_DOCKER_TESTS=1 (`.ci/run` sets both with an engine up and the
login node's Slurm client installed). The session's temporary folder is the shared storage: mounted at the
same path in every container, as a cluster's shared filesystem is. Node 0 supervises in the run folder,
node 1 under its nodes/node1/ (its own record and lock).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import psutil
import pytest

from launcher.run.placement.slurm import node_run_dirs
from launcher.state.checkpoints import last_complete_checkpoint
from launcher.state.runs import SAVE_READY
from tests.support.common import REPO, launcher_cmd, make_config, only_run_dir
from tests.support.engine import ENABLE, docker_cli
from tests.support.fake_runs import wait_for

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(
        os.environ.get("LAUNCHER_SLURM_TESTS") != "1" or os.environ.get(ENABLE) != "1",
        reason=f"needs a Docker engine and Slurm's client for a real cluster of containers: "
        f"LAUNCHER_SLURM_TESTS=1 {ENABLE}=1 (bash scripts/slurm-cluster.sh install; "
        "bash scripts/docker-engine.sh start; .ci/run does both)",
    ),
]
SCRIPT = REPO / "scripts" / "slurm-cluster.sh"
CONTROLLER = "deltanet-slurm-ctl"
ENDS = (
    "SUCCEEDED",
    "FAILED",
    "CANCELLED",
    "TERMINATED",
    "NODE_LOST",
    "FAILED_SETUP",
    "SUPERVISOR_LOST",
    "FAILED_ACCEPTANCE",
)


def _start_cluster(shared: Path) -> subprocess.CompletedProcess:
    """``slurm-cluster.sh start``: everything up, a killed member started again (idempotent). About 6 s, the
    node image's build (apt) once more; the script's own wait for idle nodes is 90 s."""
    return subprocess.run(
        ["bash", str(SCRIPT), "start"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "SLURM_SHARED_DIR": str(shared)},
    )


@pytest.fixture(scope="module")
def cluster(cpu_image, tmp_path_factory, request):
    """The cluster on the cpu image, the session's temporary folder shared; its SLURM_CONF. Removed after,
    whatever happened (also when it did not start)."""
    request.addfinalizer(
        lambda: subprocess.run(["bash", str(SCRIPT), "stop"], capture_output=True, timeout=300, check=False)
    )
    shared = tmp_path_factory.getbasetemp()
    done = _start_cluster(shared)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip().rsplit("SLURM_CONF=", 1)[-1], shared


@pytest.fixture
def slurm_env(cluster, monkeypatch) -> tuple[str, Path]:
    monkeypatch.setenv("SLURM_CONF", cluster[0])
    return cluster


def _status(run_dir: Path) -> dict:
    done = launcher_cmd("status", run_dir, "--json", timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def _record(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())


def _submit(tmp_path: Path, cfg: Path) -> tuple[Path, str]:
    """``launcher submit CFG --nodes 2`` on the controller's container: (the run folder, the Slurm job id)."""
    done = subprocess.run(
        [docker_cli(), "exec", "-w", str(tmp_path), CONTROLLER, "launcher", "submit", str(cfg), "--nodes", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0 and "as Slurm job" in done.stdout, done.stdout + done.stderr
    run_dir = only_run_dir(tmp_path / "runs")
    job_id = _record(run_dir)["slurm"]["job_id"]
    assert job_id and (run_dir / "slurm.sbatch").is_file()
    return run_dir, job_id


def _ended(run_dir: Path, timeout: float = 600) -> dict:
    wait_for("the run to end", lambda: _record(run_dir)["state"] in ENDS, timeout=timeout, every=1)
    return _record(run_dir)


def _slurm_out(run_dir: Path) -> str:
    out = run_dir / "slurm.out"
    return out.read_text()[-4000:] if out.exists() else "(no slurm.out)"


def _cancel_leftovers(job_id: str) -> None:
    """scancel the job and kill any process of it still alive (they run in the containers, seen from here; the
    test cluster's name tells them from another cluster's job of the same id)."""
    subprocess.run(["scancel", job_id], capture_output=True, timeout=60, check=False)
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
            if env.get("SLURM_JOB_ID") == job_id and env.get("SLURM_CLUSTER_NAME") == "deltanet":
                proc.kill()
        except (psutil.Error, OSError):
            continue


def test_two_nodes_train_the_demo_to_succeeded(slurm_env, tmp_path, demo_assets):
    cfg = make_config(tmp_path, demo_assets, launcher={"nnodes": 2}, max_steps=2, save_steps=2, eval_steps=2)
    run_dir, job_id = _submit(tmp_path, cfg)
    try:
        first = _status(run_dir)
        assert first["slurm_state"] in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "COMPLETED"), first
        end = _ended(run_dir)
    finally:
        if _record(run_dir)["state"] not in ENDS:
            _cancel_leftovers(job_id)
    assert end["state"] == "SUCCEEDED", (end, _slurm_out(run_dir), (run_dir / "launcher.log").read_text()[-3000:])
    assert end["node"]["nnodes"] == 2 and end["node"]["node_rank"] == 0
    assert "--node-rank" in end["command"]
    assert (run_dir / "output" / "adapter_model.safetensors").is_file()
    (node1,) = [p for p in (run_dir / "nodes" / "node1").iterdir() if (p / "status.json").is_file()]
    wait_for("node 1's end", lambda: _record(node1)["state"] == "SUCCEEDED", timeout=60)
    verify = launcher_cmd("verify", run_dir)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    wait_for("Slurm's COMPLETED", lambda: _status(run_dir)["slurm_state"] == "COMPLETED", timeout=60, every=1)
    shown = launcher_cmd("status", run_dir).stdout
    assert f"job {job_id} COMPLETED" in shown and "SUCCEEDED" in shown


@pytest.mark.timeout(1500)  # its waits, each bounded, add up past the suite's 900 s; measured about 4 minutes
def test_a_lost_node_ends_node_lost_is_requeued_resumed_and_stopped_with_a_save(slurm_env, tmp_path, demo_assets):
    """launcher.restart (one restart): the job is submitted --requeue. n2's container is killed (slurmd and
    the node's processes with it) once a checkpoint is complete: node 0 records NODE_LOST (exit 7, n2 named)
    and asks Slurm to requeue the job; with n2 started again, attempt 2 resumes from that checkpoint; a
    stop from the login node then ends it CANCELLED with a checkpoint saved on stop."""
    cfg = make_config(
        tmp_path,
        demo_assets,
        launcher={"nnodes": 2, "restart": {"max_restarts": 1, "backoff_s": 0}},
        max_steps=400,
        save_steps=2,
        eval_steps=1000,
        logging_steps=1,
    )
    run_dir, job_id = _submit(tmp_path, cfg)
    assert "#SBATCH --requeue\n" in (run_dir / "slurm.sbatch").read_text()
    output = run_dir / "output"
    try:
        wait_for("a complete checkpoint", lambda: last_complete_checkpoint(output), timeout=300, every=1)
        attempt_1_nodes = set(node_run_dirs(run_dir))
        assert len(attempt_1_nodes) == 1, attempt_1_nodes
        killed = subprocess.run(
            [docker_cli(), "kill", "deltanet-slurm-n2"], capture_output=True, text=True, timeout=120, check=False
        )
        assert killed.returncode == 0, killed.stderr
        lost = _ended(run_dir, timeout=300)
        assert lost["state"] == "NODE_LOST", (lost, _slurm_out(run_dir))
        assert lost["run_exit_code"] == 7 and "node n2 " in lost["reason"], lost
        assert '"event": "node_lost"' in (run_dir / "events.jsonl").read_text()
        last = last_complete_checkpoint(output)
        wait_for("node 0's requeue", lambda: f"node 0: Slurm job {job_id} requeued" in _slurm_out(run_dir), timeout=120)
        back = _start_cluster(slurm_env[1])  # n2's container started again; the requeued job runs on it
        assert back.returncode == 0, back.stdout + back.stderr
        # Slurm holds a requeued job cred_expire + 1 s (Reason=BeginTime; 61 s on this cluster). Not shortened
        # with `scontrol update StartTime=now`: the new attempt's step (the same id, 1.0) was then SIGKILLed
        # KillWait after the requeue, by the kill meant for the old one
        second = wait_for(
            "attempt 2 running",
            lambda: (r := _record(run_dir))["attempt"] == 2 and r["state"] == "RUNNING" and r,
            timeout=300,
            every=1,
        )
        assert second["resumed_from"] == str(last.path.relative_to(run_dir)), (second, last)

        # attempt 2's training began on both nodes: each node's local rank 0 announced that it saves on a stop
        # (node 0's supervisor cleared attempt 1's announcement before it recorded RUNNING; node 1 supervises
        # attempt 2 in a new run folder). Not the status's step: the trainer log still holds the steps attempt 1
        # logged past its last checkpoint, and a node whose job has not announced is stopped without a save
        def training_on_both_nodes() -> bool:
            fresh = [d for d in node_run_dirs(run_dir) if d not in attempt_1_nodes]
            return len(fresh) == 1 and all((d / SAVE_READY).is_file() for d in (run_dir, *fresh))

        wait_for("attempt 2 training on both nodes", training_on_both_nodes, timeout=200, every=1)
        stop = launcher_cmd("stop", run_dir, "--grace", "120", timeout=300)
        assert stop.returncode == 0, stop.stdout + stop.stderr
    finally:
        if _record(run_dir)["state"] not in ENDS or _record(run_dir)["attempt"] < 2:
            _cancel_leftovers(job_id)
        _start_cluster(slurm_env[1])  # the cluster left whole for what comes next
    final = _record(run_dir)
    assert final["state"] == "CANCELLED" and final["attempt"] == 2, (final, _slurm_out(run_dir))
    assert "through Slurm" in final["stopped_by"] and "saved at step" in stop.stdout, (final, stop.stdout)
    assert "stop requested on every node (a checkpoint at the next step, then exit)" in stop.stdout, stop.stdout
    saved = final["saved_checkpoint"]
    assert saved and (run_dir / saved["path"] / "adapter_model.safetensors").is_file(), final
