"""A run submitted to Slurm, seen from the machine that submits it: ``launcher submit``, its liveness and
``launcher stop`` through Slurm (each node's launcher is ``run/slurm_node.py``).

``launcher submit CONFIG --nodes N`` creates the run folder (on storage every node sees), records the run
``PENDING`` with its Slurm job, writes the batch script (``slurm.sbatch``) and hands it to ``sbatch``. The
script starts one task per node with ``srun``; each task is ``launcher _slurm-node RUN_DIR``, run by one of:

- ``host``: the installed launcher (the Python that ran ``submit``), for sites without a container runtime;
- ``apptainer``: ``apptainer exec IMAGE launcher ...`` (Apptainer or Singularity, the usual HPC runtime);
- ``docker``: ``docker run --network host --init IMAGE launcher ...`` with the run folder mounted at its path.

A site chooses with ``--runtime`` (and ``--image``). Each node's launcher takes ``nnodes``, ``node_rank``,
``master_addr`` and ``master_port`` from Slurm's variables (``NodeSpec.from_slurm``). Node 0 supervises in the
run folder itself (its trainer log, adapter and record: what ``launcher status`` shows); node N >= 1 keeps its
own record, lock and job log under ``nodes/nodeN/`` inside it.

Stopping: ``launcher stop`` writes the stop request into every node's run folder; each node's supervisor sees
it (``Supervisor.watch_stop_request``) and stops its job the usual way, a checkpoint saved at the next step.
No Slurm signal is used for that: ``scancel --signal`` reaches every process of a step (torchrun and the ranks
too, not only the supervisor). Only when the run has not ended after the grace does ``scancel JOB`` end it
(Slurm's SIGTERM to every process, SIGKILL after KillWait). A job still waiting in the queue is cancelled at
once. A time limit (``--time``) works the same way: ``#SBATCH --signal=B:USR1@S`` makes Slurm signal the
batch shell S seconds before the limit, and its trap runs ``launcher stop`` on the run.

A lost node: node 0 records ``NODE_LOST`` (the node named, see ``state/slurmjob.py``); with
``launcher.restart`` the job is submitted ``--requeue`` and node 0 asks Slurm to requeue it (``requeue``), so
the next attempt resumes from the last complete checkpoint, up to ``max_restarts`` times.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher import SOURCE_ROOT
from launcher.errors import ExitCode, LauncherError
from launcher.run.placement.base import Placement, StopAsk, Supervise
from launcher.run.placement.container import stopped_line
from launcher.state.reconcile import Reconciled
from launcher.state.record import RecordUnreadable, RunRecord, RunStore, parse_time, read_record
from launcher.state.runs import (
    CONFIG_COPY,
    NODE_ROOT,
    NODES_DIR,
    OVERRIDES_FILE,
    SBATCH_SCRIPT,
    SLURM_OUT,
    list_runs,
)
from launcher.state.slurmjob import lost_node, query_job
from launcher.state.states import RunState
from launcher.state.stop import announced_at, read_saved, request_stop, saved_checkpoint

if TYPE_CHECKING:  # the config's schema (pydantic) is imported only by `submit`: `status` stays light
    from launcher.config.run_config import RunConfig

RUNTIMES = ("host", "apptainer", "docker")
END_MARGIN_S = 60.0  # after the grace: each node's supervisor stops what is left and writes its end record
TIME_LIMIT_MARGIN_S = 60.0  # the batch shell is told this much (plus the grace) before Slurm's time limit


# --- the batch script -------------------------------------------------------------------------------------


def task_command(runtime: str, image: str | None, run_dir: Path) -> list[str]:
    """What ``srun`` starts once per node: ``launcher _slurm-node RUN_DIR``, in the chosen runtime."""
    node_cmd = ["_slurm-node", str(run_dir)]
    if runtime == "host":
        return [sys.executable, "-m", "launcher", *node_cmd]
    if not image:
        raise LauncherError(
            f"--runtime {runtime} needs --image (the project's image: an .sif file for apptainer, "
            "an image name for docker)",
            ExitCode.USAGE,
        )
    root = str(run_dir.parent)
    if runtime == "apptainer":
        return ["apptainer", "exec", "--bind", f"{root}:{root}", image, "launcher", *node_cmd]
    # docker: host networking for the rendezvous, an init that forwards signals, Slurm's variables passed on,
    # devices left to the container runtime (compose's settings do the same for one node)
    env = [
        "SLURM_JOB_ID",
        "SLURM_NODEID",
        "SLURM_JOB_NUM_NODES",
        "SLURM_JOB_NODELIST",
        "SLURM_RESTART_COUNT",
        "MASTER_ADDR",
        "MASTER_PORT",
    ]
    return [
        "docker",
        "run",
        "--rm",
        "--init",
        "--network",
        "host",
        "--ipc",
        "host",
        "--volume",
        f"{root}:{root}",
        *(x for name in env for x in ("--env", name)),
        image,
        "launcher",
        *node_cmd,
    ]


def batch_script(
    run_id: str,
    run_dir: Path,
    nodes: int,
    task: list[str],
    *,
    partition: str | None = None,
    time_limit: str | None = None,
    requeue: bool = False,
    grace_s: float,
    extra: tuple[str, ...] = (),
) -> str:
    """The sbatch script: one task per node, the rendezvous address from Slurm, the stop on a time limit."""
    sb = [
        f"--job-name={run_id}",
        f"--nodes={nodes}",
        "--ntasks-per-node=1",
        f"--output={run_dir / SLURM_OUT}",
        "--open-mode=append",
        f"--chdir={os.getcwd()}",
        "--requeue" if requeue else "--no-requeue",
    ]
    if partition:
        sb.append(f"--partition={partition}")
    if time_limit:
        sb.append(f"--time={time_limit}")
        sb.append(f"--signal=B:USR1@{int(grace_s + TIME_LIMIT_MARGIN_S)}")
    sb += list(extra)
    path = os.pathsep.join(p for p in (str(SOURCE_ROOT), os.environ.get("PYTHONPATH")) if p)
    stop = shlex.join([sys.executable, "-m", "launcher", "stop", str(run_dir)])
    lines = [
        "#!/bin/bash",
        f"# written by `launcher submit` for run {run_id}; the run folder: {run_dir}",
        *(f"#SBATCH {option}" for option in sb),
        "set -u",
        f"export PYTHONPATH={shlex.quote(path)}",
        "# the rendezvous: node 0 of the allocation (its NodeAddr), a port from the job id",
        'first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'addr=$(scontrol show node "$first" -o | grep -o "NodeAddr=[^ ]*" | cut -d= -f2)',
        "export MASTER_ADDR=${addr:-$first}",
        "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))",
        f'echo "slurm job $SLURM_JOB_ID (restart ${{SLURM_RESTART_COUNT:-0}}): {nodes} node(s) on '
        f'$SLURM_JOB_NODELIST, rendezvous $MASTER_ADDR:$MASTER_PORT"',
        "# the time limit (--signal=B:USR1@S): the same stop as `launcher stop`, a checkpoint saved on every node",
        f"stop_run() {{ {stop} & }}",
        "trap stop_run USR1",
        f"srun --nodes={nodes} --ntasks-per-node=1 --kill-on-bad-exit=0 {shlex.join(task)} &",
        "step=$!",
        'code=0; wait "$step" || code=$?',
        'while kill -0 "$step" 2>/dev/null; do wait "$step"; code=$?; done  # a trap interrupted the wait',
        'echo "slurm job $SLURM_JOB_ID: srun ended with $code"',
        'exit "$code"',
    ]
    return "\n".join(lines) + "\n"


# --- submit -----------------------------------------------------------------------------------------------


def submit(
    config: RunConfig,
    nodes: int,
    partition: str | None = None,
    time_limit: str | None = None,
    runtime: str = "host",
    image: str | None = None,
    extra: tuple[str, ...] = (),
) -> int:
    """``launcher submit``: the run folder, its PENDING record with the Slurm job, the batch script, sbatch."""
    from launcher.config.run_config import dump_yaml
    from launcher.run.lock import check_free
    from launcher.run.rundir import make_run_dir

    if nodes < 1:
        raise LauncherError(f"--nodes {nodes}: a run needs at least 1 node (e.g. --nodes 2)", ExitCode.USAGE)
    if runtime not in RUNTIMES:
        raise LauncherError(f"--runtime {runtime!r}: one of {', '.join(RUNTIMES)}", ExitCode.USAGE)
    task_command(runtime, image, config.launcher.output_root)  # its refusals before any folder exists
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise LauncherError(
            "no sbatch on this machine: `launcher submit` runs where Slurm's client commands do (a login node)",
            ExitCode.USAGE,
        )
    root = config.launcher.output_root
    check_free(root)  # node 0's launcher takes this lock: a live run here would refuse it
    run_dir = make_run_dir(root, config.run_name)
    path = run_dir.path
    shutil.copyfile(config.source, path / CONFIG_COPY)
    if config.overrides:
        (path / OVERRIDES_FILE).write_text(dump_yaml(config.overrides))
    task = task_command(runtime, image, path)
    launcher = config.launcher
    script = batch_script(
        run_dir.run_id,
        path,
        nodes,
        task,
        partition=partition,
        time_limit=time_limit,
        requeue=launcher.restart is not None,
        grace_s=launcher.stop_grace_s,
        extra=extra,
    )
    (path / SBATCH_SCRIPT).write_text(script)
    slurm: dict[str, Any] = {
        "nodes": nodes,
        "partition": partition,
        "time": time_limit,
        "runtime": runtime,
        "image": image,
        "script": SBATCH_SCRIPT,
        "job_id": None,
    }
    store = RunStore.create(path, run_dir.run_id)
    store.transition(
        RunState.PENDING,
        event=None,
        run_dir=str(path),
        stop_grace_s=launcher.stop_grace_s,
        slurm=slurm,
        node={"nnodes": nodes},
    )
    done = subprocess.run(
        [sbatch, "--parsable", str(path / SBATCH_SCRIPT)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip()
        store.record_end(RunState.FAILED_SETUP, reason=f"sbatch refused the job: {why}", processes=[])
        raise LauncherError(f"sbatch refused the job ({why}); the script is {path / SBATCH_SCRIPT}", ExitCode.FAILED)
    job_id = done.stdout.strip().split(";")[0]
    store.save(slurm={**slurm, "job_id": job_id})
    store.event("submitted", job_id=job_id, nodes=nodes, partition=partition, runtime=runtime)
    print(
        f"submitted run {run_dir.run_id} as Slurm job {job_id} ({nodes} node(s), runtime {runtime})\n"
        f"  run dir:     {path}\n  batch:       {path / SBATCH_SCRIPT}\n  slurm out:   {path / SLURM_OUT}\n"
        f"follow it with:\n  launcher status {path} --watch\n  launcher logs {path} -f\n"
        f"stop it with:\n  launcher stop {path}"
    )
    return ExitCode.OK


# --- each node ------------------------------------------------------------------------------------------


def node_root(run_dir: Path, node_rank: int) -> Path:
    """Node ``node_rank`` >= 1's runs folder inside the run folder."""
    return run_dir / NODES_DIR / NODE_ROOT.format(node=node_rank)


