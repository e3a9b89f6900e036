"""Loss curves of a run, the best evaluation, and an overfitting verdict (host side, no torch).

Sources, both written by the training job into the output folder:

- ``trainer_log.jsonl`` (LLaMA-Factory): training ``loss`` and ``eval_loss`` per step; it is
  written live, so it also covers a run that died before saving its state.
- ``trainer_state.json`` (HF Trainer, final copy or the newest checkpoint's): ``log_history``. With
  ``eval_on_each_dataset: true`` the Trainer logs one metric per eval dataset,
  ``eval_<name>_loss``, which LLaMA-Factory's log drops, so those come from here.

A step logged twice (a resumed run re-logs the steps after its checkpoint) keeps its newest value.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.files import Unreadable, read_json_bounded
from launcher.state.checkpoints import scan_checkpoints
from launcher.state.runs import TRAINER_LOG, TRAINER_STATE
from launcher.state.trainer_log import iter_trainer_log

DEFAULT_OVERFIT_PATIENCE = 3
_EVAL_LOSS_KEY = re.compile(r"^eval_(?:.+_)?loss$")


@dataclass(frozen=True)
class Point:
    step: int
    value: float


@dataclass
class Curves:
    """Training loss and every eval loss metric, each sorted by step."""

    train: list[Point] = field(default_factory=list)
    evals: dict[str, list[Point]] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)


# a Trainer state logs every step and evaluation: about 200 bytes each, so 256 MiB is over a million of them
TRAINER_STATE_MAX_BYTES = 256 << 20


def read_trainer_state(output_dir: Path) -> tuple[dict[str, Any] | None, Path | None]:
    """The final ``trainer_state.json``, else the one of the newest checkpoint; ``(None, None)`` if none."""
    checkpoints, _ = scan_checkpoints(output_dir)
    candidates = [output_dir / TRAINER_STATE] + [c.path / TRAINER_STATE for c in reversed(checkpoints)]
    for path in candidates:
        try:  # bounded: a damaged or planted file is skipped like a missing one
            data = read_json_bounded(path, max_bytes=TRAINER_STATE_MAX_BYTES)
        except (FileNotFoundError, Unreadable):
            continue
        if isinstance(data, dict):
            return data, path
    return None, None


def load_curves(output_dir: Path) -> Curves:
    """Collect the curves of the run whose LLaMA-Factory output folder is ``output_dir``."""
    series: dict[str, dict[int, float]] = {}
    curves = Curves()

    def _add(metric: str, step: Any, value: Any, overwrite: bool) -> None:
        if not isinstance(step, int) or not isinstance(value, int | float):
            return
        points = series.setdefault(metric, {})
        if overwrite or step not in points:
            points[step] = float(value)

    log_path = output_dir / TRAINER_LOG
    for record in iter_trainer_log(log_path):
        step = record.get("current_steps")
        if "loss" in record:
            _add("loss", step, record["loss"], overwrite=True)
        if "eval_loss" in record:
            _add("eval_loss", step, record["eval_loss"], overwrite=True)
    if series:
        curves.sources.append(str(log_path))
    state, state_path = read_trainer_state(output_dir)
    for entry in (state or {}).get("log_history") or []:
        if not isinstance(entry, dict):
            continue
        for key, value in entry.items():
            if key == "loss" or _EVAL_LOSS_KEY.match(key):
                _add(key, entry.get("step"), value, overwrite=False)
    if state_path is not None:
        curves.sources.append(str(state_path))
    curves.train = [Point(s, v) for s, v in sorted(series.pop("loss", {}).items())]
    curves.evals = {m: [Point(s, v) for s, v in sorted(pts.items())] for m, pts in sorted(series.items())}
    return curves


def best_point(points: list[Point]) -> Point | None:
    """The lowest finite value; the earliest step wins a tie (as HF's best-model tracking does)."""
    best = None
    for p in points:
        if math.isfinite(p.value) and (best is None or p.value < best.value):
            best = p
    return best


@dataclass(frozen=True)
class OverfitVerdict:
    """``status``: ``overfitting``, ``no``, ``not-yet``, ``eval-worse-train-flat`` or ``unknown``."""

    status: str
    message: str
    evals_after_best: int = 0

    @property
    def overfitting(self) -> bool:
        return self.status == "overfitting"

    @property
    def label(self) -> str:
        return {
            "overfitting": "overfitting",
            "no": "no overfitting",
            "not-yet": "not overfitting yet",
            "eval-worse-train-flat": "eval loss worse, training loss flat",
        }.get(self.status, "overfitting unknown")


def _mean_train(train: list[Point], after: int, upto: int) -> float | None:
    """Mean training loss over steps in (after, upto]; the last point at or before ``upto`` if none."""
    window = [p.value for p in train if after < p.step <= upto and math.isfinite(p.value)]
    if not window:
        window = [p.value for p in train if p.step <= upto and math.isfinite(p.value)][-1:]
    return sum(window) / len(window) if window else None


def overfitting_verdict(
    train: list[Point], evals: list[Point], patience: int = DEFAULT_OVERFIT_PATIENCE
) -> OverfitVerdict:
    """Judge overfitting: eval loss above its best for ``patience`` evaluations after the best, while
    the training loss keeps falling.

    Training loss is compared as the mean over the evaluation interval that ends at the best step
    against the mean over the last evaluation interval, so one noisy batch does not decide it.
    """
    points = [p for p in evals if math.isfinite(p.value)]
    if len(points) < 2:
        return OverfitVerdict("unknown", f"cannot judge: {len(points)} evaluation(s); at least 2 are needed")
    best = best_point(points)
    assert best is not None
    after = [p for p in points if p.step > best.step]
    if not after:
        return OverfitVerdict("no", f"no: the last evaluation (step {best.step}) is the best so far")
    last = after[-1]
    rise = (last.value - best.value) / abs(best.value) * 100 if best.value else math.inf
    before_best = [p.step for p in points if p.step < best.step]
    train_at_best = _mean_train(train, before_best[-1] if before_best else -1, best.step)
    previous = points[-2].step
    train_at_end = _mean_train(train, previous, last.step)
    n = len(after)
    eval_part = (
        f"eval loss has not improved for {n} evaluation(s) after its best at step {best.step} "
        f"({best.value:.4f} -> {last.value:.4f} at step {last.step}, {rise:+.1f}%)"
    )
    if n < patience:
        return OverfitVerdict("not-yet", f"not yet: {eval_part}; {patience} are needed to call it", n)
    if train_at_best is None or train_at_end is None:
        return OverfitVerdict("unknown", f"cannot judge: {eval_part}, but no training loss was logged", n)
    train_part = f"training loss {train_at_best:.4f} -> {train_at_end:.4f}"
    if train_at_end < train_at_best:
        return OverfitVerdict("overfitting", f"overfitting: {eval_part} while {train_part} kept falling", n)
    return OverfitVerdict(
        "eval-worse-train-flat",
        f"not the overfitting pattern: {eval_part}, but {train_part} did not fall (check the learning rate "
        "and the data)",
        n,
    )
