"""Find a run directory from what a user typed, and read the run's own record files (host side).

Host-side verbs (``verify``, ``report``, ``status``) take ``RUN``: a run directory path, or a run id
under the runs root (``outputs/runs`` unless ``--root`` says otherwise). Nothing here needs torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .records import STATUS_FILE, read_status
from .rundir import LF_YAML, OUTPUT_SUBDIR

DEFAULT_RUNS_ROOT = Path("outputs/runs")
_RUN_MARKERS = (STATUS_FILE, LF_YAML, OUTPUT_SUBDIR)


class RunNotFound(ValueError):
    """``RUN`` names no run directory; the message says where it looked and what exists."""


def resolve_run_dir(run: str | Path, root: Path = DEFAULT_RUNS_ROOT) -> Path:
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
    recent = recent_run_ids(root)
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
    recent = recent_run_ids(root, limit=1)
    if not recent:
        raise RunNotFound(f"no runs under {root} (pass a run directory, or --root DIR pointing at the runs folder)")
    return (root / recent[0]).resolve()


def run_dir_for(run: str | Path | None, root: Path = DEFAULT_RUNS_ROOT) -> Path:
    """The run directory a verb's RUN argument names, or the newest run under ``root`` when it is None.

    Raises:
        RunNotFound: as ``resolve_run_dir`` and ``newest_run_dir``.
    """
    return resolve_run_dir(run, root) if run else newest_run_dir(root)


def recent_run_ids(root: Path, limit: int = 5) -> list[str]:
    """The newest run ids under ``root`` (by modification time), newest first."""
    try:
        runs = [p for p in root.iterdir() if p.is_dir() and (p / STATUS_FILE).exists()]
    except OSError:
        return []
    runs.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    return [p.name for p in runs[:limit]]


@dataclass
class RunFiles:
    """What a run directory records about itself; ``problems`` lists files that could not be read."""

    path: Path
    lf_args: dict[str, Any] = field(default_factory=dict)
    status: dict[str, Any] | None = None
    manifest: dict[str, Any] | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def run_id(self) -> str:
        return str((self.status or {}).get("run_id") or self.path.name)

    @property
    def output(self) -> Path:
        return self.path / OUTPUT_SUBDIR


def load_run_files(run_dir: Path) -> RunFiles:
    """Read the LLaMA-Factory YAML the job used, ``status.json`` and ``manifest.json``; never raises."""
    files = RunFiles(path=run_dir)
    launch = read_json_object(run_dir / "launch.json")
    # a resumed run writes llamafactory.attemptN.yaml; launch.json names the latest attempt's file
    lf_name = launch.get("llamafactory_yaml") if isinstance(launch, dict) else None
    lf = read_yaml_mapping(run_dir / str(lf_name or LF_YAML))
    if isinstance(lf, str):
        files.problems.append(lf)
    else:
        files.lf_args = lf
    try:
        files.status = read_status(run_dir)
    except ValueError as err:
        files.problems.append(str(err))
    manifest = read_json_object(run_dir / "manifest.json")
    if isinstance(manifest, str):
        files.problems.append(manifest)
    else:
        files.manifest = manifest
    return files


def read_yaml_mapping(path: Path) -> dict[str, Any] | str:
    """The YAML mapping in ``path``, or a one-line problem description."""
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        return f"{path} is missing"
    except (OSError, yaml.YAMLError) as err:
        return f"{path} is unreadable ({err})"
    return data if isinstance(data, dict) else f"{path} does not hold a mapping"


def read_json_object(path: Path) -> dict[str, Any] | str:
    """The JSON object in ``path``, or a one-line problem description."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return f"{path} is missing"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return f"{path} is unreadable ({err})"
    return data if isinstance(data, dict) else f"{path} does not hold a JSON object"


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
