"""Acceptance checks for a finished run: ``launcher verify RUN`` and the supervisor's ``verify_run``.

"It finished" is not "it worked". A run is accepted only when every item passes:

- ``steps``: optimizer steps reached the planned total (or early stopping ended the run on purpose);
- ``exit_code``: the job exited 0, from the launcher's own record;
- ``adapter``: the final adapter is at the top of the output folder and loads: the safetensors file is
  complete and its tensors agree with ``adapter_config.json`` (modules, rank);
- ``finite``: every tensor is finite;
- ``lora_count``: the LoRA tensors are exactly those the config implies for this model
  (``lora_targets.expected_lora_modules``: 128 for rank-8 q/k/v/o on the 64-layer Qwen3.5-27B);
- ``lora_b_nonzero``: every targeted module in every layer has a non-zero B (an all-zero B is an
  initial adapter, not a trained one);
- ``metrics``: the trainer log reaches the last step and the result files are there;

plus ``coverage`` (INFO): which kinds of modules the adapter covers (full-attention projections
only, or DeltaNet projections too). Results go to ``verify.json`` in the run directory.

Host side: reads files only; numpy is imported lazily; torch, transformers and peft never are.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from launcher.files import read_json_object, read_optional, write_json_atomic
from launcher.results.adapter import read_lora_adapter
from launcher.results.curves import Curves, best_point, load_curves, read_trainer_state
from launcher.results.lora_targets import (
    ModelLayout,
    UnsupportedModel,
    describe_coverage,
    expected_lora_modules,
    read_model_layout,
)
from launcher.state.checkpoints import last_complete_checkpoint
from launcher.state.record import now_iso
from launcher.state.runfiles import RunFiles, eval_configured, load_run_files, selection_metric_name
from launcher.state.runs import (
    ADAPTER_CONFIG,
    ADAPTER_FILE,
    ALL_RESULTS,
    EVAL_RESULTS,
    RECHECK_FILE,
    STATUS_FILE,
    TRAIN_RESULTS,
    TRAINER_LOG,
    TRAINER_STATE,
    VERIFY_FILE,
)
from launcher.state.trainer_log import read_trainer_log_tail

VERIFY_SCHEMA = 1
PASS, FAIL, INFO = "PASS", "FAIL", "INFO"


@dataclass
class CheckResult:
    name: str
    title: str
    status: str  # PASS, FAIL or INFO (INFO never fails a run)
    evidence: str
    fix: str | None = None


@dataclass
class VerifyReport:
    """The outcome of ``verify_run``; ``passed`` is what the supervisor turns into a run state."""

    run_dir: Path
    run_id: str
    checks: list[CheckResult]
    coverage: dict[str, Any] = field(default_factory=dict)
    created: str = field(default_factory=now_iso)
    written: Path | None = None  # where this report was written
    kept: str | None = None  # why an earlier PASS in verify.json was kept rather than replaced

    @property
    def passed(self) -> bool:
        return not self.failed

    @property
    def failed(self) -> list[CheckResult]:
        return [c for c in self.checks if c.status == FAIL]

    def check(self, name: str) -> CheckResult:
        return next(c for c in self.checks if c.name == name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": VERIFY_SCHEMA,
            "run_id": self.run_id,
            "run_dir": str(self.run_dir),
            "created": self.created,
            "passed": self.passed,
            "failed": [c.name for c in self.failed],
            "checks": [asdict(c) for c in self.checks],
            "coverage": self.coverage,
        }


class _Context:
    def __init__(self, run_dir: Path, exit_code: int | None, model_dir: Path | None):
        self.run_dir = run_dir
        self.files: RunFiles = load_run_files(run_dir)
        self.output = self.files.output
        self.exit_code = exit_code
        self.model_dir = model_dir
        self.state, self.state_path = read_trainer_state(self.output)
        final_state = self.output / TRAINER_STATE
        self.final_state = self.state if self.state_path == final_state else None
        tail = read_trainer_log_tail(self.output / TRAINER_LOG, count=8)
        self.log_last = next((r for r in reversed(tail) if "current_steps" in r), None)
        self.curves: Curves = load_curves(self.output)
        self.adapter = read_lora_adapter(self.output)
        self.layout: ModelLayout | None = None
        self.layout_problem: str | None = None
        self.model_source: str | None = None
        self._load_layout()

    def _load_layout(self) -> None:
        candidates: list[tuple[str, Any]] = [("--model", self.model_dir)]
        manifest = self.files.manifest
        candidates.append(("manifest.json model.path", manifest.model.get("path") if manifest else None))
        candidates.append(("llamafactory.yaml model_name_or_path", self.files.lf_args.get("model_name_or_path")))
        candidates.append(
            ("adapter_config.json base_model_name_or_path", (self.adapter.config or {}).get("base_model_name_or_path"))
        )
        tried = []
        for label, value in candidates:
            if not value:
                continue
            path = Path(str(value)) / "config.json"
            tried.append(str(path))
            config = read_json_object(path)
            if isinstance(config, dict):
                self.model_source = f"{path} ({label})"
                try:
                    self.layout = read_model_layout(config)
                except UnsupportedModel as err:
                    self.layout_problem = f"{path}: {err}"
                return
        self.layout_problem = (
            f"model config.json not found (tried {', '.join(tried) or 'nothing: no model path recorded'}); "
            "mount the model folder at that path or pass --model DIR"
        )


def _short(module: str) -> str:
    """``model.language_model.layers.3.self_attn.q_proj`` -> ``layers.3.self_attn.q_proj``."""
    index = module.find("layers.")
    return module[index:] if index >= 0 else module


def _listing(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(_short(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


# ---- the checks -----------------------------------------------------------------------------------


def _check_steps(ctx: _Context) -> CheckResult:
    title = "optimizer steps reached the planned total"
    log, state = ctx.log_last or {}, ctx.final_state or {}
    planned = [v for v in (log.get("total_steps"), state.get("max_steps")) if v]
    reached = [v for v in (log.get("current_steps"), state.get("global_step")) if v is not None]
    if not planned or not reached:
        evidence = f"no step record: {TRAINER_LOG} and the final {TRAINER_STATE} are missing or empty in {ctx.output}"
        return CheckResult("steps", title, FAIL, evidence, _no_progress_fix(ctx))
    sources = []
    if state:
        sources.append(f"{TRAINER_STATE}: global_step {state.get('global_step')}, max_steps {state.get('max_steps')}")
    if log:
        sources.append(f"{TRAINER_LOG}: current_steps {log.get('current_steps')}, total_steps {log.get('total_steps')}")
    evidence = "; ".join(sources)
    if len(set(planned)) > 1:
        fix = "the log and the state come from different trainings; was the output folder reused?"
        return CheckResult("steps", title, FAIL, f"the planned totals disagree ({evidence})", fix)
    total = planned[0]
    done = state.get("global_step", max(reached))
    if done >= total:
        return CheckResult("steps", title, PASS, f"{done} of {total} planned steps ({evidence})")
    early = _early_stop(ctx, done)
    if early:
        return CheckResult("steps", title, PASS, f"{done} of {total} planned steps, {early} ({evidence})")
    resume = (
        f"then `launcher resume {ctx.run_dir.name}` continues from {last.path.name}"
        if (last := last_complete_checkpoint(ctx.output))
        else "no checkpoint was saved, so start it again"
    )
    return CheckResult(
        "steps",
        title,
        FAIL,
        f"{done} of {total} planned steps ({evidence})",
        f"the job ended early: `launcher logs {ctx.run_dir.name}` says why; {resume}",
    )


def never_trained(lf_args: dict[str, Any]) -> str | None:
    """Why a run that logged no training step never trained, when its arguments say (else None)."""
    stage = lf_args.get("stage", "sft")
    if stage in ("pt", "sft", "rm", "ppo", "dpo", "kto") and lf_args.get("do_train") is not True:
        return (
            f"the run never trained: do_train is not set, so LLaMA-Factory (stage {stage}) only evaluated; add "
            "do_train: true to the config and start a new run (there is no checkpoint to resume)"
        )
    return None


def _no_progress_fix(ctx: _Context) -> str:
    return never_trained(ctx.files.lf_args) or (
        f"`launcher logs {ctx.run_dir.name}` shows why training recorded no progress"
    )


def advice(report: VerifyReport) -> str | None:
    """One cause and one fix for a failed checklist: the first failed check's, in checklist order."""
    first = report.failed[0] if report.failed else None
    if first is None:
        return None
    return f"{first.name}: {first.evidence}" + (f"; fix: {first.fix}" if first.fix else "")


