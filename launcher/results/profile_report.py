"""The profile of a run, all ranks together: ``profile.json`` and ``profile.md`` (``launcher profile``).

Reads ``RUN_DIR/profile/rank<R>.json`` (written by each rank, ``launcher/rank/profiling.py``): per profiled step the
seconds of each part and the step's own measured period. For each rank it reports the mean of each part over
the profiled steps, their sum against the measured step time (the check: within 10 %, or the summary says how
much is unaccounted), the first step against the warm-up steps after it and the profiled ones, with the host's
time inside Triton's compile and autotune calls in each (timed in every step, so also before the profiled
window, where the cold compiles land), the distinct sequence lengths; across ranks the spread of step times
(the slowest rank sets the pace of every collective, so the others wait). Host-side: no torch.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from launcher.files import read_json_bounded, write_json_atomic, write_text_atomic
from launcher.state.runs import PROFILE_ASCEND, PROFILE_DIR, PROFILE_JSON, PROFILE_MD, PROFILE_RECORD, PROFILE_TRACE

PARTS = (
    "deltanet",
    "glue",
    "attention",
    "matmul",
    "other_compute",
    "communication",
    "optimizer",
    "data_loading",
    "optimizer_host",
    "compile_autotune",
    "host_gaps",
)
LABELS = {
    "deltanet": "DeltaNet kernels",
    "glue": "conv, norms, SwiGLU kernels",
    "attention": "attention",
    "matmul": "matmul",
    "other_compute": "other compute",
    "communication": "communication",
    "optimizer": "optimizer (device)",
    "data_loading": "data loading (device idle)",
    "optimizer_host": "optimizer (host, device idle)",
    "compile_autotune": "kernel compile / autotune",
    "host_gaps": "other host-side gaps (device idle)",
}
TOLERANCE = 0.10


def rank_summary(record: dict[str, Any]) -> dict[str, Any]:
    """One rank: mean seconds per part over the profiled steps, the measured step time, and the check."""
    steps = record.get("profiled_steps") or []
    measured = [p["seconds"] for p in record.get("periods", []) if p.get("profiled")]
    parts = {k: statistics.fmean(s.get(k, 0.0) for s in steps) for k in PARTS} if steps else {}
    accounted = sum(parts.values()) - (statistics.fmean(s.get("overlap", 0.0) for s in steps) if steps else 0.0)
    step_s = statistics.fmean(measured) if measured else None
    share = None if not step_s else accounted / step_s
    return {
        "rank": record.get("rank"),
        "profiled_steps": len(steps),
        "step_s": None if step_s is None else round(step_s, 6),
        "parts_s": {k: round(v, 6) for k, v in parts.items()},
        "accounted_s": round(accounted, 6),
        "accounted_share": None if share is None else round(share, 4),
        "adds_up": share is not None and abs(share - 1) <= TOLERANCE,
        "first_step": first_step_summary(record.get("periods", [])),
        # what the rank itself worked: the step minus its time in collectives (where it waited for others)
        "work_s": None if step_s is None else round(step_s - parts.get("communication", 0.0), 6),
        "seq_lens": record.get("seq_lens", []),
        "backend": record.get("backend"),
        "other_compute_top": record.get("other_compute_top") or [],
    }


def _median(periods: list[dict[str, Any]], key: str) -> float | None:
    values = [p[key] for p in periods if p.get(key) is not None]
    return round(statistics.median(values), 6) if values else None


def first_step_summary(periods: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first step (Triton compiles and autotunes, allocator warm-up) against the later ones.

    Args:
        periods: the rank's steps in order, each with ``seconds`` on the rank's clock, ``profiled`` and (from
            ``launcher/rank/profiling.py``'s ``TRITON_CLOCK``) ``compile_autotune_s``, ``compiles``, ``autotunes``.

    Returns:
        None without steps; else the first step's seconds and compile/autotune seconds and counts, the median
        of the unprofiled warm-up steps after it and of the profiled steps (each with its compile/autotune
        median), and how much longer the first step was than the profiled median. The profiled steps carry
        the profiler's own overhead, the warm-up steps do not.
    """
    if not periods:
        return None
    first = periods[0]
    warmup = [p for p in periods[1:] if not p.get("profiled")]
    profiled = [p for p in periods if p.get("profiled")]
    later_s = _median(profiled, "seconds")
    excess = None if later_s is None else round(first["seconds"] - later_s, 6)
    compile_s = first.get("compile_autotune_s")
    return {
        "step": first.get("step"),
        "profiled": bool(first.get("profiled")),
        "seconds": round(first["seconds"], 6),
        "compile_autotune_s": compile_s,
        "compiles": first.get("compiles"),
        "autotunes": first.get("autotunes"),
        "warmup_after": {
            "steps": len(warmup),
            "median_s": _median(warmup, "seconds"),
            "compile_autotune_median_s": _median(warmup, "compile_autotune_s"),
        },
        "profiled_steps": {
            "steps": len(profiled),
            "median_s": later_s,
            "compile_autotune_median_s": _median(profiled, "compile_autotune_s"),
        },
        "excess_over_profiled_s": excess,
        # how much of the first step's extra time Triton's compile and autotune calls explain
        "compile_share_of_excess": round(compile_s / excess, 4) if compile_s is not None and excess else None,
    }


