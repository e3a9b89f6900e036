"""Preflight checks of the data and the output folder (rows ``dataset`` and ``output``).

``check_dataset`` reads LLaMA-Factory's ``dataset_info.json`` the way LLaMA-Factory does (``file_name``,
``formatting``, ``columns``) but only as far as a preflight needs: every named dataset is registered, its
file is present and non-empty, the first record has the mapped columns, and a ``nothink`` set holds no
``<think>``. ``check_output`` probes the output root without creating it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

Row = tuple[str, str, str]  # name, status, detail
MIN_FREE_GIB = {"formal": 10.0, "smoke": 0.5}


def _dataset_names(lf: dict[str, Any]) -> list[str]:
    return [n.strip() for key in ("dataset", "eval_dataset") for n in str(lf.get(key) or "").split(",") if n.strip()]


def _first_record(path: Path) -> Any:
    if path.suffix == ".jsonl":
        with open(path) as f:
            return json.loads(next((ln for ln in f if ln.strip()), "null"))
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        if not isinstance(data, list) or not data:
            raise ValueError("expected a non-empty JSON list of records")
        return data[0]
    return None  # other formats (parquet, csv, folders): presence only


def _required_columns(entry: dict[str, Any]) -> list[str]:
    columns = entry.get("columns") or {}
    if entry.get("formatting", "alpaca") == "sharegpt":
        return [columns.get("messages", "conversations")]
    return [columns.get("prompt", "instruction"), columns.get("response", "output")]


def check_dataset(lf: dict[str, Any]) -> Row:
    dataset_dir = Path(str(lf.get("dataset_dir", "data")))
    info_path = dataset_dir / "dataset_info.json"
    names = _dataset_names(lf)
    if not names:
        return "dataset", "fail", "no dataset named (set dataset: in the config)"
    try:
        info = json.loads(info_path.read_text())
    except FileNotFoundError:
        return "dataset", "fail", f"{info_path} is missing; register the datasets there (LLaMA-Factory format)"
    except (OSError, json.JSONDecodeError) as err:
        return "dataset", "fail", f"{info_path} is unreadable: {err}"
    problems, seen = [], []
    for name in names:
        entry = info.get(name)
        if not isinstance(entry, dict):
            problems.append(
                f"{name}: not registered in {info_path.name} (registered: {', '.join(sorted(info)) or 'none'})"
            )
            continue
        file_name = entry.get("file_name")
        if not file_name:
            problems.append(f"{name}: no file_name (remote datasets are not downloaded here)")
            continue
        path = dataset_dir / file_name
        if not path.exists():
            problems.append(f"{name}: {path} is missing")
            continue
        if path.is_file() and path.stat().st_size == 0:
            problems.append(f"{name}: {path} is empty")
            continue
        try:
            record = _first_record(path) if path.is_file() else None
        except (OSError, ValueError) as err:
            problems.append(f"{name}: {path.name} is not readable JSON ({err})")
            continue
        if isinstance(record, dict):
            missing = [c for c in _required_columns(entry) if c not in record]
            if missing:
                problems.append(f"{name}: first record lacks column(s) {missing} (check 'columns' in {info_path.name})")
                continue
        if "nothink" in name and path.is_file() and path.stat().st_size < 2 << 30 and b"<think>" in path.read_bytes():
            problems.append(f"{name}: contains '<think>' although it is a no-think dataset")
            continue
        seen.append(f"{name} ({path.name})")
    if problems:
        return "dataset", "fail", "; ".join(problems)
    return "dataset", "ok", f"{', '.join(seen)} registered in {info_path}"


def check_output(output_root: Path, smoke: bool) -> Row:
    probe = output_root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return "output", "fail", f"{output_root}: {probe} is not a folder"
    try:
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".preflight-"):
            pass
    except OSError as err:
        return "output", "fail", f"{output_root} is not writable ({err}); mount the outputs volume read-write"
    free = shutil.disk_usage(probe).free / 2**30
    default = MIN_FREE_GIB["smoke" if smoke else "formal"]
    need = float(os.environ.get("LAUNCHER_MIN_FREE_GIB", default))
    detail = f"{output_root}: writable, {free:.1f} GiB free (need {need:g})"
    if free < need:
        return "output", "fail", detail + "; free space or point launcher.output_root elsewhere"
    return "output", "ok", detail