def _early_stop(ctx: _Context, step: int) -> str | None:
    """Evidence that early stopping ended training at ``step``, or None."""
    patience = ctx.files.lf_args.get("early_stopping_steps")
    if not patience:
        return None
    metric = selection_metric_name(ctx.files.lf_args) or "eval_loss"
    points = [p for p in ctx.curves.evals.get(metric, []) if p.step <= step]
    best = best_point(points)
    if best is None or points[-1].step != step:
        return None
    after = [p for p in points if p.step > best.step]
    if len(after) < int(patience):
        return None
    return (
        f"stopped early on purpose: {metric} did not improve for {len(after)} evaluations after its best at "
        f"step {best.step} (early_stopping_steps {patience})"
    )


def _check_exit(ctx: _Context) -> CheckResult:
    title = "the job exited 0"
    if ctx.exit_code is not None:
        ok = ctx.exit_code == 0
        return CheckResult("exit_code", title, PASS if ok else FAIL, f"exit code {ctx.exit_code} (from the supervisor)")
    status = ctx.files.status
    if status is None:
        return CheckResult(
            "exit_code",
            title,
            FAIL,
            f"no launcher record: {ctx.run_dir / STATUS_FILE} is missing or unreadable",
            "run the job through `launcher run` or `launcher start`",
        )
    code, sig, state = status.exit_code, status.signal, status.state.value
    evidence = f"status.json: state {state}, exit_code {code}, signal {sig}"
    if code == 0 and sig is None:
        return CheckResult("exit_code", title, PASS, evidence)
    fix = (
        f"`launcher status {ctx.run_dir.name}` shows the reason and `launcher logs {ctx.run_dir.name}` the output"
        if code is not None or sig
        else "the job has not ended yet"
    )
    return CheckResult("exit_code", title, FAIL, evidence, fix)


