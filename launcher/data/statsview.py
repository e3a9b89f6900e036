"""How ``launcher data stats`` shows its numbers: a terminal table, ``data_stats.json`` and a histogram PNG."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from launcher.files import write_bytes_atomic, write_json_atomic
from launcher.state.runs import DATA_STATS

PLOT_FILE = "data_stats.png"


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:,}" if isinstance(value, int) else str(value)


def table_rows(result: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """(metric, one cell per split) rows of the table."""
    splits = list(result["splits"].values())
    rows: list[tuple[str, list[str]]] = [
        ("samples", [_fmt(s["samples"]) for s in splits]),
        ("dropped (invalid turns)", [_fmt(s["dropped_invalid"]) for s in splits]),
        ("length mean", [_fmt(s["length"]["mean"]) for s in splits]),
    ]
    for key in ("p50", "p90", "p95", "p99", "max"):
        rows.append((f"length {key}", [_fmt(s["length"][key]) for s in splits]))
    rows += [
        (
            f"over cutoff_len {result['cutoff_len']}",
            [f"{_fmt(s['truncated']['count'])} ({s['truncated']['share']:.2%})" for s in splits],
        ),
        ("supervised tokens before", [_fmt(s["supervised_tokens"]["before"]) for s in splits]),
        (
            "supervised tokens after",
            [f"{_fmt(s['supervised_tokens']['after'])} (-{s['supervised_tokens']['lost_share']:.2%})" for s in splits],
        ),
        ("no supervised token left", [_fmt(s["no_supervised"]["after"]) for s in splits]),
    ]
    return rows


def render_table(result: dict[str, Any]) -> None:
    """Print the statistics as a table (rich), then warnings and notes."""
    from rich.console import Console
    from rich.table import Table

    sampled = f", sample of {result['sampled']} per split" if result.get("sampled") else ""
    table = Table(title=f"tokens after template {result['template']} (cutoff_len {result['cutoff_len']}{sampled})")
    table.add_column("metric")
    for name in result["splits"]:
        table.add_column(name, justify="right")
    for metric, cells in table_rows(result):
        table.add_row(metric, *cells)
    console = Console()
    console.print(table)
    for line in result.get("warnings", []):
        console.print(f"[yellow]warning:[/] {line}", highlight=False)
    for line in result.get("notes", []):
        console.print(f"note: {line}", highlight=False)


def write_json(result: dict[str, Any], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / DATA_STATS
    write_json_atomic(path, result)
    return path


def write_histogram(result: dict[str, Any], lengths: dict[str, Any], out: Path) -> Path:
    """One histogram of untruncated lengths per split, with cutoff_len and p99 marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in result["splits"] if len(lengths.get(n, ())) > 0]
    fig, axes = plt.subplots(len(names) or 1, 1, figsize=(8, 3 * max(1, len(names))), squeeze=False)
    cutoff = result["cutoff_len"]
    for ax, name in zip(axes[:, 0], names, strict=False):
        values = lengths[name]
        ax.hist(values, bins=min(80, max(10, len(values) // 20)), color="#4878a8")
        ax.axvline(cutoff, color="#c0392b", linestyle="--", label=f"cutoff_len {cutoff}")
        p99 = result["splits"][name]["length"]["p99"]
        ax.axvline(p99, color="#7f8c8d", linestyle=":", label=f"p99 {p99}")
        split = result["splits"][name]
        share, lost = split["truncated"]["share"], split["supervised_tokens"]["lost_share"]
        none_left = split["no_supervised"]["after"]
        ax.set_title(
            f"{name}: {len(values)} samples, {share:.1%} over cutoff_len; supervised tokens lost "
            f"{lost:.1%}" + (f", {none_left} sample(s) with none left" if none_left else "")
        )
        ax.set_xlabel("tokens after template (untruncated)")
        ax.set_ylabel("samples")
        ax.legend()
    fig.tight_layout()
    path = out / PLOT_FILE
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    write_bytes_atomic(path, buffer.getvalue())
    return path


def print_samples(lfd: Any, samples_by_split: dict[str, list], count: int) -> None:
    """``--show-samples``: the first ``count`` samples of each split as the model sees them (text!)."""
    from llamafactory.extras.constants import IGNORE_INDEX

    from launcher.data.stats import _Measurer

    measurer = _Measurer(lfd)
    for name, samples in samples_by_split.items():
        _, kept = measurer.measure(samples[:count], keep_ids=True)
        for i, pair in enumerate(kept):
            print(f"--- {name}[{i}] ---")
            if pair is None:
                print("(dropped by LLaMA-Factory: invalid turn structure)")
                continue
            ids, labels = pair
            print(f"input ({len(ids)} tokens):\n{lfd.tokenizer.decode(ids, skip_special_tokens=False)}")
            supervised = [t for t in labels if t != IGNORE_INDEX]
            print(
                f"supervised ({len(supervised)} tokens):\n{lfd.tokenizer.decode(supervised, skip_special_tokens=False)}"
            )
