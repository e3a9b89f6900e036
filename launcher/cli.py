"""The ``launcher`` command: one registry of verbs, each with help and examples.

Host-side verbs import nothing heavy; verbs that train or build models import the training stack
lazily.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .config import ConfigError, load_run_config


@dataclass(frozen=True)
class Verb:
    name: str
    help: str
    examples: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _args_run(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", type=Path, help="run config: LLaMA-Factory YAML plus a launcher: section")
    p.add_argument("--quiet", action="store_true", help="do not echo the job's output (it still goes to the log)")


def _cmd_run(ns: argparse.Namespace) -> int:
    from .supervisor import run_foreground

    return run_foreground(ns.config, echo=not ns.quiet)


def _args_check(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", type=Path, help="run config to validate")


def _cmd_check(ns: argparse.Namespace) -> int:
    from .supervisor import prepare

    prepared = prepare(ns.config)
    if prepared is None:
        return 2
    print(f"{ns.config}: OK (backend {prepared.backend.name}, {prepared.config.launcher.nproc_per_node} "
          f"process(es), {prepared.config.launcher.distribution})")  # fmt: skip
    return 0


def _args_demo_assets(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("demo"), help="folder for model/ and data/ (default: demo)")
    p.add_argument("--force", action="store_true", help="replace existing demo assets in --out")


def _cmd_demo_assets(ns: argparse.Namespace) -> int:
    from .demo import build_demo_assets

    try:
        paths = build_demo_assets(ns.out, force=ns.force)
    except FileExistsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"model: {paths['model']}\ndata:  {paths['data']}")
    return 0


VERBS: tuple[Verb, ...] = (
    Verb(
        "run",
        "train in the foreground: validate, create a run directory, start the job, wait for its end",
        "launcher run configs/demo_cpu.yaml\n  launcher run configs/qwen3_5_27b_lora_soulchat.yaml",
        _args_run,
        _cmd_run,
    ),
    Verb(
        "check",
        "validate a run config (launcher section and LLaMA-Factory's own parser) without training",
        "launcher check configs/qwen3_5_27b_lora_soulchat.yaml",
        _args_check,
        _cmd_check,
    ),
    Verb(
        "demo-assets",
        "build the tiny random Qwen3.5 model, tokenizer, processor and demo dataset (no download)",
        "launcher demo-assets --out demo\n  launcher demo-assets --out demo --force",
        _args_demo_assets,
        _cmd_demo_assets,
    ),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="launcher",
        description="LoRA fine-tuning of hybrid Gated-DeltaNet models (Qwen3.5) with LLaMA-Factory.",
        epilog="examples:\n" + "\n".join(f"  {v.examples.splitlines()[0]}" for v in VERBS),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    for verb in VERBS:
        p = sub.add_parser(
            verb.name,
            help=verb.help,
            description=verb.help,
            epilog=f"examples:\n  {verb.examples}",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        verb.add_arguments(p)
        p.set_defaults(_run=verb.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns._run(ns)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


__all__ = ["VERBS", "build_parser", "main", "load_run_config"]
