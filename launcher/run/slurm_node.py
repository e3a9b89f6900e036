"""Each node's launcher of a run submitted to Slurm (``launcher _slurm-node RUN_DIR``, started by the batch
script of ``run/placement/slurm.py`` once per node): placed by Slurm's variables, it supervises its node's part of
the run; node 0 asks Slurm to requeue the job after a lost node when ``launcher.restart`` allows it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from launcher.config.run_config import load_run_config
from launcher.errors import ExitCode, LauncherError
from launcher.run.job import NodeSpec
from launcher.run.placement.slurm import node_root
from launcher.run.supervisor import supervise
from launcher.state.checkpoints import last_complete_checkpoint
from launcher.state.record import RecordUnreadable, RunStore, read_record
from launcher.state.runs import CONFIG_COPY, OUTPUT_SUBDIR, OVERRIDES_FILE
from launcher.state.slurmjob import run_scontrol
from launcher.state.states import RunState


def run_node(run_dir: Path) -> int:
    """``launcher _slurm-node RUN_DIR``: this node's launcher of a submitted run, placed by Slurm's variables.

    Node 0 supervises in the run folder itself; a requeued job (``launcher.restart``) resumes there from the
    last complete checkpoint as the next attempt, the earlier attempt recorded ``NODE_LOST`` if it recorded no
    end. Node N >= 1 supervises in ``nodes/nodeN/``, resuming from the same checkpoint. When node 0 ends
    ``NODE_LOST`` with restarts left, it asks Slurm to requeue the job (``requeue``).
    """
    from launcher.run.signals import end_hold_guard

    node = NodeSpec.from_slurm(os.environ)
    if node.node_rank == 0:  # its run folder exists (submit made it): a stop from here is the supervisor's to record
        end_hold_guard()
    os.environ.update(
        NNODES=str(node.nnodes),
        NODE_RANK=str(node.node_rank),
        MASTER_ADDR=node.master_addr,
        MASTER_PORT=str(node.master_port),
    )
    overrides = _overrides(run_dir)
    record = read_record(run_dir)
    restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    checkpoint = last_complete_checkpoint(run_dir / OUTPUT_SUBDIR) if restarts else None
    print(
        f"node {node.node_rank} of {node.nnodes}: rendezvous {node.master_addr}:{node.master_port}"
        + (f"; Slurm restart {restarts}, resuming from {checkpoint.path}" if checkpoint else ""),
        flush=True,
    )
    if node.node_rank > 0:
        overrides["launcher.output_root"] = str(node_root(run_dir, node.node_rank))
        overrides["launcher.run_name"] = f"{record.run_id}-node{node.node_rank}"
        if checkpoint is not None:
            overrides["resume_from_checkpoint"] = str(checkpoint.path)
    else:
        overrides["launcher.output_root"] = str(run_dir.parent)  # the lock node 0 takes is the run folder's
    config = load_run_config(run_dir / CONFIG_COPY, overrides)
    policy = config.launcher.restart
    if restarts and (policy is None or restarts > policy.max_restarts):
        return _refuse_restart(run_dir, node.node_rank, restarts, policy.max_restarts if policy else 0)
    if node.node_rank > 0:
        return supervise(config, echo=False, watch_stop_request=True)
    job_id = os.environ.get("SLURM_JOB_ID")
    code = supervise(config, echo=False, adopt=run_dir, watch_stop_request=True)
    try:
        end = read_record(run_dir).state
    except RecordUnreadable as e:  # the end is what supervise returned; no requeue on a record not read
        print(f"node 0: {e}; Slurm job {job_id} is not requeued", flush=True)
        return code
    if job_id and wants_requeue(end, restarts, policy.max_restarts if policy else None):
        requeue(job_id)
    return code


def wants_requeue(end: RunState, restarts: int, max_restarts: int | None) -> bool:
    """Node 0's attempt ended ``end`` after ``restarts`` Slurm requeues: requeue again? Only for a lost node,
    only with ``launcher.restart`` (``max_restarts``), and only while restarts remain."""
    return end is RunState.NODE_LOST and max_restarts is not None and restarts < max_restarts


def requeue(job_id: str, timeout_s: float = 30.0) -> bool:
    """Node 0 asks Slurm to requeue its job (``scontrol requeue``) after recording ``NODE_LOST``.

    Slurm requeues a ``--requeue`` job by itself only when the job ends ``NODE_FAIL``. A node whose whole
    container or machine died takes its tasks with it, so ``srun`` sees them exit and the job ends as a failed
    step, not a node failure, before slurmctld has called the node DOWN: without this no attempt 2 would come.
    Slurm stops what is left of the job and queues it again; ``SLURM_RESTART_COUNT`` counts the attempts.
    When Slurm had already requeued the job, scontrol refuses, and that is fine."""
    print(f"node 0: a node was lost; scontrol requeue {job_id} (launcher.restart)", flush=True)
    done = run_scontrol(["requeue", job_id], timeout_s)
    if isinstance(done, str):
        print(f"node 0: scontrol requeue {job_id} did not run ({done}); the job is not requeued", flush=True)
        return False
    if done.returncode != 0:
        print(f"node 0: scontrol requeue {job_id} refused: {(done.stderr or done.stdout).strip()}", flush=True)
    else:
        print(f"node 0: Slurm job {job_id} requeued", flush=True)
    return done.returncode == 0


def _refuse_restart(run_dir: Path, node_rank: int, restarts: int, max_restarts: int) -> int:
    """Slurm requeued the job more often than ``launcher.restart.max_restarts`` allows: node 0 records the
    earlier attempt's end (``NODE_LOST``) and no attempt starts."""
    why = f"Slurm requeued the job (restart {restarts}); launcher.restart.max_restarts is {max_restarts}"
    print(f"node {node_rank}: {why}: not restarted", flush=True)
    if node_rank == 0:
        store = RunStore.open(run_dir)
        if not store.record.terminal:
            store.record_end(RunState.NODE_LOST, processes=[], reason=f"{why}; not restarted")
    return ExitCode.FAILED


def _overrides(run_dir: Path) -> dict[str, Any]:
    from launcher.files import read_yaml_mapping

    if not (run_dir / OVERRIDES_FILE).exists():
        return {}
    values = read_yaml_mapping(run_dir / OVERRIDES_FILE)
    if isinstance(values, str):
        raise LauncherError(f"{values}; it holds the run's KEY=VALUE overrides")
    return dict(values)
