"""`launcher profile CONFIG`: a short run through the same supervisor, profiled on every rank.

The config is the user's, with ``launcher.profile: {warmup, steps}`` and, so the run is short and measures
training alone: ``max_steps`` = warm-up + profiled steps, no evaluation (so no early stopping or best-model
loading), no checkpoint, no automatic restart, and ``-profile`` after the run name.
It gets its own run directory, state and records like any run; the ranks write their profiles
(``launcher/rank/profiling.py``) and this command merges them into ``profile.json`` and ``profile.md``
(``results/profile_report.py``) once the run has ended, whatever its end state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from launcher.config.run_config import load_run_config
from launcher.errors import ExitCode, LauncherError
from launcher.results.profile_report import write_report
from launcher.run.supervisor import supervise
from launcher.state.runs import PROFILE_MD, list_runs


def profile_overrides(name: str, steps: int, warmup: int) -> dict[str, Any]:
    """The keys a profile run sets over the user's config."""
    return {
        "launcher.profile.steps": steps,
        "launcher.profile.warmup": warmup,
        "launcher.run_name": f"{name}-profile",
        "launcher.early_stopping": None,
        "launcher.restart": None,  # no evaluation to stop on; no retries
        "max_steps": warmup + steps,
        "eval_strategy": "no",
        "do_eval": False,
        "save_strategy": "no",
        "load_best_model_at_end": False,
    }


def profile_run(config_path: Path, overrides: dict[str, Any], *, steps: int, warmup: int, echo: bool = True) -> int:
    """Run the profile and write its report; returns the run's exit code.

    Raises:
        LauncherError: bad ``steps``/``warmup``, or the config is refused (as ``launcher run`` would).
    """
    if steps < 1 or warmup < 0 or warmup + steps < 2:
        raise LauncherError(
            f"--steps {steps} --warmup {warmup}: profile at least 1 step, with warm-up and profiled "
            "steps together at least 2 (the first optimizer step has a zero learning rate under "
            "warm-up); for example --steps 3 --warmup 2",
            ExitCode.USAGE,
        )
    config = load_run_config(config_path, overrides)
    name = config.run_name
    config = load_run_config(config_path, {**overrides, **profile_overrides(name, steps, warmup)})
    before = set(list_runs(config.launcher.output_root))
    code = supervise(config, echo=echo)
    made = [
        p for p in list_runs(config.launcher.output_root) if p not in before and p.name.startswith(f"{name}-profile")
    ]
    if not made:
        return code
    report = write_report(made[-1])
    print(f"profile: {made[-1] / PROFILE_MD} ({len(report['ranks'])} rank(s))", flush=True)
    return code
