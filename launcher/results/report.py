"""Model selection for a run: ``launcher report RUN`` writes ``report.md`` and ``loss.png``.

Engineering success (``launcher verify``) and model quality are judged separately. The report shows:
training and eval loss curves; the best checkpoint by validation loss with its step; an overfitting
verdict (eval loss above its best for N evaluations while training loss keeps falling); a table of
checkpoints (step, eval loss, adapter size); and the recommended checkpoint.

Which split selects: the metric of early stopping / ``metric_for_best_model`` when set, else
``eval_loss``, else the first ``eval_dataset``. With ``eval_on_each_dataset: true`` and several eval
datasets, every other eval dataset is a held-out test split: it is reported in its own section and
never used for selection.

Host side: reads files only; matplotlib is imported lazily for the PNG; no torch.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.files import write_bytes_atomic, write_json_atomic, write_text_atomic
from launcher.results.best_adapter import read_kept_adapter
from launcher.results.curves import (
    DEFAULT_OVERFIT_PATIENCE,
    Curves,
    OverfitVerdict,
    Point,
    best_point,
    load_curves,
    overfitting_verdict,
    read_trainer_state,
)
from launcher.results.evaluate import read_evaluation, report_markdown, report_summary
from launcher.results.verify import never_trained, read_verdict
from launcher.state.checkpoints import scan_checkpoints
from launcher.state.record import now_iso
from launcher.state.runfiles import eval_dataset_names, load_run_files, selection_metric_name
from launcher.state.runs import (
    ADAPTER_FILE,
    LOSS_PNG,
    OUTPUT_SUBDIR,
    REPORT_JSON,
    REPORT_MD,
)


@dataclass
class CheckpointRow:
    name: str  # path relative to the run directory, e.g. output/checkpoint-500
    step: int
    adapter_bytes: int


@dataclass
class RunReport:
    run_dir: Path
    run_id: str
    state: str | None
    verify: str | None  # PASS / FAIL from verify.json, if it exists
    selection_metric: str | None
    best: Point | None
    test_metrics: list[str]
    verdict: OverfitVerdict
    checkpoints: list[CheckpointRow]
    ignored: list[str]
    recommended: str | None
    recommended_reason: str
    curves: Curves
    final_adapter_bytes: int | None = None
    final_note: str = ""  # what the final adapter is, e.g. "= checkpoint-500 (load_best_model_at_end)"
    notes: list[str] = field(default_factory=list)
    plot: Path | None = None
    created: str = field(default_factory=now_iso)
    evaluation: dict[str, Any] | None = None  # evaluate.json, when `launcher evaluate` has run

    def value_at(self, metric: str | None, step: int) -> float | None:
        for p in self.curves.evals.get(metric or "", []):
            if p.step == step:
                return p.value
        return None

    @property
    def best_checkpoint(self) -> str | None:
        if self.best is None:
            return None
        return next((c.name for c in self.checkpoints if c.step == self.best.step), None)

    def to_dict(self) -> dict[str, Any]:
        def _point(p: Point | None) -> dict[str, Any] | None:
            return None if p is None else {"step": p.step, "value": p.value}

        return {
            "run_id": self.run_id,
            "created": self.created,
            "selection_metric": self.selection_metric,
            "best": _point(self.best),
            "best_checkpoint": self.best_checkpoint,
            "overfitting": {"status": self.verdict.status, "message": self.verdict.message},
            "recommended": self.recommended,
            "recommended_reason": self.recommended_reason,
            "checkpoints": [
                {
                    "name": c.name,
                    "step": c.step,
                    "adapter_bytes": c.adapter_bytes,
                    "eval": {m: self.value_at(m, c.step) for m in [self.selection_metric, *self.test_metrics] if m},
                }
                for c in self.checkpoints
            ],
            "test": {m: {"best": _point(best_point(self.curves.evals.get(m, [])))} for m in self.test_metrics},
            "ignored": self.ignored,
            "notes": self.notes,
            "evaluation": None
            if self.evaluation is None
            else report_summary(self.evaluation, self.best_checkpoint, self.selection_metric),
        }


def _choose_selection_metric(lf_args: dict[str, Any], curves: Curves) -> tuple[str | None, list[str]]:
    metric = selection_metric_name(lf_args)
    if metric is None:
        if "eval_loss" in curves.evals:
            metric = "eval_loss"
        else:
            names = [f"eval_{n}_loss" for n in eval_dataset_names(lf_args)]
            metric = next((m for m in names if m in curves.evals), None) or next(iter(curves.evals), None)
    tests = [m for m in curves.evals if m != metric and m != "eval_loss"]
    return metric, tests


def build_report(run_dir: Path, patience: int | None = None, plot: bool = True, write: bool = True) -> RunReport:
    """Collect the curves and checkpoints of ``run_dir`` and (by default) write report.md and loss.png.

    Args:
        run_dir: The run directory.
        patience: Evaluations after the best that count as overfitting; defaults to the run's
            ``early_stopping_steps``, else 3.
        plot: Draw ``loss.png`` (needs matplotlib).
        write: Write ``report.md``, ``report.json`` and the plot into the run directory.
    """
    run_dir = Path(run_dir)
    files = load_run_files(run_dir)
    lf = files.lf_args
    curves = load_curves(files.output)
    metric, tests = _choose_selection_metric(lf, curves)
    evals = curves.evals.get(metric or "", [])
    patience = patience or int(lf.get("early_stopping_steps") or DEFAULT_OVERFIT_PATIENCE)
    found, ignored = scan_checkpoints(files.output)
    checkpoints = [CheckpointRow(c.relative_to(run_dir), c.step, c.weights_bytes) for c in found]
    verify, _ = read_verdict(run_dir)
    report = RunReport(
        run_dir=run_dir,
        run_id=files.run_id,
        state=files.status.state.value if files.status is not None else None,
        verify=None if verify is None else ("PASS" if verify.passed else "FAIL"),
        selection_metric=metric,
        best=best_point(evals),
        test_metrics=tests,
        verdict=overfitting_verdict(curves.train, evals, patience),
        checkpoints=checkpoints,
        ignored=ignored,
        recommended=None,
        recommended_reason="",
        curves=curves,
    )
    final = files.output / ADAPTER_FILE
    report.final_adapter_bytes = final.stat().st_size if final.is_file() else None
    report.evaluation = read_evaluation(run_dir)
    _recommend(report, lf, files.output)
    if not curves.train and not evals:
        report.notes.append(f"no loss was logged: {files.output}/trainer_log.jsonl and trainer_state.json are missing")
    if write:
        if plot and (curves.train or evals):
            report.plot = plot_curves(report, run_dir / LOSS_PNG)
        write_text_atomic(run_dir / REPORT_MD, render_markdown(report))
        write_json_atomic(run_dir / REPORT_JSON, report.to_dict())
    return report


def _recommend(report: RunReport, lf: dict[str, Any], output: Path) -> None:
    best, metric = report.best, report.selection_metric
    if not report.curves.train and (why := never_trained(lf)):  # nothing to select: say the one real cause
        report.recommended, report.recommended_reason = None, why
        return
    state, _ = read_trainer_state(output)
    loaded_best = bool(lf.get("load_best_model_at_end")) and (state or {}).get("best_model_checkpoint")
    kept, _ = read_kept_adapter(output)
    if kept is not None and kept.checkpoint:
        report.final_note = f"= {kept.checkpoint} (best adapter kept by the launcher)"
        report.notes.append(
            f"the final adapter in output/ is {kept.checkpoint}'s, copied by the launcher after "
            f"training (FSDP2; best {metric} {kept.metric}); eval_results.json is the last step's"
        )
    elif loaded_best:
        name = Path(str(state["best_model_checkpoint"])).name
        report.final_note = f"= {name} (load_best_model_at_end)"
        report.notes.append(
            f"load_best_model_at_end is on: the final adapter in output/ is {name} (the Trainer's best by "
            f"{metric}, {state.get('best_metric')})"
        )
    if best is None:
        if report.final_adapter_bytes is not None:
            report.recommended = OUTPUT_SUBDIR
        report.recommended_reason = "no evaluation was logged, so nothing is selected by eval loss; the final adapter"
        return
    at_best = report.best_checkpoint
    if at_best:
        report.recommended = at_best
        report.recommended_reason = f"lowest validation {metric}: {best.value:.4f} at step {best.step}"
        return
    scored = [(report.value_at(metric, c.step), c) for c in report.checkpoints]
    scored = [(v, c) for v, c in scored if v is not None and math.isfinite(v)]
    if scored:
        value, chosen = min(scored, key=lambda vc: (vc[0], vc[1].step))
        report.recommended = chosen.name
        report.recommended_reason = (
            f"the best evaluation (step {best.step}, {best.value:.4f}) has no saved checkpoint (save_steps not a "
            f"multiple of eval_steps, or removed by save_total_limit); this is the best saved one ({metric} "
            f"{value:.4f} at step {chosen.step})"
        )
    else:
        report.recommended = OUTPUT_SUBDIR if report.final_adapter_bytes is not None else None
        report.recommended_reason = (
            f"no saved checkpoint has an evaluation; the best evaluation was at step {best.step} (align save_steps "
            "with eval_steps to keep it)"
        )


def human_size(n_bytes: int | None) -> str:
    """``20990496`` -> ``20.0 MiB``."""
    if n_bytes is None:
        return "-"
    value = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n_bytes} B"


def _relative(path: Path, base: Path) -> str:
    return str(path.relative_to(base)) if path.is_relative_to(base) else str(path)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def render_markdown(report: RunReport) -> str:
    """The report as Markdown (what ``report.md`` holds)."""
    metric = report.selection_metric or "eval loss"
    lines = [f"# Run report: {report.run_id}", ""]
    verify = report.verify or "not run"
    lines.append(f"- Run state: {report.state or 'unknown'}; acceptance (`launcher verify`): {verify}")
    lines.append(f"- Selection metric: `{metric}` (validation split)")
    if report.best is not None:
        where = report.best_checkpoint or "no checkpoint saved at that step"
        lines.append(f"- Best checkpoint: step {report.best.step}, {metric} {report.best.value:.4f} ({where})")
    else:
        lines.append("- Best checkpoint: none (no evaluation logged)")
    lines.append(f"- Overfitting: {report.verdict.message}")
    lines.append(f"- **Recommended checkpoint: {report.recommended or 'none'}** ({report.recommended_reason})")
    lines.append("")
    if report.plot is not None:
        lines += [f"![training and eval loss]({report.plot.name})", ""]
    lines += ["## Checkpoints", "", f"| checkpoint | step | {metric} | adapter size | |", "|---|---:|---:|---:|---|"]
    for c in report.checkpoints:
        marks = []
        if report.best is not None and c.step == report.best.step:
            marks.append("best")
        if c.name == report.recommended:
            marks.append("recommended")
        value = _fmt(report.value_at(report.selection_metric, c.step))
        lines.append(f"| {c.name} | {c.step} | {value} | {human_size(c.adapter_bytes)} | {', '.join(marks)} |")
    if report.final_adapter_bytes is not None:
        mark = "recommended" if report.recommended == OUTPUT_SUBDIR else report.final_note
        lines.append(f"| output (final adapter) | - | - | {human_size(report.final_adapter_bytes)} | {mark} |")
    if not report.checkpoints:
        lines.append("| (no complete checkpoint) | | | | |")
    lines.append("")
    if report.test_metrics:
        lines += ["## Held-out test split (not used for selection)", ""]
        lines.append("| checkpoint | step | " + " | ".join(report.test_metrics) + " |")
        lines.append("|---|---:|" + "---:|" * len(report.test_metrics))
        for c in report.checkpoints:
            values = " | ".join(_fmt(report.value_at(m, c.step)) for m in report.test_metrics)
            lines.append(f"| {c.name} | {c.step} | {values} |")
        if report.recommended and report.recommended != OUTPUT_SUBDIR:
            step = next(c.step for c in report.checkpoints if c.name == report.recommended)
            values = ", ".join(f"{m} {_fmt(report.value_at(m, step))}" for m in report.test_metrics)
            lines.append("")
            lines.append(f"At the recommended checkpoint (step {step}): {values}.")
        lines.append("")
    if report.evaluation is not None:
        lines += report_markdown(report.evaluation, report.best_checkpoint, report.selection_metric)
    if report.ignored or report.notes:
        lines += ["## Notes", ""]
        lines += [f"- {note}" for note in report.notes]
        lines += [f"- ignored folder: {item}" for item in report.ignored]
        lines.append("")
    sources = ", ".join(_relative(Path(p), report.run_dir) for p in report.curves.sources) or "no log"
    lines += [f"_Generated {report.created} by `launcher report` from {sources}._", ""]
    return "\n".join(lines)


def _smooth(values: list[float], weight: float = 0.9) -> list[float]:
    """The training loss smoothed without lag: the mean of an exponential moving average run forwards and one
    run backwards. One EMA alone trails the curve by about ``weight / (1 - weight)`` steps, so on a falling
    loss it runs above every raw value (0.1 above at a slope of 0.01 per step)."""
    forward, backward = _ema(values, weight), _ema(values[::-1], weight)[::-1]
    return [(a + b) / 2 for a, b in zip(forward, backward, strict=True)]


def _ema(values: list[float], weight: float) -> list[float]:
    """Exponential moving average with TensorBoard's debiasing, so the start is not pulled to 0."""
    out, last, norm = [], 0.0, 0.0
    for v in values:
        last = weight * last + (1 - weight) * v
        norm = weight * norm + (1 - weight)
        out.append(last / norm)
    return out


