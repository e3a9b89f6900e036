"""Tool verbs: validate-kernels, demo-assets and data (prepare, stats)."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from launcher.cli.registry import Verb
from launcher.errors import ExitCode, LauncherError


def _args_validate_kernels(p: argparse.ArgumentParser) -> None:
    from launcher.checks.kernels.validate import DEFAULT_THRESHOLD, SUITES

    p.add_argument(
        "--device",
        choices=("auto", "npu", "cuda", "cpu"),
        default="auto",
        help="backend whose routed kernel to check (default: auto, the first with devices)",
    )
    p.add_argument(
        "--kernel",
        choices=("auto", "fla", "torch"),
        default="auto",
        help="launcher.patches.deltanet_routing.kernel to route as (default auto)",
    )
    p.add_argument(
        "--suite",
        choices=tuple(SUITES),
        default=None,
        help="quick: small shapes (default on cpu); full: model shapes incl. [1,4096,48,128] (default on npu/cuda)",
    )
    p.add_argument(
        "--case",
        action="append",
        dest="cases",
        metavar="NAME",
        help="run only this case (repeatable): " + ", ".join(sorted({c.name for s in SUITES.values() for c in s})),
    )
    p.add_argument(
        "--threshold",
        type=float,
        default=DEFAULT_THRESHOLD,
        help=f"largest relative L2 error that passes (default {DEFAULT_THRESHOLD})",
    )
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the report as JSON to PATH")


def _pct(value: float | None, pct: bool = True) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "inf"
    return f"{value:.2%}" if pct else f"{value:g}"


def _render_kernels(report, file=None) -> None:
    from rich.console import Console
    from rich.table import Table

    from launcher.checks.kernels.validate import GRAD_NAMES, SUITES

    console = Console(file=file or sys.stdout, width=160)
    if report.error:
        console.print(f"[bold red]validate-kernels: no kernel to check on {report.backend}[/]: {report.error}")
        return
    table = Table(
        title=f"{report.kernel} on {report.device} (bf16 vs fp32 reference, threshold {report.threshold:.0%})",
        title_justify="left",
    )
    for col in ("case", "[B,T,H,D]", "status", "out", *(f"d{n}" for n in GRAD_NAMES), "peak GiB", "fwd+bwd ms", "note"):
        table.add_column(col, overflow="fold")
    style = {"pass": "green", "fail": "bold red", "skip": "dim"}
    for c in report.cases:
        shape = "x".join(map(str, c.shape)) + (f" (k:{c.key_heads})" if c.key_heads else "")
        errs = [_pct(c.errors.get(k)) for k in ("out", *(f"d{n}" for n in GRAD_NAMES))]
        if c.errors_vs_alone:
            errs = [
                f"{e} / {_pct(c.errors_vs_alone.get(k))}"
                for e, k in zip(errs, ("out", *(f"d{n}" for n in GRAD_NAMES)), strict=True)
            ]
        glue = {k: v for k, v in c.errors.items() if k != "out" and k not in {f"d{n}" for n in GRAD_NAMES}}
        if glue:  # a glue op's gradients are of its own inputs (dx, dweight, dgate, dup)
            errs[1] = ", ".join(f"{k} {_pct(v)}" for k, v in glue.items())
        timing = "-"
        if c.timing_ms:
            timing = " vs ".join(f"{k} {v:g}" for k, v in c.timing_ms.items())
        table.add_row(
            c.name,
            shape,
            f"[{style[c.status]}]{c.status.upper()}[/]",
            *errs,
            _pct(c.peak_memory_gib, pct=False),
            timing,
            c.note,
        )
    console.print(table)
    if report.decode_kernel:
        console.print(f"decode case: {report.decode_kernel} (outputs and final state vs the fp32 recurrence)")
    ran = {c.name for c in report.cases}
    checked = {c.op for c in SUITES[report.suite] if c.name in ran}
    for op, kernel in ((op, k) for op, k in report.glue_kernels.items() if op in checked):
        console.print(f"{op} cases: {kernel} (forward and the gradients of its inputs vs fp32, threshold 1%)")
    if any(c.errors_vs_alone for c in report.cases):
        console.print("varlen errors: vs the fp32 reference per sequence / vs the routed kernel per sequence")
    console.print(f"validate-kernels {'[green]PASSED[/]' if report.ok else '[bold red]FAILED[/]'}")


def _cmd_validate_kernels(ns: argparse.Namespace) -> int:
    """``launcher validate-kernels``: 0 when every case passed (or was skipped with a reason), 1 otherwise."""
    from launcher.checks.kernels.validate import case_progress, resolve_backend, select_cases, validate

    backend = resolve_backend(ns.device)
    suite = ns.suite or ("quick" if backend == "cpu" else "full")
    cases = tuple(ns.cases) if ns.cases else None
    report = validate(
        backend,
        kernel=ns.kernel,
        suite=suite,
        threshold=ns.threshold,
        cases=cases,
        on_case=case_progress(len(select_cases(suite, cases))),
    )
    _render_kernels(report)
    if ns.json is not None:
        from launcher.files import write_json_atomic

        ns.json.parent.mkdir(parents=True, exist_ok=True)
        options = {
            "device": ns.device,
            "kernel": ns.kernel,
            "suite": suite,
            "cases": ns.cases,
            "threshold": ns.threshold,
        }
        write_json_atomic(ns.json, {**report.to_dict(), "options": options})
        print(f"report: {ns.json}", file=sys.stderr)
    return 0 if report.ok else 1


def _args_demo_assets(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("demo"), help="folder for model/ and data/ (default: demo)")
    p.add_argument("--force", action="store_true", help="replace existing demo assets in --out")


def _cmd_demo_assets(ns: argparse.Namespace) -> int:
    from launcher.data.demo import build_demo_assets

    try:
        paths = build_demo_assets(ns.out, force=ns.force)
    except FileExistsError as err:
        raise LauncherError(str(err)) from None
    print(f"model: {paths['model']}\ndata:  {paths['data']}")
    return ExitCode.OK


def _args_data(p: argparse.ArgumentParser) -> None:
    """Sub-verbs of ``launcher data``."""
    sub = p.add_subparsers(dest="data_verb", metavar="ACTION", required=True)
    prep = sub.add_parser(
        "prepare",
        help="convert a SoulChat-R1 file into LLaMA-Factory data files with a train/validation split",
        description="Convert catch_mdpcot.json or catch_dialogue.json (detected from the records) into "
        "LLaMA-Factory files plus dataset_info.json entries; malformed records go to NAME.rejects.jsonl "
        "with their index and reason.",
        epilog="examples:\n  launcher data prepare --format soulchat-r1 catch_mdpcot.json --out /data\n"
        "  launcher data prepare --format soulchat-r1 catch_dialogue.json --out /data --system-from-target\n"
        "  launcher data prepare --format soulchat-r1 catch_mdpcot.json --out /data --val-size 300 --test-size 300",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    prep.add_argument("src", type=Path, help="catch_mdpcot.json or catch_dialogue.json (JSON array or .jsonl)")
    prep.add_argument("--format", required=True, choices=["soulchat-r1"], help="source format")
    prep.add_argument("--out", type=Path, required=True, help="folder for the data files and dataset_info.json")
    prep.add_argument(
        "--reasoning",
        choices=["drop", "keep"],
        default="drop",
        help="drop: remove <think>...</think> (no <think> left anywhere; default); "
        "keep: retain it for thinking templates",
    )
    prep.add_argument("--system", default=None, help="system prompt (mdpcot: replaces the record's own)")
    prep.add_argument("--system-file", type=Path, default=None, help="read the system prompt from a file")
    prep.add_argument(
        "--system-from-target",
        action="store_true",
        help="dialogue: use consultation_target as the system prompt (after --system)",
    )
    split = prep.add_mutually_exclusive_group()
    split.add_argument(
        "--val-size",
        type=float,
        default=None,
        help="validation share in (0, 1) or a count of samples (default 0.05); 0 for none",
    )
    split.add_argument("--val", type=Path, default=None, help="your own validation file (same format); no split")
    prep.add_argument(
        "--test-size",
        type=float,
        default=0,
        help="held-out test share in (0, 1) or count, whole conversations, never registered as a "
        "dataset (default 0: none)",
    )
    prep.add_argument("--seed", type=int, default=42, help="split seed (default 42)")
    prep.add_argument(
        "--name", default=None, help="dataset name (default soulchat_r1[_dialogue]_{nothink|think}); eval: NAME_val"
    )
    prep.add_argument("--force", action="store_true", help="replace existing output files and entries")
    prep.add_argument(
        "--show-samples",
        type=int,
        default=0,
        metavar="N",
        help="print the first N converted training samples (conversation text)",
    )
    prep.set_defaults(_data_run=_cmd_prepare)

    stats = sub.add_parser(
        "stats",
        help="token lengths and supervised tokens after the chat template, per split; table, JSON, histogram",
        description="Measure the config's datasets with its tokenizer, template and cutoff_len through "
        "LLaMA-Factory's own encoding: lengths (mean, p50-p99, max), share over cutoff_len, supervised "
        "tokens before/after truncation, samples left without one. Writes data_stats.json and data_stats.png.",
        epilog="examples:\n  launcher data stats configs/qwen3_5_27b_lora_soulchat.yaml\n"
        "  launcher data stats configs/demo_cpu.yaml --out /tmp/stats --sample 1000",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    stats.add_argument("config", type=Path, help="run config (LLaMA-Factory YAML plus a launcher: section)")
    stats.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for data_stats.json and data_stats.png (default: <launcher.output_root>/data-stats-<run name>)",
    )
    stats.add_argument("--sample", type=int, default=None, metavar="N", help="measure N samples per split only")
    stats.add_argument("--workers", type=int, default=None, help="processes (default: usable CPU cores)")
    stats.add_argument("--no-plot", action="store_true", help="skip the histogram")
    stats.add_argument(
        "--show-samples",
        type=int,
        default=0,
        metavar="N",
        help="print the first N samples of each split as tokenized (conversation text)",
    )
    stats.set_defaults(_data_run=_cmd_stats)


def _cmd_data(ns: argparse.Namespace) -> int:
    return ns._data_run(ns)


def _cmd_prepare(ns: argparse.Namespace) -> int:
    """``launcher data prepare``: 0 when files were written (rejects are listed), 2 on bad input."""
    from launcher.data.prepare import prepare, summary_lines
    from launcher.data.soulchat import Options

    system = ns.system
    if ns.system_file is not None:
        if system is not None:
            raise LauncherError("--system and --system-file both given; pass one")
        try:
            system = ns.system_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as err:
            raise LauncherError(
                f"--system-file {ns.system_file}: cannot read it ({err.__class__.__name__}); check the path"
            ) from None
    options = Options(reasoning=ns.reasoning, system=system, system_from_target=ns.system_from_target)
    val_size = 0.05 if ns.val_size is None else ns.val_size
    result = prepare(
        ns.src,
        ns.out,
        options,
        val_file=ns.val,
        val_size=val_size,
        seed=ns.seed,
        name=ns.name,
        force=ns.force,
        test_size=ns.test_size,
    )
    for line in summary_lines(result):
        print(line)
    if ns.show_samples > 0:
        import json

        print(f"--- first {min(ns.show_samples, len(result.train))} training samples (conversation text) ---")
        for sample in result.train[: ns.show_samples]:
            print(json.dumps(sample, ensure_ascii=False, indent=1))
    return 0


def default_stats_dir(config) -> Path:
    """``<launcher.output_root>/data-stats-<run name>``: next to the runs, never inside one."""
    return config.launcher.output_root / f"data-stats-{config.run_name}"


def _cmd_stats(ns: argparse.Namespace) -> int:
    """``launcher data stats``: 0 when measured (warnings are printed), 2 when the config or data is unusable."""
    import time

    from launcher.config.run_config import load_run_config

    started = time.perf_counter()
    config = load_run_config(ns.config)
    if ns.sample is not None and ns.sample < 1:
        raise LauncherError(f"--sample {ns.sample}: give a positive number of samples per split")
    from launcher.data import statsview
    from launcher.data.lfdata import load_lf_data, load_splits
    from launcher.data.stats import compute_stats_with_lengths

    lfd = load_lf_data(config.llamafactory)
    result, lengths = compute_stats_with_lengths(config, sample=ns.sample, workers=ns.workers, lfd=lfd)
    out = ns.out or default_stats_dir(config)
    statsview.render_table(result)
    files = [statsview.write_json(result, out)]
    if not ns.no_plot:
        files.append(statsview.write_histogram(result, lengths, out))
    total = time.perf_counter() - started
    print(f"done in {total:.1f} s (measuring {result['seconds']:.1f} s); wrote {', '.join(str(f) for f in files)}")
    if ns.show_samples > 0:
        statsview.print_samples(lfd, load_splits(lfd), ns.show_samples)
    return 0


VERBS: tuple[Verb, ...] = (
    Verb(
        "validate-kernels",
        "check the routed Gated DeltaNet kernel in bf16 against an fp32 reference: output and q/k/v/g/beta "
        "gradients, T != H, grouped heads, packed sequences, the 27B shape with peak memory and timings",
        "launcher validate-kernels --device cpu\n  launcher validate-kernels --device cuda --json kernels.json\n"
        "  launcher validate-kernels --device npu --suite quick",
        _args_validate_kernels,
        _cmd_validate_kernels,
    ),
    Verb(
        "demo-assets",
        "build the tiny random Qwen3.5 model, tokenizer, processor and demo dataset (no download)",
        "launcher demo-assets --out demo\n  launcher demo-assets --out demo --force",
        _args_demo_assets,
        _cmd_demo_assets,
    ),
    Verb(
        "data",
        "data tools: `prepare` converts SoulChat-R1 files for LLaMA-Factory; `stats` measures token lengths and "
        "supervised tokens after the chat template (no conversation text printed unless --show-samples)",
        "launcher data prepare --format soulchat-r1 catch_mdpcot.json --out /data --reasoning drop\n"
        "  launcher data prepare --format soulchat-r1 catch_dialogue.json --out /data --system-from-target\n"
        "  launcher data stats configs/qwen3_5_27b_lora_soulchat.yaml",
        _args_data,
        _cmd_data,
    ),
)
