"""The one schema of every results file in ``benchmarks/results/`` and of every ``results.json`` a benchmark writes.

A results file says what ran (``command``, ``bench``), where (``device``, ``versions``, ``commit``), when (``date``),
what each variant measured (``variants``, as the script recorded it), the flat numbers a page may quote
(``figures``: ``"<variant>.<key>"`` -> number, taken from ``variants`` and ``detail``), the targets compared
(``targets``) and everything else the script recorded (``detail``). docs/performance.md quotes ``figures`` and
``tests/benchmarks/test_results_schema.py`` holds every file to this model.

Files measured before the schema were converted once: their ``converted`` says so, and the facts they did not record
(``commit``, often ``versions``) are empty rather than guessed. A file written by a benchmark since carries all of
them (``write``).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from launcher.files import write_json_atomic

FORMAT = "bench-results/1"
REPO = Path(__file__).resolve().parent.parent
# the packages whose versions decide a figure, read from the installed distributions (none is imported)
PACKAGES = (
    "torch",
    "torch_npu",
    "triton",
    "triton-ascend",
    "fla-core",
    "transformers",
    "peft",
    "accelerate",
    "llamafactory",
    "deltanet-launcher",
)
FIGURE_DEPTH = 3  # figures are the numbers at most this deep under ``variants`` and ``detail`` (no list items)


class Results(BaseModel):
    """One benchmark's results, as written to ``results.json`` and kept in ``benchmarks/results/``."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["bench-results/1"] = FORMAT
    bench: str = Field(min_length=1, description="the script: benchmarks.patch_bench, benchmarks.lab.norm_bench, ...")
    command: str | None = Field(description="the command line that wrote the file; None only in a converted file")
    date: datetime.date = Field(description="the day it was measured (UTC)")
    device: str = Field(min_length=1, description="the accelerator's name, or 'cpu (N cores)'")
    versions: dict[str, str] = Field(description="package -> version of what ran")
    commit: str | None = Field(description="git commit of the tree that ran, '+dirty' when it had changes")
    variants: dict[str, Any] = Field(default_factory=dict, description="variant -> what it measured")
    figures: dict[str, float] = Field(default_factory=dict, description="'<path>' -> number, the quotable figures")
    targets: dict[str, Any] = Field(default_factory=dict, description="the targets compared, as the script did")
    detail: dict[str, Any] = Field(default_factory=dict, description="everything else the script recorded")
    converted: str | None = Field(default=None, description="for files from before the schema: how they were kept")

    @model_validator(mode="after")
    def _complete_unless_converted(self) -> Results:
        """A file written since the schema records its command, commit and versions; only a converted one may not."""
        if self.converted is None:
            missing = [name for name in ("command", "commit") if not getattr(self, name)]
            missing += [] if self.versions else ["versions"]
            if missing:
                raise ValueError(
                    f"a results file written by a benchmark needs {', '.join(missing)} (only a file "
                    f"converted from before the schema may lack them: set 'converted')"
                )
        return self

    @classmethod
    def read(cls, path: Path) -> Results:
        """The results file at ``path``, validated (``pydantic.ValidationError`` names what is wrong)."""
        return cls.model_validate_json(path.read_text())

    def raw(self, variants_key: str = "variants") -> dict[str, Any]:
        """The script's own record again (``build``'s inverse): ``detail`` with ``command``, the variants under
        ``variants_key`` and ``targets`` beside it."""
        return {**self.detail, "command": self.command, variants_key: self.variants, "targets": self.targets}


def figures_of(variants: dict[str, Any], detail: dict[str, Any]) -> dict[str, float]:
    """Every number (not a bool, not inside a list) at most ``FIGURE_DEPTH`` keys deep, by its dotted path:
    ``variants`` without a prefix (``on.tokens_per_s``), ``detail`` as it is (``wall_s.median``)."""
    found: dict[str, float] = {}

    def walk(node: Any, path: tuple[str, ...]) -> None:
        if isinstance(node, bool):
            return
        if isinstance(node, int | float) and path:
            found[".".join(path)] = float(node)
        elif isinstance(node, dict) and len(path) < FIGURE_DEPTH:
            for key, value in node.items():
                walk(value, (*path, str(key)))

    walk(variants, ())
    walk(detail, ())
    return found


def device_name() -> str:
    """The first accelerator's name from its management tool (no torch import, no device context made), else
    the CPU's cores: what a figure was measured on."""
    for tool, args in (("nvidia-smi", ["--query-gpu=name", "--format=csv,noheader"]), ("npu-smi", ["info", "-l"])):
        if shutil.which(tool):
            done = subprocess.run([tool, *args], capture_output=True, text=True, check=False)
            lines = [line.strip() for line in done.stdout.splitlines() if line.strip()]
            if done.returncode == 0 and lines:
                return lines[0] if tool == "nvidia-smi" else f"Ascend NPU ({lines[0]})"
    return f"cpu ({len(os.sched_getaffinity(0))} cores, {platform.machine()})"


def versions() -> dict[str, str]:
    """Python and the installed version of each of ``PACKAGES`` that is installed."""
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def commit() -> str:
    """The repository's commit, ``+dirty`` when the tree has changes; ``unknown`` outside a git checkout."""

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=False)

    head = git("rev-parse", "HEAD") if shutil.which("git") else None
    if head is None or head.returncode != 0:
        return "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    return head.stdout.strip() + ("+dirty" if dirty else "")


def build(record: dict[str, Any], *, bench: str, variants_key: str = "variants") -> Results:
    """A benchmark's own record as a ``Results``: its ``command``, its ``variants_key`` and ``targets`` lifted out,
    the rest kept in ``detail``; date, device, versions and commit read from this machine now."""
    detail = json.loads(json.dumps(record, default=str))  # paths and the like as the scripts always wrote them
    command = detail.pop("command")
    variants = detail.pop(variants_key, None) or {}
    targets = detail.pop("targets", None) or {}
    return Results(
        bench=bench,
        command=command,
        date=datetime.datetime.now(datetime.UTC).date(),
        device=device_name(),
        versions=versions(),
        commit=commit(),
        variants=variants,
        figures=figures_of(variants, detail),
        targets=targets,
        detail=detail,
    )


def write(path: Path, record: dict[str, Any], *, bench: str, variants_key: str = "variants") -> Results:
    """``build`` the record and write it to ``path`` atomically; returns what was written."""
    results = build(record, bench=bench, variants_key=variants_key)
    write_json_atomic(path, results.model_dump(mode="json"))
    return results