def _rank_for(config: dict[str, Any], module: str) -> int:
    # peft's rule for rank_pattern keys: re.match(rf"(.*\.)?({key})$", module_name)
    for key, rank in (config.get("rank_pattern") or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return int(rank)
    return int(config.get("r", 0))


def _config_targets(config: dict[str, Any], modules: list[str]) -> tuple[list[str], list[str]]:
    """Modules not named by ``target_modules``, and targets that match no module (peft's rules)."""
    targets = config.get("target_modules") or []
    if isinstance(targets, str):  # a regex, matched in full
        return [m for m in modules if not re.fullmatch(targets, m)], []

    def hit(module: str, target: str) -> bool:
        return module == target or module.endswith(f".{target}")

    unnamed = [m for m in modules if not any(hit(m, t) for t in targets)]
    unmatched = [t for t in targets if not any(hit(m, t) for m in modules)]
    return unnamed, unmatched


def _check_adapter(ctx: _Context) -> CheckResult:
    title = "final adapter exists at the top of the output folder and loads"
    ad = ctx.adapter
    fix_missing = "the final save did not happen; re-run or copy the best checkpoint's adapter after checking it"
    if ad.problem:
        return CheckResult("adapter", title, FAIL, ad.problem, fix_missing)
    assert ad.header is not None and ad.config is not None
    config = ad.config
    problems = []
    if str(config.get("peft_type", "")).upper() != "LORA":
        problems.append(f"adapter_config.json peft_type is {config.get('peft_type')!r}, not 'LORA'")
    if not ad.modules:
        problems.append(f"no LoRA tensors (keys like <module>.lora_A.weight) among {len(ad.header.tensors)} tensors")
    half = sorted(m for m, ab in ad.modules.items() if set(ab) != {"A", "B"})
    if half:
        problems.append(f"modules with only one of lora_A/lora_B: {_listing(half)}")
    unnamed, unmatched = _config_targets(config, sorted(ad.modules))
    if unnamed:
        problems.append(f"tensors for modules adapter_config.json does not target: {_listing(unnamed)}")
    if unmatched:
        problems.append(f"adapter_config.json targets with no tensors: {_listing(unmatched)}")
    for module, ab in sorted(ad.modules.items()):
        if set(ab) != {"A", "B"}:
            continue
        rank = _rank_for(config, module)
        a, b = ad.header.tensors[ab["A"]].shape, ad.header.tensors[ab["B"]].shape
        if len(a) != 2 or len(b) != 2 or a[0] != rank or b[1] != rank:
            problems.append(f"{_short(module)}: lora_A {list(a)} / lora_B {list(b)} do not match r={rank}")
            break
    size = ad.header.file_size
    dtypes = sorted({t.dtype for t in ad.header.tensors.values()})
    summary = (
        f"{ADAPTER_FILE}: {size:,} bytes, {len(ad.header.tensors)} tensors ({', '.join(dtypes)}), header complete; "
        f"{ADAPTER_CONFIG}: {config.get('peft_type')} r={config.get('r')} alpha={config.get('lora_alpha')}"
    )
    if problems:
        fix = "the adapter and its config disagree; the save was interrupted or files were mixed"
        return CheckResult("adapter", title, FAIL, f"{summary}; " + "; ".join(problems), fix)
    evidence = f"{summary}, {len(ad.modules)} modules, each with A [r, in] and B [out, r]"
    return CheckResult("adapter", title, PASS, evidence)


def _not_checked(name: str, title: str, ctx: _Context) -> CheckResult | None:
    if ctx.adapter.problem or ctx.adapter.header is None:
        return CheckResult(name, title, FAIL, "not checked: the final adapter could not be read (see adapter)")
    return None


def _check_finite(ctx: _Context) -> CheckResult:
    title = "every tensor is finite"
    if skipped := _not_checked("finite", title, ctx):
        return skipped
    ad = ctx.adapter
    n = len(ad.header.tensors)
    if ad.nonfinite:
        bad = [f"{_short(k)} ({nan} NaN, {inf} inf)" for k, (nan, inf) in sorted(ad.nonfinite.items())]
        return CheckResult(
            "finite",
            title,
            FAIL,
            f"{len(bad)} of {n} tensors hold non-finite values: "
            + ", ".join(bad[:4])
            + (" ..." if len(bad) > 4 else ""),
            "training diverged or the file is damaged; use an earlier checkpoint that passes "
            "(launcher report RUN lists them) and lower the learning rate",
        )
    return CheckResult("finite", title, PASS, f"{n} tensors, {ad.values:,} values, all finite")


def _expected(ctx: _Context) -> tuple[list[str] | None, str]:
    if ctx.layout is None:
        return None, ctx.layout_problem or "model layout unknown"
    try:
        return expected_lora_modules(ctx.layout, ctx.files.lf_args), ""
    except UnsupportedModel as err:
        return None, str(err)


def _check_count(ctx: _Context, expected: list[str] | None, why: str) -> CheckResult:
    title = "LoRA tensor count matches the config"
    if skipped := _not_checked("lora_count", title, ctx):
        return skipped
    found = set(ctx.adapter.modules)
    n_tensors = sum(len(ab) for ab in ctx.adapter.modules.values())
    target = ctx.files.lf_args.get("lora_target", "all")
    if expected is None:
        return CheckResult(
            "lora_count",
            title,
            FAIL,
            f"found {n_tensors} LoRA tensors; the expected count cannot be derived: {why}",
            "pass --model DIR with the base model's config.json",
        )
    basis = f"lora_target {target!r} on {ctx.model_source}"
    missing = [m for m in expected if m not in found]
    extra = sorted(found - set(expected))
    evidence = f"expected {2 * len(expected)} tensors ({len(expected)} modules x A, B) from {basis}; found {n_tensors}"
    if not missing and not extra and n_tensors == 2 * len(expected):
        return CheckResult("lora_count", title, PASS, evidence)
    details = []
    if missing:
        details.append(f"missing {len(missing)}: {_listing(missing)}")
    if extra:
        details.append(f"unexpected {len(extra)}: {_listing(extra)}")
    return CheckResult(
        "lora_count",
        title,
        FAIL,
        f"{evidence}; " + "; ".join(details),
        "the adapter was not trained with this run's config, or the save was incomplete",
    )


def _check_b_nonzero(ctx: _Context, expected: list[str] | None) -> CheckResult:
    title = "every targeted module in every layer has a non-zero LoRA B"
    if skipped := _not_checked("lora_b_nonzero", title, ctx):
        return skipped
    modules = expected if expected is not None else sorted(ctx.adapter.modules)
    zero, absent, smallest = [], [], math.inf
    for module in modules:
        key = ctx.adapter.modules.get(module, {}).get("B")
        if key is None:
            absent.append(module)
            continue
        peak = ctx.adapter.max_abs.get(key, 0.0)
        if not peak > 0:  # also catches NaN
            zero.append(module)
        else:
            smallest = min(smallest, peak)
    if not modules:
        return CheckResult("lora_b_nonzero", title, FAIL, "no LoRA modules to check")
    if zero or absent:
        parts = [f"{len(zero)} of {len(modules)} LoRA B matrices are all zero: {_listing(zero)}"] if zero else []
        if absent:
            parts.append(f"{len(absent)} targeted modules have no B: {_listing(absent)}")
        return CheckResult(
            "lora_b_nonzero",
            title,
            FAIL,
            "; ".join(parts),
            "an all-zero B is an untrained (initial) adapter: check that training steps ran, the "
            "learning rate is non-zero, and that the module receives gradients",
        )
    return CheckResult(
        "lora_b_nonzero",
        title,
        PASS,
        f"{len(modules)} of {len(modules)} targeted modules have a non-zero B (smallest max|B| {smallest:.3g})",
    )


def _coverage(ctx: _Context) -> tuple[CheckResult, dict[str, Any]]:
    title = "modules the adapter covers"
    modules = sorted(ctx.adapter.modules)
    if not modules:
        return CheckResult("coverage", title, INFO, "unknown: no LoRA modules could be read"), {}
    if ctx.layout is None:
        names = sorted({m.rsplit(".", 1)[-1] for m in modules})
        return CheckResult("coverage", title, INFO, f"{len(modules)} modules named {', '.join(names)}"), {
            "modules": len(modules),
            "names": names,
        }
    verdict, detail = describe_coverage(ctx.layout, modules)
    return CheckResult("coverage", title, INFO, f"{verdict}: {detail}"), {
        "verdict": verdict,
        "detail": detail,
        "modules": len(modules),
    }


def _check_metrics(ctx: _Context) -> CheckResult:
    title = "metrics files are complete"
    out, problems, found = ctx.output, [], []
    log = ctx.log_last
    if log is None:
        problems.append(f"{TRAINER_LOG} is missing or has no complete record")
    else:
        current, total = log.get("current_steps"), log.get("total_steps")
        done = (ctx.final_state or {}).get("global_step")
        if current == total or (done is not None and current == done and _early_stop(ctx, done)):
            found.append(f"{TRAINER_LOG} ends at step {current} of {total}")
        else:
            problems.append(f"{TRAINER_LOG} ends at step {current} of {total}")
    required = [TRAINER_STATE, ALL_RESULTS, TRAIN_RESULTS]
    if eval_configured(ctx.files.lf_args):
        required.append(EVAL_RESULTS)
    for name in required:
        data = read_json_object(out / name)
        if isinstance(data, str):
            problems.append(data.replace(str(out) + "/", ""))
        elif not data:
            problems.append(f"{name} is empty")
        else:
            found.append(name)
    evidence = ", ".join(found) + (" present" if found else "")
    if problems:
        fix = never_trained(ctx.files.lf_args) if log is None else None
        fix = fix or f"the job ended before writing its results; `launcher logs {ctx.run_dir.name}` says why"
        return CheckResult("metrics", title, FAIL, "; ".join(problems) + (f" ({evidence})" if found else ""), fix)
    return CheckResult("metrics", title, PASS, evidence)


def _guarded(name: str, title: str, fn, *args) -> CheckResult:
    """Run one check; a bug in it becomes a FAIL with the error, never a crash of the supervisor."""
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001 (deliberate: one broken check must not hide the others)
        return CheckResult(name, title, FAIL, f"check crashed: {type(err).__name__}: {err}")


def verify_run(
    run_dir: Path, *, exit_code: int | None = None, model_dir: Path | None = None, write: bool = True
) -> VerifyReport:
    """Run the acceptance checklist on a run directory and (by default) write ``verify.json`` there.

    Args:
        run_dir: The run directory (``status.json``, ``llamafactory.yaml``, ``output/``).
        exit_code: The job's exit code when the caller knows it (the supervisor, before it records
            the end state); otherwise it is read from ``status.json``.
        model_dir: The base model folder, when the recorded path is not valid here.
        write: Write ``verify.json`` (atomically).

    Returns:
        The report; ``report.passed`` decides SUCCEEDED versus FAILED_ACCEPTANCE.
    """
    run_dir = Path(run_dir)
    ctx = _Context(run_dir, exit_code, model_dir)
    expected, why = _expected(ctx)
    coverage_result, coverage = _coverage(ctx)
    checks = [
        _guarded("steps", "optimizer steps", _check_steps, ctx),
        _guarded("exit_code", "exit code", _check_exit, ctx),
        _guarded("adapter", "final adapter", _check_adapter, ctx),
        _guarded("finite", "finite tensors", _check_finite, ctx),
        _guarded("lora_count", "LoRA tensor count", _check_count, ctx, expected, why),
        _guarded("lora_b_nonzero", "non-zero LoRA B", _check_b_nonzero, ctx, expected),
        coverage_result,
        _guarded("metrics", "metrics files", _check_metrics, ctx),
    ]
    report = VerifyReport(run_dir=run_dir, run_id=ctx.files.run_id, checks=checks, coverage=coverage)
    if write:
        _write(report, run_dir)
    return report


@dataclass(frozen=True)
class VerifyRecord:
    """``verify.json`` as its readers see it (``VerifyReport.to_dict`` writes more): the verdict and when."""

    passed: bool | None = None
    created: str | None = None
    run_id: str | None = None


def read_verdict(run_dir: Path) -> tuple[VerifyRecord | None, str | None]:
    """``verify.json`` (None when missing), and ``unreadable: PATH (why)`` when it cannot be read."""
    return read_optional(run_dir / VERIFY_FILE, VerifyRecord)


def _write(report: VerifyReport, run_dir: Path) -> None:
    """Write ``verify.json``; a FAIL never replaces an earlier PASS (the run was accepted; what fails now
    is damage done since, reported in ``verify.recheck.json`` instead)."""
    earlier, _ = read_verdict(run_dir)  # an unreadable one is replaced
    if not report.passed and earlier is not None and earlier.passed is True:
        report.written = run_dir / RECHECK_FILE
        report.kept = (
            f"{VERIFY_FILE} keeps the PASS of {earlier.created}: the run was accepted then, "
            "so what fails now changed since (damaged or edited files); this check is in "
            f"{RECHECK_FILE}"
        )
    else:
        report.written = run_dir / VERIFY_FILE
    write_json_atomic(report.written, report.to_dict())


def print_report(report: VerifyReport, written: Path | None = None) -> None:
    """Print one line per check (PASS/FAIL/INFO with evidence, and the fix for a FAIL)."""
    from rich.console import Console
    from rich.markup import escape

    console = Console(highlight=False, soft_wrap=True)
    console.print(f"verify {escape(report.run_id)}  ({escape(str(report.run_dir))})")
    colours = {PASS: "green", FAIL: "bold red", INFO: "cyan"}
    width = max(len(c.name) for c in report.checks)
    for c in report.checks:
        console.print(f"[{colours[c.status]}]{c.status}[/]  {c.name:<{width}}  {escape(c.evidence)}")
        if c.status == FAIL and c.fix:
            console.print(f"      {'':<{width}}  fix: {escape(c.fix)}")
    counted = [c for c in report.checks if c.status != INFO]
    verdict = "[green]PASS[/]" if report.passed else "[bold red]FAIL[/]"
    written = report.written or written
    tail = f"; written to {escape(str(written))}" if written else ""
    console.print(f"result: {verdict} ({len(counted) - len(report.failed)} of {len(counted)} checks passed){tail}")
    if report.kept:
        console.print(f"note: {escape(report.kept)}")
