"""Every problem of the LLaMA-Factory part of a run config, found in one pass, before any model is loaded.

What is checked, each finding naming its key and, for a problem, the fix:

- every key against LLaMA-Factory's own argument dataclasses (the ones ``llamafactory-cli train`` parses),
  with the nearest valid key for a typo, and every value against its field's type (the dataclasses do
  not convert: ``learning_rate: fast`` would pass and fail as a TypeError once training started);
- ``do_train`` for a training stage (without it LLaMA-Factory only evaluates);
- ``template`` against LLaMA-Factory's template registry, listing close names;
- combinations known to fail with the pinned stack (``flash_attn: fa2`` with transformers 5.6.0);
- ``lora_target`` against the module names of the model's architecture, rebuilt from its
  ``config.json`` (no weights): what each target matches, and an error for one that matches nothing;
- the datasets: named in ``dataset``, registered in ``dataset_info.json``, their files and every record's
  columns and types (``launcher.checks.data_check``), and think/no-think agreement between the data and the template;
- ``dataset_dir`` and the model folder: one missing on this machine is an error (the model folder is
  ``config_rules.file_problems``' to refuse), or, for a config meant for another machine (``launcher check
  --for-another-machine``), a check not made here; a model folder here without a readable ``config.json``
  is an error either way;
- then LLaMA-Factory's own parser over the whole set, for its cross-field rules.

Works on a plain argument dict (``RunConfig.llamafactory_args``); imports LLaMA-Factory once. The entry for
every rule about a run config, this part among them, is ``launcher.checks.config_rules.check_run_config``.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from packaging.version import Version

from launcher.checks.data_check import (
    dataset_names,
    dataset_records,
    dataset_think_share,
    held_out_problems,
    no_dataset,
)
from launcher.errors import did_you_mean
from launcher.results.lora_targets import (
    ATTENTION_PROJECTIONS,
    DELTANET_PROJECTIONS,
    MLP_PROJECTIONS,
    UnsupportedModel,
    describe_coverage,
    expected_lora_modules,
    read_model_layout,
    split_targets,
)

TRAINING_STAGES = ("pt", "sft", "rm", "ppo", "dpo", "kto")
# transformers 5.6.0's flash_attention_forward calls s_aux.to() when s_aux is None (fixed in 5.8.0;
# LLaMA-Factory issue 10610): every flash-attention-2 run fails, on GPU and on NPU alike.
BROKEN_FLASH_ATTENTION = (Version("5.6.0"), Version("5.8.0"))
ERROR, WARN, OK, SKIPPED = "error", "warn", "ok", "skipped"
FOR_ANOTHER_MACHINE = "--for-another-machine"  # launcher check's flag: the config's paths are on another machine


@dataclass
class Finding:
    key: str  # the config key it is about
    level: str  # error | warn | ok | skipped (a check this machine could not make, and why)
    message: str


@dataclass
class Findings:
    items: list[Finding] = field(default_factory=list)

    def add(self, key: str, level: str, message: str) -> None:
        self.items.append(Finding(key, level, message))

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.items if f.level == ERROR]

    @property
    def skipped(self) -> list[Finding]:
        return [f for f in self.items if f.level == SKIPPED]

    def not_here(self, key: str, what: str, fix: str, elsewhere: bool) -> None:
        """A path of the config that is not on this machine: an error saying ``what`` and the ``fix``, or, when
        the config is meant for another machine (``elsewhere``), a check not made here."""
        if elsewhere:
            self.add(
                key,
                SKIPPED,
                f"{key}: not checked ({what}; {FOR_ANOTHER_MACHINE}: `launcher preflight` "
                "checks it where the run trains)",
            )
        else:
            self.add(
                key,
                ERROR,
                f"{key}: {what}; {fix} (a config meant for another machine: `launcher check "
                f"CONFIG {FOR_ANOTHER_MACHINE}` counts such paths as not checked)",
            )


# --- LLaMA-Factory's argument dataclasses ---------------------------------------------------------------


@cache
def argument_fields() -> dict[str, Any]:
    """Every key ``llamafactory-cli train`` accepts, with its type (resolved type hints)."""
    from llamafactory.hparams.parser import _TRAIN_ARGS

    found: dict[str, Any] = {}
    for cls in _TRAIN_ARGS:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.init:
                found.setdefault(f.name, hints.get(f.name, Any))
    return found


def _type_problem(key: str, value: Any, kind: Any) -> str | None:
    """What is wrong with ``value`` for a field of type ``kind``, or None.

    The dataclasses convert nothing, so a number written as text stays text: text is refused where a
    number or a switch is expected. Enum fields take their values (``flash_attn: sdpa``), as LLaMA-Factory
    converts those itself.
    """
    from pydantic import TypeAdapter, ValidationError

    try:
        adapter = TypeAdapter(kind)
    except Exception:  # a type pydantic cannot describe: leave it to LLaMA-Factory's parser
        return None
    wanted = _describe(kind)
    if isinstance(value, str) and wanted in ("a number", "a whole number", "true or false"):
        if wanted == "true or false":
            return f"{key}: {value!r} is text; write true or false without quotes"
        try:
            float(value)
        except ValueError:
            example = "such as 100" if wanted == "a whole number" else "such as 5.0e-5"
            return f"{key}: {value!r} is not {wanted}; write {wanted} {example}, without quotes"
        dot = " and with a dot (YAML reads 1e-4 as text, 1.0e-4 as a number)" if "e" in value.lower() else ""
        return f"{key}: {value!r} is text, not a number; write it without quotes{dot}"
    try:
        adapter.validate_python(value)
    except ValidationError as err:
        return f"{key}: {value!r} is not {wanted} ({err.errors()[0]['msg']}); give {key} {wanted}"
    except Exception:
        return None
    return None


def _describe(kind: Any) -> str:
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if len(args) == 1:
            kind = args[0]
    if kind is bool:
        return "true or false"
    if kind is int:
        return "a whole number"
    if kind is float:
        return "a number"
    if typing.get_origin(kind) is typing.Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(kind)))
    return f"of type {getattr(kind, '__name__', str(kind))}"


def check_keys_and_types(args: dict[str, Any], out: Findings) -> None:
    fields = argument_fields()
    for key, value in args.items():
        if key not in fields:
            hint = did_you_mean(key, fields) or "remove it (see LLaMA-Factory's examples)"
            out.add(key, ERROR, f"{key}: not a LLaMA-Factory argument; {hint}")
        elif (problem := _type_problem(key, value, fields[key])) is not None:
            out.add(key, ERROR, problem)


def check_stage(args: dict[str, Any], out: Findings) -> None:
    stage = args.get("stage", "sft")
    if stage in TRAINING_STAGES and args.get("do_train") is not True:
        out.add(
            "do_train",
            ERROR,
            (
                f"do_train: not set; with stage {stage!r} LLaMA-Factory then only evaluates: it loads the model, runs "
                "the evaluation and trains nothing. Add do_train: true"
            ),
        )


def check_template(args: dict[str, Any], out: Findings) -> None:
    template = args.get("template")
    if template is None:
        return
    from llamafactory.data.template import TEMPLATES

    if template not in TEMPLATES:
        close = difflib.get_close_matches(str(template), list(TEMPLATES), n=4, cutoff=0.5)
        hint = f"close names: {', '.join(close)}" if close else "see llamafactory/data/template.py"
        out.add("template", ERROR, f"template: {template!r} is not a LLaMA-Factory template; {hint}")
    else:
        out.add("template", OK, f"template: {template} (LLaMA-Factory registry)")


def check_known_bad(args: dict[str, Any], out: Findings) -> None:
    from importlib.metadata import version

    transformers = Version(version("transformers"))
    low, high = BROKEN_FLASH_ATTENTION
    if args.get("flash_attn") == "fa2" and low <= transformers < high:
        out.add(
            "flash_attn",
            ERROR,
            (
                f"flash_attn: fa2 fails with transformers {transformers} (its flash-attention path calls s_aux.to() on "
                f"None; fixed in {high}); use flash_attn: sdpa"
            ),
        )


# --- the model's modules ------------------------------------------------------------------------------


def check_lora_target(args: dict[str, Any], out: Findings, model: bool) -> None:
    if args.get("finetuning_type", "lora") != "lora":
        return
    folder = Path(str(args.get("model_name_or_path", "")))
    path = folder / "config.json"
    if not model:
        out.add("lora_target", SKIPPED, "lora_target: not checked (--no-model: the model's config.json is not read)")
        return
    if not folder.is_dir():  # config_rules.file_problems refuses it, unless the config is meant for another machine
        out.add("lora_target", SKIPPED, f"lora_target: not checked ({folder} is not a folder on this machine)")
        return
    try:
        layout = read_model_layout(json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError) as err:
        out.add(
            "lora_target",
            ERROR,
            f"lora_target: not checked, {path} is unreadable ({err}); "
            "model_name_or_path must be a model folder holding its config.json",
        )
        return
    except UnsupportedModel as err:
        out.add("lora_target", SKIPPED, f"lora_target: not checked ({err})")
        return
    targets = split_targets(args.get("lora_target"))
    every: list[str] = []
    for target in targets:
        try:
            matched = expected_lora_modules(layout, {**args, "lora_target": target})
        except UnsupportedModel as err:
            out.add("lora_target", SKIPPED, f"lora_target: not checked ({err})")
            return
        if not matched:
            names = (
                f"full attention {', '.join(ATTENTION_PROJECTIONS)}; DeltaNet {', '.join(DELTANET_PROJECTIONS)}; "
                f"MLP {', '.join(MLP_PROJECTIONS)}"
            )
            out.add(
                "lora_target",
                ERROR,
                f"lora_target: {target!r} matches no module of this model ({names}); fix the name or remove it",
            )
            continue
        every.extend(matched)
        out.add(
            "lora_target",
            OK,
            f"lora_target: {target} matches {len(matched)} module(s): {describe_coverage(layout, matched)[0]}",
        )
    if every:
        verdict, detail = describe_coverage(layout, sorted(set(every)))
        level = WARN if verdict == "full-attention projections only" else OK
        note = (
            f" (the Gated DeltaNet layers, three in four, name their projections {', '.join(DELTANET_PROJECTIONS)})"
            if level == WARN
            else ""
        )
        out.add("lora_target", level, f"lora_target covers {verdict}: {detail}{note}")


# --- the data -----------------------------------------------------------------------------------------


def check_think_agreement(args: dict[str, Any], out: Findings) -> None:
    """A no-think template must not see reasoning in the data, and a thinking template should."""
    template = str(args.get("template") or "")
    if not template:
        return
    for name, share in dataset_think_share(args).items():
        if template.endswith("_nothink") and share > 0:
            out.add(
                "template",
                ERROR,
                (
                    f"template: {template} trains without reasoning, but dataset {name} has <think> "
                    f"in {share:.0%} of its "
                    "replies (prepared with --reasoning keep?); prepare it with `launcher data prepare ... --reasoning "
                    f"drop`, or use template {template.removesuffix('_nothink')}"
                ),
            )
        elif not template.endswith("_nothink") and share == 0 and f"{template}_nothink" in _templates():
            out.add(
                "template",
                WARN,
                (
                    f"template: {template} is a thinking template but dataset {name} has no <think> reasoning; use "
                    f"{template}_nothink for no-think data"
                ),
            )


def _templates() -> set[str]:
    from llamafactory.data.template import TEMPLATES

    return set(TEMPLATES)


def check_datasets(args: dict[str, Any], out: Findings, elsewhere: bool = False) -> None:
    dataset_dir = Path(str(args.get("dataset_dir", "data")))
    named = bool(dataset_names(args))
    if not named:  # wherever the data is, there is nothing to train on
        out.add("dataset", ERROR, no_dataset(args))
    if not dataset_dir.is_dir():
        out.not_here(
            "dataset_dir",
            f"{str(dataset_dir)!r} is not a folder on this machine",
            "point dataset_dir at the folder that holds dataset_info.json",
            elsewhere,
        )
    if not named or not dataset_dir.is_dir():
        return
    problems, seen = dataset_records(args)
    problems += held_out_problems(args)
    for problem in problems:
        out.add("dataset", ERROR, problem)
    if seen and not problems:
        out.add("dataset", OK, f"datasets: {'; '.join(seen)}")
    if not problems:
        check_think_agreement(args, out)


# --- LLaMA-Factory's own parser -------------------------------------------------------------------------


def validate_llamafactory_args(args: dict[str, Any]) -> list[str]:
    """Run LLaMA-Factory's own argument parser over ``args``; return its complaints (empty if fine).

    Unknown keys are refused, exactly as ``llamafactory-cli train`` does.
    """
    from llamafactory.hparams.parser import _TRAIN_ARGS
    from transformers import HfArgumentParser

    try:
        HfArgumentParser(_TRAIN_ARGS).parse_dict(args, allow_extra_keys=False)
    except (ValueError, TypeError) as err:
        return [f"LLaMA-Factory: {err}"]
    return []


def check_llamafactory(
    args: dict[str, Any], *, model: bool = True, data: bool = True, devices: bool = True, elsewhere: bool = False
) -> Findings:
    """Every check above over the LLaMA-Factory arguments ``args``.

    Args:
        args: what the job would receive (``RunConfig.llamafactory_args``).
        model: read the model's ``config.json`` (``launcher check --no-model`` does not).
        data: check the datasets.
        devices: this machine has the run's devices; when it has not, LLaMA-Factory's parser runs as for a
            CPU (its device rules, such as bf16 support, are preflight's on the server).
        elsewhere: the config is meant for another machine: a path it names that is not here is a check not
            made (``SKIPPED``) instead of an error.
    """
    out = Findings()
    check_keys_and_types(args, out)
    check_stage(args, out)
    check_template(args, out)
    check_known_bad(args, out)
    check_lora_target(args, out, model)
    if data:
        check_datasets(args, out, elsewhere)
    if not out.errors:  # its cross-field rules; on bad types it would fail with a TypeError of its own
        for problem in validate_llamafactory_args(args if devices else {**args, "use_cpu": True}):
            out.add("llamafactory", ERROR, problem)
    return out
