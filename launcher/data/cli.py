"""``launcher data prepare|stats``: arguments and entry points (registered in ``launcher.cli.VERBS``).

Importing this module is cheap: ``prepare`` needs no torch, ``stats`` imports the training stack only
when it runs. Neither prints conversation text unless ``--show-samples`` asks for it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_data_arguments(p: argparse.ArgumentParser) -> None:
    """Sub-verbs of ``launcher data``."""
    sub = p.add_subparsers(dest="data_verb", metavar="ACTION", required=True)
    prep = sub.add_parser(
        "prepare",
        help="convert a SoulChat-R1 file into LLaMA-Factory data files with a train/validation split",
        description="Convert catch_mdpcot.json or catch_dialogue.json (detected from the records) into "
        "LLaMA-Factory files plus dataset_info.json entries; malformed records go to NAME.rejects.jsonl "
        "with their index and reason.",
        epilog="examples:\n  launcher data prepare --format soulchat-r1 catch_mdpcot.json --out /data\n"
        "  launcher data prepare --format soulchat-r1 catch_dialogue.json --out /data --system-from-target",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    prep.add_argument("src", type=Path, help="catch_mdpcot.json or catch_dialogue.json (JSON array or .jsonl)")
    prep.add_argument("--format", required=True, choices=["soulchat-r1"], help="source format")
    prep.add_argument("--out", type=Path, required=True, help="folder for the data files and dataset_info.json")
    prep.add_argument("--reasoning", choices=["drop", "keep"], default="drop",
                      help="drop: remove <think>...</think> (no <think> left anywhere; default); "
                      "keep: retain it for thinking templates")  # fmt: skip
    prep.add_argument("--system", default=None, help="system prompt (mdpcot: replaces the record's own)")
    prep.add_argument("--system-file", type=Path, default=None, help="read the system prompt from a file")
    prep.add_argument("--system-from-target", action="store_true",
                      help="dialogue: use consultation_target as the system prompt (after --system)")  # fmt: skip
    split = prep.add_mutually_exclusive_group()
    split.add_argument("--val-size", type=float, default=None,
                       help="validation share in (0, 1) or a count of samples (default 0.05); 0 for none")  # fmt: skip
    split.add_argument("--val", type=Path, default=None, help="your own validation file (same format); no split")
    prep.add_argument("--seed", type=int, default=42, help="split seed (default 42)")
    prep.add_argument("--name", default=None,
                      help="dataset name (default soulchat_r1[_dialogue]_{nothink|think}); eval: NAME_val")  # fmt: skip
    prep.add_argument("--force", action="store_true", help="replace existing output files and entries")
    prep.add_argument("--show-samples", type=int, default=0, metavar="N",
                      help="print the first N converted training samples (conversation text)")  # fmt: skip
    prep.set_defaults(_data_run=cli_prepare)

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
    stats.add_argument("--out", type=Path, default=None,
                       help="folder for data_stats.json and data_stats.png (default: "
                       "<launcher.output_root>/data-stats-<run name>)")  # fmt: skip
    stats.add_argument("--sample", type=int, default=None, metavar="N", help="measure N samples per split only")
    stats.add_argument("--workers", type=int, default=None, help="processes (default: usable CPU cores)")
    stats.add_argument("--no-plot", action="store_true", help="skip the histogram")
    stats.add_argument("--show-samples", type=int, default=0, metavar="N",
                       help="print the first N samples of each split as tokenized (conversation text)")  # fmt: skip
    stats.set_defaults(_data_run=cli_stats)


def cli_data(ns: argparse.Namespace) -> int:
    return ns._data_run(ns)


def _error(message: str, code: int = 2) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def cli_prepare(ns: argparse.Namespace) -> int:
    """``launcher data prepare``: 0 when files were written (rejects are listed), 2 on bad input."""
    from .prepare import PrepareError, prepare, summary_lines
    from .soulchat import Options

    system = ns.system
    if ns.system_file is not None:
        if system is not None:
            return _error("--system and --system-file both given; pass one")
        try:
            system = ns.system_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as err:
            return _error(f"--system-file {ns.system_file}: cannot read it ({err.__class__.__name__}); check the path")
    options = Options(reasoning=ns.reasoning, system=system, system_from_target=ns.system_from_target)
    val_size = 0.05 if ns.val_size is None else ns.val_size
    try:
        result = prepare(ns.src, ns.out, options, val_file=ns.val, val_size=val_size, seed=ns.seed, name=ns.name,
                         force=ns.force)  # fmt: skip
    except PrepareError as err:
        return _error(str(err))
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


def cli_stats(ns: argparse.Namespace) -> int:
    """``launcher data stats``: 0 when measured (warnings are printed), 2 when the config or data is unusable."""
    import time

    from ..config import ConfigError, load_run_config

    started = time.perf_counter()
    try:
        config = load_run_config(ns.config)
    except ConfigError as err:
        return _error(str(err))
    if ns.sample is not None and ns.sample < 1:
        return _error(f"--sample {ns.sample}: give a positive number of samples per split")
    from . import statsview
    from .lfdata import StatsError, load_lf_data, load_splits
    from .stats import compute_stats_with_lengths

    try:
        lfd = load_lf_data(config.llamafactory)
        result, lengths = compute_stats_with_lengths(config, sample=ns.sample, workers=ns.workers, lfd=lfd)
    except StatsError as err:
        return _error(str(err))
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
