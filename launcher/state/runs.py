"""Find a run directory from what a user typed, list runs, and read a run's own record files (host side).

Host-side verbs (``status``, ``logs``, ``stop``, ``verify``, ``report``) take ``RUN``: a run directory
path, or a run id under the runs root: ``--root``, else ``$LAUNCHER_ROOT``, else ``outputs/runs``.
Nothing here needs torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.errors import ExitCode, LauncherError
from launcher.files import read_json_object, read_yaml_mapping
from launcher.state.record import STATUS_FILE, RecordUnreadable, RunRecord, read_record

ROOT_ENV = "LAUNCHER_ROOT"
DEFAULT_RUNS_ROOT = Path("outputs/runs")
OUTPUT_SUBDIR = "output"
LF_YAML = "llamafactory.yaml"
LAUNCH_FILE = "launch.json"
JOB_LOG = "launcher.log"  # everything the job printed
SUPERVISOR_LOG = "supervisor.log"  # what a detached supervisor printed (preflight, refusals, its end line)
ERRORS_DIR = "errors"  # errors/rank<N>.json: the traceback of each rank that raised
PROFILE_DIR = "profile"  # profile/rank<N>.json and traces: `launcher profile` (profiling.py, results/profile_report.py)
# save on stop (launcher/stopsave.py in the ranks, run/supervisor.py): the supervisor asks, the ranks answer
STOP_REQUEST = "stop_request.json"  # written by `launcher stop`: who, the grace, `now` (no save: ranks die at SIGTERM)
SAVE_REQUEST = "save_request.json"  # written by the supervisor: save a checkpoint at the next step, then exit
SAVE_READY = "save_on_stop.json"  # written by local rank 0 once training began: this job honours a request
SAVE_DONE = "stop_saved.json"  # written by local rank 0 after the requested checkpoint is complete
_RUN_MARKERS = (STATUS_FILE, LF_YAML, OUTPUT_SUBDIR)


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


@dataclass
class RunFiles:
    """What a run directory records about itself; ``problems`` lists files that could not be read."""

    path: Path
    lf_args: dict[str, Any] = field(default_factory=dict)
    status: RunRecord | None = None
    manifest: dict[str, Any] | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def run_id(self) -> str:
        return self.status.run_id if self.status is not None else self.path.name

    @property
    def output(self) -> Path:
        return self.path / OUTPUT_SUBDIR


def load_run_files(run_dir: Path) -> RunFiles:
    """Read the LLaMA-Factory YAML the job used, ``status.json`` and ``manifest.json``; never raises."""
    files = RunFiles(path=run_dir)
    launch = read_json_object(run_dir / LAUNCH_FILE)
    # a resumed run writes llamafactory.attemptN.yaml; launch.json names the latest attempt's file
    lf_name = launch.get("llamafactory_yaml") if isinstance(launch, dict) else None
    lf = read_yaml_mapping(run_dir / str(lf_name or LF_YAML))
    if isinstance(lf, str):
        files.problems.append(lf)
    else:
        files.lf_args = lf
    try:
        files.status = read_record(run_dir)
    except RecordUnreadable as err:
        files.problems.append(str(err))
    manifest = read_json_object(run_dir / "manifest.json")
    if isinstance(manifest, str):
        files.problems.append(manifest)
    else:
        files.manifest = manifest
    return files


def eval_configured(lf_args: dict[str, Any]) -> bool:
    """Whether the run evaluates: HF's TrainingArguments turns ``do_eval`` on for any eval strategy."""
    strategy = str(lf_args.get("eval_strategy") or "no").lower()
    return bool(lf_args.get("do_eval")) or strategy != "no"


def eval_dataset_names(lf_args: dict[str, Any]) -> list[str]:
    value = lf_args.get("eval_dataset") or ""
    items = value if isinstance(value, list) else str(value).split(",")
    return [str(v).strip() for v in items if str(v).strip()]


def selection_metric_name(lf_args: dict[str, Any]) -> str | None:
    """The metric HF's Trainer selects (and early-stops) on, with its ``eval_`` prefix, if set."""
    metric = lf_args.get("metric_for_best_model")
    if not metric and lf_args.get("load_best_model_at_end"):
        metric = "loss"  # TrainingArguments' default when load_best_model_at_end is on
    if not metric:
        return None
    metric = str(metric)
    return metric if metric.startswith("eval_") else f"eval_{metric}"
