"""Verbs that read runs from their files, without the lock: status, logs, list, verify and report (host side, no
torch), and evaluate (which runs the model in a child process)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from launcher.cli.registry import Verb, add_root_arg, add_run_arg, run_dir, runs_root
from launcher.errors import ExitCode, LauncherError


def _seconds_or_run(text: str) -> float | str:
    """``--watch 10`` is seconds; ``--watch RUN`` (options before RUN) leaves RUN for the command."""
    try:
        return float(text)
    except ValueError:
        return text


def _args_status(p: argparse.ArgumentParser) -> None:
    add_run_arg(p)
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    p.add_argument(
        "--watch",
        nargs="?",
        type=_seconds_or_run,
        const=5.0,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS (default 5) until the run ends",
    )


def _cmd_status(ns: argparse.Namespace) -> int:
    from launcher.monitor.status import show_status

    if ns.watch is not None and not isinstance(ns.watch, float):  # `status --watch RUN`: RUN, not SECONDS
        if ns.run is not None:
            raise LauncherError(f"--watch {ns.watch!r}: give SECONDS as a number, e.g. --watch 10")
        ns.run, ns.watch = ns.watch, 5.0
    return show_status(run_dir(ns), ns.json, ns.watch)


def _args_logs(p: argparse.ArgumentParser) -> None:
    add_run_arg(p)
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new output until the run ends")
    p.add_argument("-n", "--lines", type=int, default=50, help="lines of the end to show first (default 50)")


def _cmd_logs(ns: argparse.Namespace) -> int:
    from launcher.monitor.status import show_logs

    return show_logs(run_dir(ns), ns.follow, ns.lines)


def _args_list(p: argparse.ArgumentParser) -> None:
    add_root_arg(p)
    p.add_argument(
        "--devices",
        action="store_true",
        help="the device leases of this host instead: device, holding run, runs folder, user, since "
        "(every runs folder, user and container of the host; $LAUNCHER_LEASE_DIR)",
    )


def _cmd_list(ns: argparse.Namespace) -> int:
    from launcher.monitor.status import show_leases, show_list

    return show_leases() if ns.devices else show_list(runs_root(ns))


def _readable_record(folder: Path):
    """The run's record, None when it has none (a bare output folder is still verified); a record that is
    there but unreadable refuses the verb (``RecordUnreadable``) before anything is written."""
    from launcher.state.record import read_record
    from launcher.state.runs import STATUS_FILE

    return read_record(folder) if (folder / STATUS_FILE).exists() else None


def _add_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        type=Path,
        metavar="DIR",
        help="base model folder (config.json), when the recorded model path is not valid here (a run "
        "that ran in a container: the host's copy of the model)",
    )


def _args_verify(p: argparse.ArgumentParser) -> None:
    add_run_arg(p)
    _add_model_arg(p)
    p.add_argument("--json", action="store_true", help="print verify.json instead of the PASS/FAIL lines")


def _cmd_verify(ns: argparse.Namespace) -> int:
    """0 when every check passes, 1 when one fails, 2 when RUN is not a run."""
    from launcher.results.verify import print_report, verify_run
    from launcher.state.runs import VERIFY_FILE

    folder = run_dir(ns)
    record = _readable_record(folder)
    if record is not None:
        from launcher.run.placement import reconcile

        seen = reconcile(record, folder)
        if not seen.state.terminal:  # a live run's missing final adapter is not a failure: nothing to judge yet
            raise LauncherError(
                f"run {record.run_id} is {seen.state.value}, not ended: verify judges a run that has ended "
                f"and wrote nothing. Wait for it (`launcher status {record.run_id} --watch`) or stop it "
                f"(`launcher stop {record.run_id}`), then verify",
                ExitCode.REFUSED,
            )
    report = verify_run(folder, model_dir=ns.model)
    if ns.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print_report(report, folder / VERIFY_FILE)
    return ExitCode.OK if report.passed else ExitCode.FAILED


def _args_report(p: argparse.ArgumentParser) -> None:
    from launcher.results.curves import DEFAULT_OVERFIT_PATIENCE

    add_run_arg(p)
    p.add_argument(
        "--patience",
        type=int,
        metavar="N",
        help="evaluations after the best that count as overfitting (default: the run's early-stopping "
        f"patience, else {DEFAULT_OVERFIT_PATIENCE})",
    )
    p.add_argument("--no-plot", action="store_true", help="do not draw loss.png")
    p.add_argument("--json", action="store_true", help="print report.json instead of the summary")


def _cmd_report(ns: argparse.Namespace) -> int:
    """0 when the report was written, 2 when RUN is not a run directory."""
    from launcher.results.report import build_report, print_summary
    from launcher.state.runs import REPORT_JSON, REPORT_MD

    folder = run_dir(ns)
    if ns.patience is not None and ns.patience < 1:
        raise LauncherError(f"--patience {ns.patience}: use 1 or more evaluations")
    _readable_record(folder)
    report = build_report(folder, patience=ns.patience, plot=not ns.no_plot)
    if ns.json:
        print(json.dumps(report.to_dict(), indent=2))
        return ExitCode.OK
    print_summary(report)
    written = [folder / REPORT_MD, folder / REPORT_JSON] + ([report.plot] if report.plot else [])
    print("written: " + ", ".join(str(p) for p in written))
    return ExitCode.OK


def _args_evaluate(p: argparse.ArgumentParser) -> None:
    from launcher.rank.evaluate_decode import AUTO_MAX_ROWS
    from launcher.run.evaluate import (
        DEFAULT_BATCH_SIZE,
        DEFAULT_CHECKPOINTS,
        DEFAULT_MAX_NEW_TOKENS,
        DEFAULT_MAX_PROMPTS,
    )

    add_run_arg(p)
    p.add_argument(
        "--checkpoints",
        default=DEFAULT_CHECKPOINTS,
        metavar="LIST",
        help="comma-separated: best (lowest validation loss), last, final (output/), or step numbers "
        f"(default {DEFAULT_CHECKPOINTS})",
    )
    p.add_argument(
        "--prompts",
        type=Path,
        metavar="FILE",
        help='extra prompts: a JSON list of strings or {"prompt", "reference", "crisis"} objects',
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULT_MAX_NEW_TOKENS,
        metavar="N",
        help=f"greedy answer length limit (default {DEFAULT_MAX_NEW_TOKENS})",
    )
    p.add_argument(
        "--max-prompts",
        type=int,
        default=DEFAULT_MAX_PROMPTS,
        metavar="N",
        help=f"test conversations to answer (default {DEFAULT_MAX_PROMPTS}; 0: all); the test loss always "
        "uses the whole split",
    )
    p.add_argument(
        "--batch-size",
        default=DEFAULT_BATCH_SIZE,
        metavar="N|auto",
        help=f"prompts answered together by greedy decoding, the same answers as one at a time (default "
        f"{DEFAULT_BATCH_SIZE}: as many as the device's free memory holds beside the model, at most "
        f"{AUTO_MAX_ROWS}; give a number if the device runs out of memory)",
    )
    p.add_argument("--show", action="store_true", help="also print the answers (they are counselling text)")
    _add_model_arg(p)
    p.add_argument(
        "--data-dir",
        type=Path,
        metavar="DIR",
        help="the run's data folder (dataset_info.json and the test split), when the recorded one is not "
        "valid here; a container run's paths are otherwise mapped through its mounts",
    )


def _in_image_options(ns: argparse.Namespace) -> list[str]:
    """The options given that mean the same in the run's image (``--prompts`` names a file here: left out)."""
    from launcher.run.evaluate import (
        DEFAULT_BATCH_SIZE,
        DEFAULT_CHECKPOINTS,
        DEFAULT_MAX_NEW_TOKENS,
        DEFAULT_MAX_PROMPTS,
    )

    given = {
        "--checkpoints": (ns.checkpoints, DEFAULT_CHECKPOINTS),
        "--max-new-tokens": (ns.max_new_tokens, DEFAULT_MAX_NEW_TOKENS),
        "--max-prompts": (ns.max_prompts, DEFAULT_MAX_PROMPTS),
        "--batch-size": (ns.batch_size, DEFAULT_BATCH_SIZE),
    }
    options = [f"{name}={value}" for name, (value, default) in given.items() if value != default]
    return options + (["--show"] if ns.show else [])


