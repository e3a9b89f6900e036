"""Read a run's own record files in one go (host side): the LLaMA-Factory YAML the job used, the run record and
the manifest, and what the YAML says about evaluation. The names come from the map, ``launcher.state.runs``.

Nothing here needs torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.files import read_json_object, read_yaml_mapping
from launcher.state.record import RecordUnreadable, RunRecord, read_record
from launcher.state.runs import LAUNCH_FILE, LF_YAML, MANIFEST_FILE, OUTPUT_SUBDIR


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
    manifest = read_json_object(run_dir / MANIFEST_FILE)
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
