"""Read a run's own record files in one go (host side): the LLaMA-Factory YAML the job used, the run record and
the manifest (typed: ``Launch``, ``Manifest``), and what the YAML says about evaluation. The names come from the
map, ``launcher.state.runs``.

Nothing here needs torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from launcher.files import read_optional, read_yaml_mapping
from launcher.state.record import RecordUnreadable, RunRecord, read_record
from launcher.state.runs import LAUNCH_FILE, LF_YAML, MANIFEST_FILE, OUTPUT_SUBDIR

# launch.json and manifest.json hold a few KB and nest 4 levels; past these bounds one is damaged or planted
SIDE_RECORD_MAX_BYTES = 4 << 20
SIDE_RECORD_MAX_DEPTH = 16


@dataclass(frozen=True)
class Launch:
    """``launch.json`` (run/rundir.py): what each rank's entry reads; keys not declared here are ignored."""

    patches: dict[str, dict[str, Any]] = field(default_factory=dict)
    backend: str = "cpu"
    llamafactory_yaml: str | None = None  # this attempt's LLaMA-Factory YAML (a resume writes its own)
    attempt: int = 1
    log_examples: bool | None = None
    facts: dict[str, Any] = field(default_factory=dict)
    profile: dict[str, Any] | None = None
    memory_history_steps: int | None = None


class ModelPrint(TypedDict, total=False):
    path: str
    present: bool


class DataFile(TypedDict, total=False):
    file: str
    sha256: str


class DataPrint(TypedDict, total=False):
    dataset_dir: str
    files: dict[str, DataFile]


@dataclass(frozen=True)
class Manifest:
    """``manifest.json`` (run/rundir.py), the parts the readers use: the model's and the data's fingerprints, and the
    environment levers the job got (config/tuning.py: variable -> ``{"value": ..., "from": ...}``)."""

    model: ModelPrint = field(default_factory=dict)  # type: ignore[assignment]
    data: DataPrint = field(default_factory=dict)  # type: ignore[assignment]
    tuning: dict[str, dict[str, str]] = field(default_factory=dict)


def read_launch(run_dir: Path) -> tuple[Launch | None, str | None]:
    """``launch.json`` (None when missing), and ``unreadable: PATH (why)`` when it cannot be read."""
    return read_optional(run_dir / LAUNCH_FILE, Launch, SIDE_RECORD_MAX_BYTES, SIDE_RECORD_MAX_DEPTH)


@dataclass
class RunFiles:
    """What a run directory records about itself; ``problems`` lists files that could not be read."""

    path: Path
    lf_args: dict[str, Any] = field(default_factory=dict)
    status: RunRecord | None = None
    manifest: Manifest | None = None
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
    launch, problem = read_launch(run_dir)
    if problem:
        files.problems.append(problem)
    # a resumed run writes llamafactory.attemptN.yaml; launch.json names the latest attempt's file
    lf = read_yaml_mapping(run_dir / ((launch and launch.llamafactory_yaml) or LF_YAML))
    if isinstance(lf, str):
        files.problems.append(lf)
    else:
        files.lf_args = lf
    try:
        files.status = read_record(run_dir)
    except RecordUnreadable as err:
        files.problems.append(str(err))
    files.manifest, problem = read_optional(
        run_dir / MANIFEST_FILE, Manifest, SIDE_RECORD_MAX_BYTES, SIDE_RECORD_MAX_DEPTH
    )
    if problem or files.manifest is None:
        files.problems.append(problem or f"{run_dir / MANIFEST_FILE} is missing")
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