def plot_curves(report: RunReport, path: Path) -> Path:
    """Draw training loss, validation loss (best step marked) and any test split into ``path``."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no display backend needed

    fig = Figure(figsize=(9, 5), dpi=110)
    ax = fig.subplots()
    train = report.curves.train
    if train:
        steps, values = [p.step for p in train], [p.value for p in train]
        smooth = len(train) >= 20
        ax.plot(steps, values, color="tab:blue", alpha=0.3 if smooth else 0.9, lw=1, label="training loss")
        if smooth:
            ax.plot(steps, _smooth(values), color="tab:blue", lw=1.8, label="training loss (smoothed)")
    metric = report.selection_metric
    evals = report.curves.evals.get(metric or "", [])
    if evals:
        label = f"validation {metric} (selection)"
        ax.plot([p.step for p in evals], [p.value for p in evals], "o-", color="tab:orange", lw=1.8, label=label)
    for i, test in enumerate(report.test_metrics):
        points = report.curves.evals[test]
        ax.plot(
            [p.step for p in points],
            [p.value for p in points],
            "s--",
            color=f"C{i + 2}",
            lw=1.2,
            label=f"test {test} (not used for selection)",
        )
    tested = [c for c in (report.evaluation or {}).get("checkpoints", []) if c.get("test_loss") is not None]
    if tested:  # `launcher evaluate`: the held-out test loss of each evaluated checkpoint, next to the curve
        ax.plot(
            [c["step"] for c in tested],
            [c["test_loss"] for c in tested],
            "D",
            color="tab:red",
            ms=7,
            label="test loss (launcher evaluate, held out)",
        )
    if report.best is not None:
        ax.axvline(report.best.step, color="tab:orange", ls=":", lw=1)
        last_step = max(p.step for points in (train, evals) for p in points)
        right = report.best.step > 0.7 * last_step  # keep the label inside the axes
        ax.annotate(
            f"best: step {report.best.step}\n{report.best.value:.4f}",
            (report.best.step, report.best.value),
            textcoords="offset points",
            xytext=(-6 if right else 6, 10),
            ha="right" if right else "left",
            fontsize=8,
            color="tab:orange",
        )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(f"{report.run_id}: {report.verdict.label}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    write_bytes_atomic(path, buffer.getvalue())
    return path


def print_summary(report: RunReport) -> None:
    """Print the selection summary and the checkpoint table."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(highlight=False, soft_wrap=True)
    metric = report.selection_metric or "eval loss"
    console.print(f"report {escape(report.run_id)}  ({escape(str(report.run_dir))})")
    if report.best is not None:
        console.print(
            f"best:        step {report.best.step}, {metric} {report.best.value:.4f} "
            f"({escape(report.best_checkpoint or 'no checkpoint saved at that step')})"
        )
    else:
        console.print("best:        none (no evaluation logged)")
    colour = "bold red" if report.verdict.overfitting else "default"
    console.print(f"overfitting: [{colour}]{escape(report.verdict.message)}[/]")
    console.print(f"recommended: [bold]{escape(report.recommended or 'none')}[/] ({escape(report.recommended_reason)})")
    table = Table("checkpoint", "step", metric, *report.test_metrics, "adapter size", "")
    for c in report.checkpoints:
        marks = ("best " if report.best is not None and c.step == report.best.step else "") + (
            "recommended" if c.name == report.recommended else ""
        )
        tests = [_fmt(report.value_at(m, c.step)) for m in report.test_metrics]
        table.add_row(
            c.name,
            str(c.step),
            _fmt(report.value_at(report.selection_metric, c.step)),
            *tests,
            human_size(c.adapter_bytes),
            marks.strip(),
        )
    if report.checkpoints:
        console.print(table)
    if report.evaluation is not None:
        summary = report_summary(report.evaluation, report.best_checkpoint, report.selection_metric)
        losses = ", ".join(f"{name} {_fmt(c['test_loss'])}" for name, c in summary["checkpoints"].items())
        console.print(f"evaluate:    test loss {escape(losses)} (screening signals in report.md)")
        if summary["criteria_disagree"]:
            prefs = "; ".join(f"{about}: {name}" for about, name in summary["preferred"].items() if name)
            console.print(f"             the criteria disagree: {escape(prefs)}")
    for note in report.notes:
        console.print(f"note: {escape(note)}")
