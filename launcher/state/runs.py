"""The map of a run folder, and finding run folders from what a user typed (host side).

Every file and subfolder name the launcher writes into or reads from a run directory is declared here, once,
with who writes it and what it holds; every other module (``patches/`` too) takes the name from here. Names
that LLaMA-Factory, the HF Trainer or PEFT choose are here as well, marked so: the launcher only reads them
(and the tools name them the same in every release it supports). A name with ``{rank}``, ``{step}`` or
``{patch}`` is a pattern: ``ERROR_RECORD.format(rank=3)``, and ``format(rank="*")`` for a glob. The README's
run-directory table is the one prose map of these names; tests/test_run_folder_map.py fails when it lists one
more or one less, or when another module spells one of them itself.

Host-side verbs (``status``, ``logs``, ``stop``, ``verify``, ``report``) take ``RUN``: a run directory
path, or a run id under the runs root: ``--root``, else ``$LAUNCHER_ROOT``, else ``outputs/runs``.
Nothing here needs torch, and nothing here imports another ``launcher.state`` module.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from launcher.errors import ExitCode, LauncherError

ROOT_ENV = "LAUNCHER_ROOT"
DEFAULT_RUNS_ROOT = Path("outputs/runs")

# --- the run folder: <output_root>/<run_id>/ ---
# made by run/rundir.py when the run folder is created (a resumed attempt N >= 2 adds its own files, attempt_name)
CONFIG_COPY = "config.yaml"  # run/rundir.py: the run config exactly as given; resume loads it again
OVERRIDES_FILE = "overrides.yaml"  # run/rundir.py, only when KEY=VALUE overrides were given: them; resume applies them
LF_YAML = "llamafactory.yaml"  # run/rundir.py: the exact LLaMA-Factory arguments the job used (launch.json names it)
ACCELERATE_YAML = "accelerate.yaml"  # run/rundir.py, fsdp2 only: the accelerate/FSDP2 config run/job.py passes on
LAUNCH_FILE = "launch.json"  # run/rundir.py: what each rank's entry reads: patches, backend, this attempt's YAML, facts
MANIFEST_FILE = "manifest.json"  # run/rundir.py: package versions, git commit, image, config/data/model hashes, command
# the run record: state/record.py's RunStore is the one writer of both
STATUS_FILE = "status.json"  # state/record.py: the run record (state, attempt, exit, reason, processes), atomic
EVENTS_FILE = "events.jsonl"  # state/record.py: append-only events: created, preflight, started, states, ended
RESERVE_FILE = ".record-reserve"  # state/record.py: space kept for the end record on a full disk (RunStore.reserve)
# the supervisor before the job (run/supervisor.py)
PREFLIGHT_FILE = "preflight.json"  # run/supervisor.py (checks/preflight.py): the preflight table
DATA_STATS = "data_stats.json"  # run/supervisor.py (data/statsview.py): the token statistics preflight measured
# logs
JOB_LOG = "launcher.log"  # everything the job printed (run/job.py; `launcher logs` shows it)
SUPERVISOR_LOG = "supervisor.log"  # what a detached supervisor printed (preflight, refusals, its end line)
# written by the ranks (rank/: entry.py, oomtrack.py, profiling.py; patches/)
ERRORS_DIR = "errors"  # errors/rank<N>.json: the traceback of each rank that raised
ERROR_RECORD = "rank{rank}.json"  # in ERRORS_DIR, by rank/entry.py: a rank's exception and traceback (rootcause)
PROOF_DIR = "proof"  # proof/rank<N>/<patch>.json: patches/core/proof.py, per rank and patch, the proof it took effect
PROOF_RANK = "rank{rank}"  # in PROOF_DIR: one rank's folder of proof records (patches/core/proof.py)
PROOF_FILE = "{patch}.json"  # in PROOF_RANK: one patch's proof record on that rank (patches/core/proof.py)
MEMORY_SNAPSHOT = "memory_snapshot_rank{rank}.pickle"  # rank/oomtrack.py (memory_history_steps): the allocator on OOM
PROFILE_DIR = "profile"  # `launcher profile`: rank/profiling.py writes, results/profile_report.py reads
PROFILE_RECORD = "rank{rank}.json"  # in PROFILE_DIR, by rank/profiling.py: one rank's measured steps and their parts
PROFILE_TRACE = "rank{rank}.trace.json"  # in PROFILE_DIR, by rank/profiling.py on cpu/cuda: the chrome trace
PROFILE_ASCEND = "rank{rank}.ascend"  # in PROFILE_DIR, by rank/profiling.py on npu: the Ascend profiler's folder
# save on stop (launcher/rank/stopsave.py in the ranks, run/supervisor.py): the supervisor asks, the ranks answer
STOP_REQUEST = "stop_request.json"  # written by `launcher stop`: who, the grace, `now` (no save: ranks die at SIGTERM)
SAVE_REQUEST = "save_request.json"  # written by the supervisor: save a checkpoint at the next step, then exit
SAVE_READY = "save_on_stop.json"  # written by local rank 0 once training began: this job honours a request
SAVE_DONE = "stop_saved.json"  # written by local rank 0 after the requested checkpoint is complete
# a run submitted to Slurm (run/placement/slurm.py, `launcher submit`): one run folder on shared storage, node 0's
SBATCH_SCRIPT = "slurm.sbatch"  # run/placement/slurm.py: the batch script `launcher submit` wrote and handed to sbatch
SLURM_OUT = "slurm.out"  # the batch job's output (sbatch --output): the script's and srun's lines, every node's
NODES_DIR = "nodes"  # nodes/node<N>/: the runs folder of node N >= 1's own launcher (its record, lock and job log)
NODE_ROOT = "node{node}"  # in NODES_DIR: one node's runs folder (run/slurm_node.py)
# written by the host-side verbs after the run
VERIFY_FILE = "verify.json"  # results/verify.py (`launcher verify`, and the supervisor at the end): the checklist
RECHECK_FILE = "verify.recheck.json"  # results/verify.py: a FAIL found after an earlier PASS (verify.json is kept)
REPORT_MD = "report.md"  # results/report.py (`launcher report`): model selection, curves, the verdict
REPORT_JSON = "report.json"  # results/report.py: the same as data
LOSS_PNG = "loss.png"  # results/report.py: the training and eval loss curves (matplotlib)
PROFILE_JSON = "profile.json"  # results/profile_report.py (`launcher profile`): the ranks' profiles side by side
PROFILE_MD = "profile.md"  # results/profile_report.py: the same as a table
EVALUATE_JSON = "evaluate.json"  # run/evaluate.py (`launcher evaluate`): test loss, answers, signals per checkpoint
EVALUATE_MD = "evaluate.md"  # run/evaluate.py (results/evaluate.py): the answers side by side
EVALUATE_LOG = "evaluate.log"  # run/evaluate.py: the child's whole output: library logs and counts, no generated text
EVALUATE_SCRATCH = ".evaluate-"  # run/evaluate.py: prefix of the evaluation's scratch folder, removed when it ends
EVALUATE_REQUEST = "request.json"  # in EVALUATE_SCRATCH, by run/evaluate.py: what rank/evaluate.py evaluates
EVALUATE_RESULT = "result.json"  # in EVALUATE_SCRATCH, by rank/evaluate.py: its raw results
# output/: LLaMA-Factory's output_dir; every name in it but BEST_ADAPTER_RECORD is the tools' own
OUTPUT_SUBDIR = "output"  # the output_dir run/supervisor.py gives LLaMA-Factory (RunConfig.llamafactory_args)
TRAINER_LOG = "trainer_log.jsonl"  # named by LLaMA-Factory (LogCallback): a line per logged step (state/trainer_log.py)
TRAINER_STATE = "trainer_state.json"  # named by the HF Trainer: step, log history, best checkpoint (checkpoints too)
ALL_RESULTS = "all_results.json"  # named by the HF Trainer (save_metrics): the final train and eval metrics
TRAIN_RESULTS = "train_results.json"  # named by the HF Trainer (save_metrics): the final train metrics
EVAL_RESULTS = "eval_results.json"  # named by the HF Trainer (save_metrics), with evaluation: the final eval metrics
ADAPTER_FILE = "adapter_model.safetensors"  # named by PEFT (SAFETENSORS_WEIGHTS_NAME): LoRA weights (checkpoints too)
ADAPTER_CONFIG = "adapter_config.json"  # named by PEFT (CONFIG_NAME): the LoRA config next to the weights
FULL_WEIGHTS = "model.safetensors"  # named by transformers: a full (not LoRA) checkpoint's weights
CHECKPOINT_FOLDER = "checkpoint-{step}"  # named by the HF Trainer: a checkpoint (state/checkpoints.py: when complete)
OPTIMIZER_STATE = "optimizer.pt"  # named by the HF Trainer, in a checkpoint without save_only_model: Adam's state
OPTIMIZER_STATE_FSDP = "optimizer.bin"  # named by accelerate (save_fsdp_optimizer): the same under FSDP
SCHEDULER_STATE = "scheduler.pt"  # named by the HF Trainer, next to the optimizer state: the learning-rate schedule
BEST_ADAPTER_RECORD = "best_adapter.json"  # results/best_adapter.py, fsdp2 early stopping: which checkpoint's adapter
_RUN_MARKERS = (STATUS_FILE, LF_YAML, OUTPUT_SUBDIR)


def attempt_name(name: str, attempt: int) -> str:
    """``llamafactory.yaml`` for the first attempt, ``llamafactory.attempt2.yaml`` for the second..."""
    if attempt == 1:
        return name
    stem, dot, suffix = name.partition(".")
    return f"{stem}.attempt{attempt}{dot}{suffix}"


def default_root() -> Path:
    """The runs folder when no ``--root`` is given: ``$LAUNCHER_ROOT``, else ``outputs/runs``."""
    return Path(os.environ[ROOT_ENV]) if os.environ.get(ROOT_ENV) else DEFAULT_RUNS_ROOT


class RunNotFound(LauncherError):
    """``RUN`` names no run directory; the message says where it looked and what exists."""

    def __init__(self, message: str):
        super().__init__(message, ExitCode.USAGE)


def resolve_run_dir(run: str | Path, root: Path) -> Path:
    """The run directory ``run`` refers to: a path to one, or a run id under ``root``.

    Raises:
        RunNotFound: neither exists, or the folder is not a run directory.
    """
    given = Path(run)
    for candidate in (given, root / given):
        if candidate.is_dir():
            if not any((candidate / marker).exists() for marker in _RUN_MARKERS):
                raise RunNotFound(
                    f"{candidate} is not a run directory (it has none of {', '.join(_RUN_MARKERS)}); pass the "
                    f"folder `launcher run` printed as 'run dir', or a run id under {root}"
                )
            return candidate.resolve()
    recent = [p.name for p in list_runs(root)[::-1][:5]]
    hint = f"; recent runs under {root}: {', '.join(recent)}" if recent else f"; {root} holds no runs"
    raise RunNotFound(
        f"run {str(run)!r} not found: no such folder, and no {root / given} (pass a run directory, or a run "
        f"id with --root DIR pointing at the runs folder){hint}"
    )


def newest_run_dir(root: Path) -> Path:
    """The newest run directory under ``root``.

    Raises:
        RunNotFound: ``root`` holds no runs.
    """
    runs = list_runs(root)
    if not runs:
        raise RunNotFound(
            f"no runs under {root} (pass a run directory, --root DIR, or set {ROOT_ENV} to the runs folder)"
        )
    return runs[-1].resolve()


def run_dir_for(run: str | Path | None, root: Path | None = None) -> Path:
    """The run directory a verb's RUN argument names, or the newest run under ``root`` when it is None.

    Raises:
        RunNotFound: as ``resolve_run_dir`` and ``newest_run_dir``.
    """
    root = default_root() if root is None else root
    return resolve_run_dir(run, root) if run else newest_run_dir(root)


def unrecorded_runs(root: Path) -> list[Path]:
    """Folders under ``root`` that hold a run's files (its config copy, events or launch file) but no regular
    ``status.json`` (deleted, or something else in its place): ``launcher list`` names them rather than leave
    them out. Sorted by name."""
    try:
        folders = [p for p in root.iterdir() if p.is_dir() and not (p / STATUS_FILE).is_file()]
    except OSError:
        return []
    return sorted(p for p in folders if any((p / name).exists() for name in (CONFIG_COPY, EVENTS_FILE, LAUNCH_FILE)))


def host_command(verb: str, run_id: str, root: Path, *args: str) -> str:
    """``launcher VERB RUN_ID --root ROOT ...``, shell-quoted: a command that finds the run from any folder (the
    follow-up lines that ``start`` and ``resume`` print)."""
    return shlex.join(["launcher", verb, run_id, "--root", str(root), *args])


def follow_up(run_id: str, root: Path, *extra: str) -> str:
    """The lines ``start`` and ``resume`` print after a run began: follow it (``extra`` adds lines), stop it."""
    lines = [host_command("status", run_id, root, "--watch"), host_command("logs", run_id, root, "-f"), *extra]
    return (
        "follow it with:\n"
        + "".join(f"  {line}\n" for line in lines)
        + "stop it with:\n  "
        + host_command("stop", run_id, root)
    )


def list_runs(root: Path) -> list[Path]:
    """The run directories under ``root`` (folders with a ``status.json``), oldest first by record time."""
    try:
        runs = [p for p in root.iterdir() if p.is_dir() and (p / STATUS_FILE).is_file()]
    except OSError:
        return []

    def mtime(path: Path) -> float:
        try:
            return (path / STATUS_FILE).stat().st_mtime
        except OSError:
            return 0.0

    return sorted(runs, key=lambda p: (mtime(p), p.name))
