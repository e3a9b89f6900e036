"""The ``launcher`` command: one registry of verbs, each with help and examples.

Every verb imports what it needs when it runs, so host-side verbs (``status``, ``logs``, ``list``,
``stop``) start fast and work without torch; verbs that train or build models import the training
stack lazily.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DEFAULT_ROOT = Path("outputs/runs")


@dataclass(frozen=True)
class Verb:
    name: str
    help: str
    examples: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    hidden: bool = False


def _lazy(module: str, name: str) -> Callable:
    """A function that imports ``module.name`` only when called."""

    def call(*args, **kwargs):
        return getattr(importlib.import_module(module, __package__), name)(*args, **kwargs)

    return call


def _add_run_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", nargs="?", help="run id or run directory (default: the newest run under --root)")
    p.add_argument("--root", type=Path, default=DEFAULT_ROOT, help=f"runs folder (default: {DEFAULT_ROOT})")


def _run_dir(ns: argparse.Namespace) -> Path | None:
    """The run directory RUN names (or the newest under --root); prints why not and returns None."""
    from .runs import RunNotFound, run_dir_for

    try:
        return run_dir_for(ns.run, ns.root)
    except RunNotFound as err:
        print(f"error: {err}", file=sys.stderr)
        return None


# --- verbs ------------------------------------------------------------------------------------------


def _args_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", type=Path, help="run config: LLaMA-Factory YAML plus a launcher: section")


def _args_run(p: argparse.ArgumentParser) -> None:
    _args_config(p)
    p.add_argument("--quiet", action="store_true", help="do not echo the job's output (it still goes to the log)")


def _cmd_run(ns: argparse.Namespace) -> int:
    from .supervisor import supervise

    return supervise(ns.config, echo=not ns.quiet)


def _cmd_start(ns: argparse.Namespace) -> int:
    from .config import ConfigError, load_run_config

    try:
        config = load_run_config(ns.config)  # fast host-side errors before anything is spawned
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from .lock import LockBusy, is_locked, read_owner

    root = config.launcher.output_root
    if is_locked(root):  # refuse at once; the supervisor checks again under the lock
        print(f"error: {LockBusy(root / 'launcher.lock', read_owner(root))}", file=sys.stderr)
        return 3
    from .control import start_detached

    return start_detached(ns.config)


def _args_supervise(p: argparse.ArgumentParser) -> None:
    _args_config(p)
    p.add_argument("--handshake-fd", type=int, required=True)
    p.add_argument("--resume", default=None, help="JSON: run_dir, checkpoint, mode")


def _cmd_supervise(ns: argparse.Namespace) -> int:
    import json
    import os

    from .supervisor import supervise

    resume = None
    if ns.resume:
        resume = json.loads(ns.resume)
        resume["run_dir"], resume["checkpoint"] = Path(resume["run_dir"]), Path(resume["checkpoint"])
    handshake = os.fdopen(ns.handshake_fd, "w")
    return supervise(ns.config, echo=False, handshake=handshake, resume=resume)


def _cmd_check(ns: argparse.Namespace) -> int:
    from .supervisor import SetupRefused, prepare

    try:
        prepared = prepare(ns.config)
    except SetupRefused as err:
        print(f"error: {err}", file=sys.stderr)
        return err.code
    launcher = prepared.config.launcher
    print(f"{ns.config}: OK (backend {prepared.backend.name}, {launcher.nproc_per_node} process(es) per node, "
          f"{launcher.distribution}{', smoke' if launcher.smoke else ''})")  # fmt: skip
    return 0


def _args_status(p: argparse.ArgumentParser) -> None:
    _add_run_arg(p)
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    p.add_argument("--watch", nargs="?", type=float, const=5.0, default=None, metavar="SECONDS",
                   help="refresh every SECONDS (default 5) until the run ends")  # fmt: skip


def _cmd_status(ns: argparse.Namespace) -> int:
    run_dir = _run_dir(ns)
    if run_dir is None:
        return 2
    from .status import show_status

    return show_status(run_dir, ns.json, ns.watch)


def _args_stop(p: argparse.ArgumentParser) -> None:
    _add_run_arg(p)
    p.add_argument("--grace", type=float, default=None, metavar="SECONDS",
                   help="seconds between SIGTERM and SIGKILL (default: the run's stop_grace_s)")  # fmt: skip


def _cmd_stop(ns: argparse.Namespace) -> int:
    run_dir = _run_dir(ns)
    if run_dir is None:
        return 2
    from .control import stop_run

    return stop_run(run_dir, ns.grace)


def _args_logs(p: argparse.ArgumentParser) -> None:
    _add_run_arg(p)
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new output until the run ends")
    p.add_argument("-n", "--lines", type=int, default=50, help="lines of the end to show first (default 50)")


def _cmd_logs(ns: argparse.Namespace) -> int:
    run_dir = _run_dir(ns)
    if run_dir is None:
        return 2
    from .status import show_logs

    return show_logs(run_dir, ns.follow, ns.lines)


def _args_list(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", type=Path, default=DEFAULT_ROOT, help=f"runs folder (default: {DEFAULT_ROOT})")


def _cmd_list(ns: argparse.Namespace) -> int:
    from .status import show_list

    return show_list(ns.root)


def _args_resume(p: argparse.ArgumentParser) -> None:
    _add_run_arg(p)
    p.add_argument("--adapter-only", action="store_true",
                   help="accept a checkpoint without optimizer/scheduler state (save_only_model: true)")  # fmt: skip
    p.add_argument("--foreground", action="store_true", help="supervise in the foreground, like `run`")


def _cmd_resume(ns: argparse.Namespace) -> int:
    run_dir = _run_dir(ns)
    if run_dir is None:
        return 2
    from .resume import resume_run

    return resume_run(run_dir, adapter_only=ns.adapter_only, foreground=ns.foreground)


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
    Verb("run", "train in the foreground: validate, create a run directory, supervise the job to its end",
         "launcher run configs/demo_cpu.yaml\n  launcher run configs/qwen3_5_27b_lora_soulchat.yaml",
         _args_run, _cmd_run),
    Verb("start", "start a run in the background (survives the SSH session) and return at once",
         "launcher start configs/qwen3_5_27b_lora_soulchat.yaml", _args_config, _cmd_start),
    Verb("status", "show a run's state, progress, losses, ETA and last checkpoint (no lock, no torch needed)",
         "launcher status\n  launcher status demo-cpu-20261130-101500 --json\n  launcher status --watch 10",
         _args_status, _cmd_status),
    Verb("logs", "print the end of a run's job log; -f follows it",
         "launcher logs\n  launcher logs demo-cpu-20261130-101500 -f", _args_logs, _cmd_logs),
    Verb("stop", "stop a run: SIGTERM to every process of the job, SIGKILL after the grace period",
         "launcher stop\n  launcher stop demo-cpu-20261130-101500 --grace 300", _args_stop, _cmd_stop),
    Verb("list", "list runs with their end states and exit codes",
         "launcher list\n  launcher list --root /outputs/runs", _args_list, _cmd_list),
    Verb("resume", "continue a stopped or failed run from its last complete checkpoint (a new attempt)",
         "launcher resume demo-cpu-20261130-101500\n  launcher resume RUN --adapter-only",
         _args_resume, _cmd_resume),
    Verb("check", "validate a run config (launcher section and LLaMA-Factory's own parser) without training",
         "launcher check configs/qwen3_5_27b_lora_soulchat.yaml", _args_config, _cmd_check),
    Verb("preflight",
         "check backend, devices, driver, packages, DeltaNet kernel, model, data and output space; print a table",
         "launcher preflight configs/qwen3_5_27b_lora_soulchat.yaml\n"
         "  launcher preflight configs/demo_cpu.yaml --json preflight.json",
         _lazy(".preflight", "add_preflight_arguments"), _lazy(".preflight", "cli_preflight")),
    Verb("verify",
         "acceptance checklist of a run: steps, exit code, final adapter loads, finite tensors, LoRA count and "
         "non-zero B, metrics files; PASS/FAIL with evidence, writes verify.json (no torch needed)",
         "launcher verify demo-cpu-20261130-101500\n  launcher verify outputs/runs/demo-cpu-20261130-101500 "
         "--model demo/model", _lazy(".verify", "add_verify_arguments"), _lazy(".verify", "cli_verify")),
    Verb("report",
         "model selection: loss curves (loss.png), best checkpoint by eval loss, overfitting verdict, checkpoint "
         "table and the recommended checkpoint; writes report.md (no torch needed)",
         "launcher report demo-cpu-20261130-101500\n  launcher report RUN --patience 5 --no-plot",
         _lazy(".report", "add_report_arguments"), _lazy(".report", "cli_report")),
    Verb("validate-kernels",
         "check the routed Gated DeltaNet kernel in bf16 against an fp32 reference: output and q/k/v/g/beta "
         "gradients, T != H, grouped heads, packed sequences, the 27B shape with peak memory and timings",
         "launcher validate-kernels --device cpu\n  launcher validate-kernels --device cuda --json kernels.json\n"
         "  launcher validate-kernels --device npu --suite quick",
         _lazy(".kernels_cli", "add_arguments"), _lazy(".kernels_cli", "cli_validate_kernels")),
    Verb("demo-assets", "build the tiny random Qwen3.5 model, tokenizer, processor and demo dataset (no download)",
         "launcher demo-assets --out demo\n  launcher demo-assets --out demo --force",
         _args_demo_assets, _cmd_demo_assets),
    Verb("data",
         "data tools: `prepare` converts SoulChat-R1 files for LLaMA-Factory; `stats` measures token lengths and "
         "supervised tokens after the chat template (no conversation text printed unless --show-samples)",
         "launcher data prepare --format soulchat-r1 catch_mdpcot.json --out /data --reasoning drop\n"
         "  launcher data prepare --format soulchat-r1 catch_dialogue.json --out /data --system-from-target\n"
         "  launcher data stats configs/qwen3_5_27b_lora_soulchat.yaml",
         _lazy(".data.cli", "add_data_arguments"), _lazy(".data.cli", "cli_data")),
    Verb("_supervise", "internal: the detached supervisor started by `launcher start`", "",
         _args_supervise, _cmd_supervise, hidden=True),
)  # fmt: skip


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``launcher`` parser. ``only`` adds the arguments of that verb alone: some verbs' argument
    functions import their module (preflight, verify, report), which a `status` call should not pay for."""
    shown = [v for v in VERBS if not v.hidden]
    parser = argparse.ArgumentParser(
        prog="launcher",
        description="LoRA fine-tuning of hybrid Gated-DeltaNet models (Qwen3.5) with LLaMA-Factory.",
        epilog="examples:\n" + "\n".join(f"  {v.examples.splitlines()[0]}" for v in shown),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    for verb in VERBS:
        kwargs = {} if verb.hidden else {"help": verb.help}
        p = sub.add_parser(
            verb.name,
            description=verb.help,
            epilog=f"examples:\n  {verb.examples}" if verb.examples else None,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            **kwargs,
        )
        if only is None or verb.name == only:
            verb.add_arguments(p)
        p.set_defaults(_run=verb.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    ns = build_parser(only=chosen if chosen in {v.name for v in VERBS} else None).parse_args(argv)
    try:
        return ns._run(ns)
    except KeyboardInterrupt:
        return 130


__all__ = ["VERBS", "build_parser", "main"]