def node_run_dirs(run_dir: Path) -> list[Path]:
    """The run folders of nodes 1.. of this run (every attempt's)."""
    nodes = run_dir / NODES_DIR
    folders = sorted(nodes.glob(NODE_ROOT.format(node="*"))) if nodes.is_dir() else []
    return [run for folder in folders for run in list_runs(folder)]


# --- stop -------------------------------------------------------------------------------------------------


class SlurmPlacement(Placement):
    """A run submitted to Slurm (``launcher submit``): its processes live on the job's nodes; liveness, stop and
    a lost node come from Slurm."""

    kind = "slurm"

    @staticmethod
    def holds(record: RunRecord) -> bool:
        return bool((record.slurm or {}).get("job_id"))

    @classmethod
    def start(cls, config: RunConfig, **options: Any) -> int:
        """``launcher submit``: ``nodes``, ``partition``, ``time_limit``, ``runtime``, ``image``, ``extra``."""
        return submit(config, **options)

    @property
    def job_id(self) -> str:
        return str((self.record.slurm or {}).get("job_id"))

    def where(self) -> str:
        return f"Slurm job {self.job_id}"

    def reconcile(self, run_dir: Path) -> Reconciled:
        """Liveness from Slurm. A job Slurm ended (or forgot) while the record says live: ``NODE_LOST`` when Slurm
        says a node failed, else ``SUPERVISOR_LOST`` (node 0's launcher ended without recording an end)."""
        record = self.record
        view = query_job(self.job_id)  # shown by `launcher status` in its own row
        result = Reconciled(record.state, record.state, liveness="live", slurm_view=view)
        if view.live is None:
            result.liveness = "unknown"
            result.note = f"Slurm {view.describe()}"
        elif view.live:
            pass  # queued or running: the record says how far the run is
        elif not record.terminal:
            result.liveness = "gone"
            result.state = RunState.NODE_LOST if view.state == "NODE_FAIL" else RunState.SUPERVISOR_LOST
            result.note = f"Slurm {view.describe()}, and the run recorded no end"
        else:
            result.liveness = "gone"
        return result

    def status_fields(self, seen: Reconciled) -> dict[str, Any]:
        view = seen.slurm_view
        return {
            "slurm_state": None if view is None else view.state,
            "slurm_status": None if view is None else view.describe(),
        }

    def lost_node(self, node_rank: int) -> str | None:
        """Node 0 asks Slurm whether the job lost a node (``state/slurmjob.py``: ``lost_node``)."""
        return lost_node(self.job_id, os.environ.get("SLURM_JOB_NODELIST")) if node_rank == 0 else None

    def resume(self, run_dir: Path, plan: Any, adapter_only: bool, in_process: Supervise | None) -> int:
        """A Slurm run continues through Slurm, never on the machine that asks: Slurm's requeue does it by itself
        with ``launcher.restart``; by hand, a new job of the run's config from the checkpoint."""
        nodes = (self.record.slurm or {}).get("nodes") or 1
        command = shlex.join(
            [
                "launcher",
                "submit",
                str(run_dir / CONFIG_COPY),
                "--nodes",
                str(nodes),
                f"resume_from_checkpoint={plan.checkpoint}",
            ]
        )
        raise LauncherError(
            f"run {self.record.run_id} is {self.where()}: it resumes through Slurm, not on this machine, and "
            f"nothing was started. Slurm requeues it by itself with launcher.restart; to continue it by hand "
            f"from {plan.checkpoint} (step {plan.step}), submit a new job: {command}",
            ExitCode.USAGE,
        )

    def _stop(self, run_dir: Path, store: RunStore, seen: Reconciled, ask: StopAsk) -> int:
        """Cancel a queued job; else the stop request on every node, then wait for node 0's record, and
        ``scancel`` only after the grace."""
        record, job_id, by = self.record, self.job_id, ask.by
        view = seen.slurm_view or query_job(job_id)
        scancel = shutil.which("scancel")
        if view.live is None or scancel is None:
            raise LauncherError(
                f"run {record.run_id} is Slurm job {job_id}, and Slurm does not answer here "
                f"({view.describe()}); nothing was stopped",
                ExitCode.FAILED,
            )
        if not view.live:
            if not record.terminal:
                store.record_end(
                    RunState.NODE_LOST if view.state == "NODE_FAIL" else RunState.SUPERVISOR_LOST,
                    reason=f"Slurm {view.describe()}, and the run recorded no end; recorded by {by}",
                    processes=[],
                )
            print(f"run {record.run_id}: Slurm {view.describe()}; nothing to stop; recorded {store.state.value}")
            return ExitCode.OK
        if record.state is RunState.PENDING and record.supervisor is None:  # still in the queue: nothing started
            subprocess.run([scancel, job_id], check=False)
            store.record_end(
                RunState.CANCELLED,
                stopped_by=by,
                processes=[],
                reason=f"cancelled by {by} while Slurm {view.describe()} (scancel {job_id})",
            )
            print(f"run {record.run_id}: Slurm job {job_id} cancelled in the queue; recorded CANCELLED")
            return ExitCode.OK
        by = f"{by} through Slurm (job {job_id})"
        for folder in (run_dir, *node_run_dirs(run_dir)):
            request_stop(folder, ask.given, by=by, now=ask.now)
        what = stop_promise(run_dir, record, ask.now)
        limit = ask.grace + END_MARGIN_S
        print(
            f"stopping run {record.run_id} (Slurm job {job_id}): stop requested on every node ({what}); "
            f"scancel after {limit:.0f} s",
            flush=True,
        )
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            ended = _ended(run_dir)
            if ended is not None:
                print(stopped_line(ended))
                return ExitCode.OK
            time.sleep(0.5)
        subprocess.run([scancel, job_id], check=False)
        saved = saved_checkpoint(run_dir, read_saved(run_dir))
        if not (now_record := read_record(run_dir)).terminal:
            store = RunStore.open(run_dir)
            store.record_end(
                RunState.CANCELLED,
                stopped_by=by,
                saved_checkpoint=saved,
                processes=[],
                reason=f"not ended {limit:.0f} s after the stop request: scancel {job_id}",
            )
        print(
            f"run {now_record.run_id}: not ended after {limit:.0f} s; scancel {job_id}; recorded "
            f"{read_record(run_dir).state.value}"
        )
        return ExitCode.FAILED


def stop_promise(run_dir: Path, record: RunRecord, now: bool) -> str:
    """What a stop request makes of a running Slurm run: a save needs every node's training to have begun in this
    attempt, else a node's supervisor stops its job without one (``state.stop.job_can_save``). The ranks' pids live
    on the nodes, so here only the announcements are read: node 0's in the run folder, node N's in its newest
    ``nodes/nodeN/`` run folder, each counted when made after this attempt started."""
    if now:
        return "no save"
    since = parse_time(record.started).timestamp() if record.started else 0.0
    waiting = []
    for node in range(int((record.slurm or {}).get("nodes") or 1)):
        folders = [run_dir] if node == 0 else list_runs(run_dir / NODES_DIR / NODE_ROOT.format(node=node))[-1:]
        if not any((announced_at(folder) or 0.0) >= since for folder in folders):
            waiting.append(str(node))
    if not waiting:
        return "a checkpoint at the next step, then exit"
    return f"no save: training has not begun on node {', '.join(waiting)} (no save-on-stop announcement there yet)"


def _ended(run_dir: Path):
    try:
        record = read_record(run_dir)
    except RecordUnreadable:
        return None
    return record if record.terminal else None
