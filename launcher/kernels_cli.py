"""``launcher validate-kernels``: arguments, the table, the JSON report (the checks are in ``launcher.kernels``)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from .kernels import DEFAULT_THRESHOLD, GRAD_NAMES, SUITES, Report, resolve_backend, validate


def add_arguments(p) -> None:
    """Arguments of ``launcher validate-kernels`` (registered in cli.VERBS)."""
    p.add_argument("--device", choices=("auto", "npu", "cuda", "cpu"), default="auto",
                   help="backend whose routed kernel to check (default: auto, the first with devices)")  # fmt: skip
    p.add_argument("--kernel", choices=("auto", "fla", "torch"), default="auto",
                   help="launcher.patches.deltanet_routing.kernel to route as (default auto)")  # fmt: skip
    p.add_argument("--suite", choices=tuple(SUITES), default=None,
                   help="quick: small shapes (default on cpu); full: model shapes incl. [1,4096,48,128] (default "
                        "on npu/cuda)")  # fmt: skip
    p.add_argument("--case", action="append", dest="cases", metavar="NAME",
                   help="run only this case (repeatable): " + ", ".join(sorted({c.name for s in SUITES.values()
                                                                                 for c in s})))  # fmt: skip
    p.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                   help=f"largest relative L2 error that passes (default {DEFAULT_THRESHOLD})")  # fmt: skip
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the report as JSON to PATH")


def _fmt(value: float | None, pct: bool = True) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "inf"
    return f"{value:.2%}" if pct else f"{value:g}"


def render(report: Report, file=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file or sys.stdout, width=160)
    if report.error:
        console.print(f"[bold red]validate-kernels: no kernel to check on {report.backend}[/]: {report.error}")
        return
    table = Table(title=f"{report.kernel} on {report.device} (bf16 vs fp32 reference, threshold "
                        f"{report.threshold:.0%})", title_justify="left")  # fmt: skip
    for col in ("case", "[B,T,H,D]", "status", "out", *(f"d{n}" for n in GRAD_NAMES), "peak GiB", "fwd+bwd ms",
                "note"):  # fmt: skip
        table.add_column(col, overflow="fold")
    style = {"pass": "green", "fail": "bold red", "skip": "dim"}
    for c in report.cases:
        shape = "x".join(map(str, c.shape)) + (f" (k:{c.key_heads})" if c.key_heads else "")
        errs = [_fmt(c.errors.get(k)) for k in ("out", *(f"d{n}" for n in GRAD_NAMES))]
        if c.errors_vs_alone:
            errs = [f"{e} / {_fmt(c.errors_vs_alone.get(k))}" for e, k in
                    zip(errs, ("out", *(f"d{n}" for n in GRAD_NAMES)), strict=True)]  # fmt: skip
        timing = "-"
        if c.timing_ms:
            timing = " vs ".join(f"{k} {v:g}" for k, v in c.timing_ms.items())
        table.add_row(c.name, shape, f"[{style[c.status]}]{c.status.upper()}[/]", *errs,
                      _fmt(c.peak_memory_gib, pct=False), timing, c.note)  # fmt: skip
    console.print(table)
    if any(c.errors_vs_alone for c in report.cases):
        console.print("varlen errors: vs the fp32 reference per sequence / vs the routed kernel per sequence")
    console.print(f"validate-kernels {'[green]PASSED[/]' if report.ok else '[bold red]FAILED[/]'}")


def cli_validate_kernels(ns) -> int:
    """``launcher validate-kernels``: 0 when every case passed (or was skipped with a reason), 1 otherwise."""
    backend = resolve_backend(ns.device)
    suite = ns.suite or ("quick" if backend == "cpu" else "full")
    report = validate(backend, kernel=ns.kernel, suite=suite, threshold=ns.threshold,
                      cases=tuple(ns.cases) if ns.cases else None)  # fmt: skip
    render(report)
    if ns.json is not None:
        from .records import write_json_atomic

        ns.json.parent.mkdir(parents=True, exist_ok=True)
        options = {"device": ns.device, "kernel": ns.kernel, "suite": suite, "cases": ns.cases,
                   "threshold": ns.threshold}  # fmt: skip
        write_json_atomic(ns.json, {**report.to_dict(), "options": options})
        print(f"report: {ns.json}", file=sys.stderr)
    return 0 if report.ok else 1