def _cmd_evaluate(ns: argparse.Namespace) -> int:
    """0 when evaluate.json was written, 1 when the evaluation failed, 2 for bad input."""
    from launcher.results.evaluate import signal_rows
    from launcher.run.evaluate import build_request, evaluate_run
    from launcher.state.runs import EVALUATE_JSON, EVALUATE_MD

    folder = run_dir(ns)
    request = build_request(
        folder,
        checkpoints=ns.checkpoints,
        prompts_file=ns.prompts,
        max_new_tokens=ns.max_new_tokens,
        max_prompts=ns.max_prompts,
        batch_size=ns.batch_size,
        model_dir=ns.model,
        data_dir=ns.data_dir,
        options=_in_image_options(ns),
    )
    names = ", ".join(c["name"] for c in request["checkpoints"])
    print(
        f"evaluate {request['run_id']}: {names} on {request['backend']}; test split "
        f"{request['test_split']['file']} ({request['test_split']['samples']} samples)",
        flush=True,
    )
    doc = evaluate_run(folder, request, show=ns.show)
    for label, cells in signal_rows(doc):
        print(f"  {label:34} " + "  ".join(f"{c:>16}" for c in cells))
    print("  (screening signals, not a clinical judgement; the answers are in evaluate.md)")
    print(f"written: {folder / EVALUATE_JSON}, {folder / EVALUATE_MD}")
    return ExitCode.OK