def build_report(run_dir: Path) -> dict[str, Any]:
    """Every rank's summary, and the spread of step times across ranks."""
    records = []
    found = [p for p in (run_dir / PROFILE_DIR).glob(PROFILE_RECORD.format(rank="*")) if p.stem[4:].isdigit()]
    for path in sorted(found, key=lambda p: int(p.stem[4:])):
        try:
            record = read_json_bounded(path)
        except (OSError, ValueError):  # files.Unreadable is a ValueError
            continue
        if isinstance(record, dict):
            records.append(record)
    ranks = []
    for record in records:
        try:
            ranks.append(rank_summary(record))
        except (AttributeError, KeyError, TypeError, ValueError, statistics.StatisticsError):
            continue  # a damaged rank record: that rank is left out, as an unreadable one is
    times = [r["work_s"] for r in ranks if r["work_s"] is not None]
    spread = None
    if len(times) > 1:  # collectives make every rank's step as long as the slowest's: compare the work
        spread = {
            "fastest_s": min(times),
            "slowest_s": max(times),
            "spread_s": round(max(times) - min(times), 6),
            "spread_share": round((max(times) - min(times)) / max(times), 4),
        }
    traces = sorted(str(p.relative_to(run_dir)) for p in (run_dir / PROFILE_DIR).glob(PROFILE_TRACE.format(rank="*")))
    traces += sorted(str(p.relative_to(run_dir)) for p in (run_dir / PROFILE_DIR).glob(PROFILE_ASCEND.format(rank="*")))
    return {
        "run_dir": str(run_dir),
        "ranks": ranks,
        "spread_across_ranks": spread,
        "traces": traces,
        "tolerance": TOLERANCE,
    }


