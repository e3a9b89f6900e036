"""Evaluate the final model once: the evaluation after training reuses the last step's, when it is the same.

Upstream behaviour: transformers 5.6.0 evaluates at the last training step whenever ``eval_strategy`` is
``steps`` (``DefaultFlowCallback.on_step_end``: at ``global_step % eval_steps == 0``, or at the end "if this
step wasn't already going to be evaluated"); ``TrainingArguments`` sets ``do_eval`` whenever
``eval_strategy`` is not ``no``. LLaMA-Factory 0.9.5's SFT workflow (``train/sft/workflow.py``) then calls
``trainer.evaluate()`` again after ``trainer.train()`` when ``do_eval`` is set: the same weights on the same
eval set, a second time. The seed's formal run lost 8.5 minutes of eight NPUs to it (300 samples).

What this patch does (a wrapper of ``transformers.Trainer.evaluate``): every evaluation of the default eval
set remembers its metrics and the global step. A later call with the same step, the same
``metric_key_prefix``, no other dataset, no ``load_best_model_at_end`` (which may have swapped the weights)
and no ``predict_with_generate`` (LLaMA-Factory's final call generates with other settings)
returns a copy of those metrics instead of running the eval loop again, so LLaMA-Factory still
writes ``eval_results.json`` and ``all_results.json`` with the final figures; the evaluation itself, and its
line in ``trainer_log.jsonl``, happens once. Everything else runs unchanged. Proof per rank: every evaluation
(step, whether it ran or was reused, its seconds).

Versions: written and tested against transformers 5.6.0 and llamafactory 0.9.5 (``SUPPORTED``). Delete this
patch when LLaMA-Factory skips the final evaluation after a step-based evaluation of the last step.
"""

from __future__ import annotations

import importlib
import time
from typing import Any

from packaging.specifiers import SpecifierSet
from pydantic import BaseModel, ConfigDict

from .core.proof import ProofFile, utc_now
from .core.versions import require_symbols
from .core.wrapping import unwrap, wrap_once

NAME = "final_eval_once"
SUPPORTED = {"transformers": SpecifierSet(">=5.6.0,<5.7"), "llamafactory": SpecifierSet(">=0.9.5,<0.9.6")}
MODULE = "transformers"


class Options(BaseModel):
    """``launcher.patches.final_eval_once``: no options besides ``enabled``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    enabled: bool = True


_state: dict[str, Any] = {}


def check_symbols() -> None:
    """``Trainer.evaluate`` exists (LLaMA-Factory's workflow calls it after training)."""
    require_symbols(NAME, MODULE, ("Trainer",), "transformers")
    require_symbols(NAME, "llamafactory.train.sft.workflow", ("run_sft",), "llamafactory")


def _reusable(trainer, eval_dataset, prefix: str) -> dict[str, Any] | None:
    last = _state.get("last")
    args = trainer.args
    if last is None or eval_dataset is not None or getattr(args, "load_best_model_at_end", False):
        return None
    if getattr(args, "predict_with_generate", False):  # the final call passes its own generation settings
        return None
    if last["step"] != trainer.state.global_step or last["prefix"] != prefix:
        return None
    return last["metrics"]


def _make_evaluate(original):
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval", **kwargs):
        if not _state.get("active"):
            return original(self, eval_dataset, ignore_keys, metric_key_prefix, **kwargs)
        step = self.state.global_step
        reused = _reusable(self, eval_dataset, metric_key_prefix)
        if reused is not None:
            _record(step, ran=False, seconds=0.0)
            return dict(reused)
        started = time.monotonic()
        metrics = original(self, eval_dataset, ignore_keys, metric_key_prefix, **kwargs)
        if eval_dataset is None:
            _state["last"] = {"step": step, "prefix": metric_key_prefix, "metrics": dict(metrics)}
        _record(step, ran=True, seconds=round(time.monotonic() - started, 3))
        return metrics

    return evaluate


def _record(step: int, *, ran: bool, seconds: float) -> None:
    evaluations = _state.setdefault("evaluations", [])
    evaluations.append({"step": step, "ran": ran, "seconds": seconds, "at": utc_now()})
    reused = [e for e in evaluations if not e["ran"]]
    _state["proof"].update(evaluations=evaluations, reused=len(reused))


def apply(options: dict[str, Any], *, backend: str, proof: ProofFile, facts: dict[str, Any]) -> dict[str, Any]:
    """Wrap ``Trainer.evaluate`` once (idempotent) and start a fresh record for this process."""
    wrap_once(importlib.import_module(MODULE).Trainer, "evaluate", NAME, _make_evaluate)
    _state.clear()
    _state.update(active=True, proof=proof)
    return {"replaced": ["transformers.Trainer.evaluate"]}


def observe(*, backend: str, proof: ProofFile) -> None:
    """Disabled: LLaMA-Factory evaluates the final model again after training."""
    restore()


def restore() -> None:
    """Put the upstream ``evaluate`` back and forget this process's state."""
    unwrap(MODULE, "Trainer", "evaluate", NAME)
    _state.clear()