VERBS: tuple[Verb, ...] = (
    Verb(
        "status",
        "show a run's state, progress, losses, ETA and last checkpoint (no lock, no torch needed)",
        "launcher status\n  launcher status demo-cpu-20261130-101500 --json\n  launcher status --watch 10",
        _args_status,
        _cmd_status,
    ),
    Verb(
        "logs",
        "print the end of a run's job log; -f follows it",
        "launcher logs\n  launcher logs demo-cpu-20261130-101500 -f",
        _args_logs,
        _cmd_logs,
    ),
    Verb(
        "list",
        "list runs with their end states and exit codes; --devices: who holds which device on this host",
        "launcher list\n  launcher list --root /outputs/runs\n  launcher list --devices",
        _args_list,
        _cmd_list,
    ),
    Verb(
        "verify",
        "acceptance checklist of a run: steps, exit code, final adapter loads, finite tensors, LoRA count and "
        "non-zero B, metrics files; PASS/FAIL with evidence, writes verify.json (no torch needed)",
        "launcher verify demo-cpu-20261130-101500\n  launcher verify outputs/runs/demo-cpu-20261130-101500 "
        "--model demo/model",
        _args_verify,
        _cmd_verify,
    ),
    Verb(
        "report",
        "model selection: loss curves (loss.png), best checkpoint by eval loss, overfitting verdict, checkpoint "
        "table and the recommended checkpoint; writes report.md (no torch needed)",
        "launcher report demo-cpu-20261130-101500\n  launcher report RUN --patience 5 --no-plot",
        _args_report,
        _cmd_report,
    ),
    Verb(
        "evaluate",
        "per checkpoint (adapter on the read-only base): test-split loss, greedy answers to the test split's first "
        "client turns and shipped crisis prompts, screening signals; writes evaluate.json and evaluate.md",
        "launcher evaluate demo-cpu-20261130-101500\n  launcher evaluate RUN --checkpoints best,last,500 "
        "--max-new-tokens 256\n  launcher evaluate RUN --prompts my_prompts.json --max-prompts 0\n"
        "  launcher evaluate RUN --batch-size 8   # 8 prompts a batch instead of as many as the free memory holds\n"
        "  launcher evaluate --root outputs/runs --model demo/model --data-dir demo/data   # a container run's inputs",
        _args_evaluate,
        _cmd_evaluate,
    ),
)