def render(report: dict[str, Any]) -> str:
    """``profile.md``: a table of parts per rank, the check, the first step, the spread, the lengths."""
    ranks = report["ranks"]
    if not ranks:
        return "# Profile\n\nNo rank wrote a profile (did the run reach the profiled steps?).\n"
    head = "| part | " + " | ".join(f"rank {r['rank']}" for r in ranks) + " |"
    lines = [
        "# Profile",
        "",
        f"Mean seconds per profiled step ({ranks[0]['profiled_steps']} steps after the "
        "warm-up), per rank. Device parts are the device's own kernels (on CPU: operators); the idle "
        "parts are when no device work ran, by what the host was doing.",
        "",
        head,
        "|---|" + "---|" * len(ranks),
    ]
    for part in PARTS:
        cells = [f"{r['parts_s'].get(part, 0.0):.4f}" for r in ranks]
        lines.append(f"| {LABELS[part]} | " + " | ".join(cells) + " |")
    lines.append("| **parts, overlap counted once** | " + " | ".join(f"{r['accounted_s']:.4f}" for r in ranks) + " |")
    lines.append("| **measured step** | " + " | ".join(f"{r['step_s'] or 0:.4f}" for r in ranks) + " |")
    lines.append("")
    for r in ranks:
        share = r["accounted_share"]
        verdict = (
            f"the parts add up to {share:.1%} of the measured step (within {TOLERANCE:.0%})"
            if r["adds_up"]
            else f"the parts add up to {share:.1%} of the measured step: {abs(1 - share):.1%} is "
            f"{'unaccounted' if share < 1 else 'counted twice (overlapping work)'}"
            if share is not None
            else "no measured step"
        )
        lengths = ", ".join(map(str, r["seq_lens"])) or "-"
        lines.append(f"- rank {r['rank']}: {verdict}; sequence lengths seen: {lengths}.")
    spread = report.get("spread_across_ranks")
    if spread:
        lines.append(
            f"- across ranks: work per step (the step minus time in collectives) from {spread['fastest_s']:.3f} s to "
            f"{spread['slowest_s']:.3f} s; the faster ranks wait {spread['spread_s']:.3f} s "
            f"({spread['spread_share']:.1%} of the slowest) in each step's collectives for the slowest."
        )
    lines += _render_first_step(ranks)
    top = ranks[0].get("other_compute_top")
    if top:
        lines += ["", f"Largest kernels in other compute, rank {ranks[0]['rank']} (ms per profiled step):", ""]
        for t in top:
            lines.append(f"- {t['ms_per_step']:.1f} ms `{t['kernel']}`")
            lines += [f"  - {c['ms_per_step']:.1f} ms launched by `{c['ops']}`" for c in t.get("launched_by", ())]
        lines.append("")
    if report.get("traces"):
        lines.append(
            f"- traces: {', '.join(report['traces'])} (Chrome trace: chrome://tracing or ui.perfetto.dev; "
            "an `.ascend` folder: MindStudio Insight)."
        )
    return "\n".join(lines) + "\n"


def _render_first_step(ranks: list[dict[str, Any]]) -> list[str]:
    """The first step against the later ones, one column per rank (``first_step_summary``)."""
    firsts = [r.get("first_step") or {} for r in ranks]
    if not any(firsts):
        return []

    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    def row(label: str, cell) -> str:
        return f"| {label} | " + " | ".join(cell(f) if f else "-" for f in firsts) + " |"

    steps = {f["profiled_steps"]["steps"] for f in firsts if f}
    return [
        "",
        "## The first step against the later ones",
        "",
        "Seconds on each rank's clock (device synchronised). Kernel compile / autotune is the host's time "
        "inside Triton's compile and autotuner calls, timed in every step (profiled or not); the profiled "
        f"steps ({', '.join(map(str, sorted(steps)))} per rank) carry the profiler's own overhead, the "
        "warm-up steps do not.",
        "",
        "| | " + " | ".join(f"rank {r['rank']}" for r in ranks) + " |",
        "|---|" + "---|" * len(ranks),
        row(
            "first step" + (" (profiled)" if any(f.get("profiled") for f in firsts) else ""),
            lambda f: seconds(f["seconds"]),
        ),
        row("kernel compile / autotune in the first step", lambda f: seconds(f["compile_autotune_s"])),
        row(
            "Triton compiles / autotuner runs in it",
            lambda f: f"{f['compiles']} / {f['autotunes']}" if f["compiles"] is not None else "-",
        ),
        row("warm-up steps after it, median", lambda f: seconds(f["warmup_after"]["median_s"])),
        row("profiled steps, median", lambda f: seconds(f["profiled_steps"]["median_s"])),
        row(
            "kernel compile / autotune in a profiled step, median",
            lambda f: seconds(f["profiled_steps"]["compile_autotune_median_s"]),
        ),
        row("**first step minus the profiled median**", lambda f: seconds(f["excess_over_profiled_s"])),
        row(
            "share of that explained by compile / autotune",
            lambda f: "-" if f["compile_share_of_excess"] is None else f"{f['compile_share_of_excess']:.0%}",
        ),
    ]


def write_report(run_dir: Path) -> dict[str, Any]:
    """Build, write ``profile.json`` and ``profile.md`` into ``run_dir``, and return the report."""
    report = build_report(run_dir)
    write_json_atomic(run_dir / PROFILE_JSON, report)
    write_text_atomic(run_dir / PROFILE_MD, render(report))
    return report
