"""Preflight checks of the data and the output folder (rows ``dataset`` and ``output``).

``check_dataset`` reads LLaMA-Factory's ``dataset_info.json`` the way LLaMA-Factory does (``file_name``,
``formatting``, ``columns``, ``tags``; ``llamafactory/data/parser.py``): every named dataset is registered,
its file is present and non-empty, every record of a ``.json``/``.jsonl`` file has the mapped columns with
the right types (a bad record is named by file, index and field, never by its text), and a ``nothink``
set holds no ``<think>``. ``check_output`` probes the output root without creating it.
"""

from __future__ import annotations

import difflib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Row = tuple[str, str, str]  # name, status, detail
MIN_FREE_GIB = {"formal": 10.0, "smoke": 0.5}


def dataset_names(lf: dict[str, Any]) -> list[str]:
    return [n.strip() for key in ("dataset", "eval_dataset") for n in str(lf.get(key) or "").split(",") if n.strip()]


def no_dataset(lf: dict[str, Any]) -> str:
    """The problem of a config that names no dataset: which key, and the fix."""
    info = Path(str(lf.get("dataset_dir", "data"))) / "dataset_info.json"
    return f"dataset: no dataset named; set dataset: to the name of a dataset registered in {info} (several: a,b)"


@dataclass(frozen=True)
class Columns:
    """How one dataset's records are laid out (``dataset_info.json``: formatting, columns, tags)."""

    formatting: str
    text: tuple[str, ...]  # required text columns
    optional: tuple[str, ...]  # text columns that may be missing or null
    messages: str | None = None  # sharegpt: the list of turns
    role_tag: str = "from"
    content_tag: str = "value"
    response: str | None = None  # alpaca: the reply column

    @classmethod
    def of(cls, entry: dict[str, Any]) -> Columns:
        columns, tags = entry.get("columns") or {}, entry.get("tags") or {}
        if entry.get("formatting", "alpaca") == "sharegpt":
            return cls(
                "sharegpt",
                (),
                (columns.get("system", "system"), columns.get("tools", "tools")),
                messages=columns.get("messages", "conversations"),
                role_tag=tags.get("role_tag", "from"),
                content_tag=tags.get("content_tag", "value"),
            )
        prompt, response = columns.get("prompt", "instruction"), columns.get("response", "output")
        return cls(
            "alpaca",
            (prompt, response),
            (columns.get("query", "input"), columns.get("system", "system")),
            response=response,
        )


def _record_problem(record: Any, cols: Columns) -> str | None:
    """The first field of ``record`` that does not fit ``cols`` (the field's name only, never its text)."""
    if not isinstance(record, dict):
        return f"is a {type(record).__name__}, not an object"
    for name in cols.text:
        if name not in record:
            return f"lacks column {name!r}"
        if not isinstance(record[name], str):
            return f"{name!r} is a {type(record[name]).__name__}, not text"
    for name in cols.optional:
        if record.get(name) is not None and not isinstance(record[name], str):
            return f"{name!r} is a {type(record[name]).__name__}, not text"
    if cols.messages is not None:
        turns = record.get(cols.messages)
        if not isinstance(turns, list) or not turns:
            return f"{cols.messages!r} is not a non-empty list of turns"
        for number, turn in enumerate(turns):
            if (
                not isinstance(turn, dict)
                or not isinstance(turn.get(cols.content_tag), str)
                or not isinstance(turn.get(cols.role_tag), str)
            ):
                return f"{cols.messages}[{number}] lacks text {cols.role_tag!r}/{cols.content_tag!r}"
    if cols.response is not None and "history" in record:
        history = record["history"]
        if not isinstance(history, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in history
        ):
            return "'history' is not a list of [client, counselor] text pairs"
    return None


def read_records(path: Path) -> list[Any] | None:
    """Every record of a ``.json`` (a list) or ``.jsonl`` file; None for formats read here by presence only.

    Raises:
        ValueError: the file is not JSON of that shape (the message says where).
    """
    if path.suffix == ".jsonl":
        records = []
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if line.strip():
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError as err:
                        raise ValueError(f"line {number} is not JSON ({err.msg})") from None
        return records
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"not JSON ({err.msg} at line {err.lineno})") from None
        if not isinstance(data, list):
            raise ValueError(f"expected a JSON list of records, found a {type(data).__name__}")
        return data
    return None  # parquet, csv, folders: LLaMA-Factory reads them; checked for presence only


def _registered(lf: dict[str, Any]) -> tuple[Path, dict[str, Any] | str]:
    dataset_dir = Path(str(lf.get("dataset_dir", "data")))
    info_path = dataset_dir / "dataset_info.json"
    try:
        info = json.loads(info_path.read_text())
    except FileNotFoundError:
        return info_path, f"{info_path} is missing; register the datasets there (LLaMA-Factory format)"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return info_path, f"{info_path} is unreadable: {err}"
    return info_path, info if isinstance(info, dict) else f"{info_path} does not hold a JSON object"


def _dataset_files(lf: dict[str, Any]) -> tuple[list[str], list[tuple[str, Path, Columns]]]:
    """Problems, and (name, file, columns) of each named dataset that is registered and present."""
    names = dataset_names(lf)
    if not names:
        return [no_dataset(lf)], []
    info_path, info = _registered(lf)
    if isinstance(info, str):
        return [info], []
    problems, found = [], []
    for name in names:
        entry = info.get(name)
        if not isinstance(entry, dict):
            close = difflib.get_close_matches(name, list(info), n=3)
            problems.append(
                f"{name}: not registered in {info_path}"
                + (
                    f" (close names: {', '.join(close)})"
                    if close
                    else f" (registered: {', '.join(sorted(info)) or 'none'})"
                )
            )
            continue
        file_name = entry.get("file_name")
        if not file_name:
            problems.append(f"{name}: no file_name in {info_path.name} (remote datasets are not downloaded here)")
            continue
        path = info_path.parent / file_name
        if not path.exists():
            problems.append(f"{name}: {path} is missing")
        elif path.is_file() and path.stat().st_size == 0:
            problems.append(f"{name}: {path} is empty")
        else:
            found.append((name, path, Columns.of(entry)))
    return problems, found


def dataset_records(lf: dict[str, Any], shown: int = 3) -> tuple[list[str], list[str]]:
    """Every record of every named dataset against its declared columns and types.

    Returns:
        Problems (each naming the dataset, the file, the index and the field of the first bad records;
        never their text) and a line per dataset that passed.
    """
    problems, found = _dataset_files(lf)
    seen = []
    for name, path, cols in found:
        try:
            records = read_records(path) if path.is_file() else None
        except (OSError, UnicodeDecodeError, ValueError) as err:
            problems.append(f"{name}: {path} {err}")
            continue
        if records is None:
            seen.append(f"{name} ({path.name}, not read: {path.suffix or 'folder'})")
            continue
        if not records:
            problems.append(f"{name}: {path} holds no record")
            continue
        bad = [(i, why) for i, r in enumerate(records) if (why := _record_problem(r, cols)) is not None]
        if bad:
            listed = "; ".join(f"record {i} {why}" for i, why in bad[:shown])
            problems.append(
                f"{name}: {len(bad)} of {len(records)} records in {path} do not fit its {cols.formatting} "
                f"columns: {listed} (fix the file or 'columns' in dataset_info.json)"
            )
            continue
        if "nothink" in name and think_share(records, cols) > 0:
            problems.append(f"{name}: contains '<think>' although it is a no-think dataset")
            continue
        seen.append(f"{name} ({path.name}, {len(records)} records)")
    return problems, seen


def think_share(records: list[Any], cols: Columns) -> float:
    """The share of records whose reply holds ``<think>`` reasoning."""

    def replies(record: dict[str, Any]) -> list[str]:
        if cols.response is not None:
            return [str(record.get(cols.response) or "")] + [str(p[1]) for p in record.get("history") or []]
        return [str(t.get(cols.content_tag) or "") for t in record.get(cols.messages or "") or []]

    hits = sum(any("<think>" in r for r in replies(record)) for record in records if isinstance(record, dict))
    return hits / len(records) if records else 0.0


def dataset_think_share(lf: dict[str, Any]) -> dict[str, float]:
    """Per named dataset that can be read, the share of its records with ``<think>`` in a reply."""
    _, found = _dataset_files(lf)
    shares = {}
    for name, path, cols in found:
        try:
            records = read_records(path) if path.is_file() else None
        except (OSError, UnicodeDecodeError, ValueError):
            continue
        if records:
            shares[name] = think_share(records, cols)
    return shares


def held_out_problems(lf: dict[str, Any]) -> list[str]:
    """A named train or eval dataset that is a held-out test split of ``launcher data prepare`` (its file, or
    a file with the same sha256, as recorded in any ``*.prepare.json`` of the dataset folder)."""
    from launcher.files import sha256_file

    dataset_dir = Path(str(lf.get("dataset_dir", "data")))
    held: dict[str, tuple[str, Path]] = {}  # sha256 -> (test file name, record)
    for record_path in dataset_dir.glob("*.prepare.json") if dataset_dir.is_dir() else ():
        try:
            test = (json.loads(record_path.read_text(encoding="utf-8")) or {}).get("test")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            continue
        if isinstance(test, dict) and test.get("sha256"):
            held[test["sha256"]] = (str(test.get("file")), record_path)
    if not held:
        return []
    _, found = _dataset_files(lf)
    problems = []
    for name, path, _cols in found:
        digest = sha256_file(path) if path.is_file() else None
        if digest in held:
            test_file, record_path = held[digest]
            problems.append(
                f"{name}: {path} is the held-out test split {test_file} ({record_path.name}); it must "
                "not train or evaluate: name the train and validation datasets instead"
            )
    return problems


MEDIA_COLUMNS = ("images", "videos")


def dataset_media(lf: dict[str, Any]) -> dict[str, Any]:
    """How many records of the named datasets (train and eval) carry an image or a video.

    LLaMA-Factory reads media only from the columns ``dataset_info.json`` maps (``columns.images``,
    ``columns.videos``; ``data/parser.py``), so a dataset without such a column holds none, unread. A mapped
    column is counted record by record.

    Returns:
        ``{"counted": True, "images": n, "videos": n, "datasets": [...], "records": n}`` (``records``: those
        read to count), or ``{"counted": False, "why": ...}`` when a dataset cannot be read here.
    """
    problems, found = _dataset_files(lf)
    if problems:
        return {"counted": False, "why": "; ".join(problems)}
    _, info = _registered(lf)
    counts: dict[str, Any] = {
        "counted": True,
        "images": 0,
        "videos": 0,
        "records": 0,
        "datasets": [name for name, _, _ in found],
    }
    for name, path, _cols in found:
        columns = (info.get(name) or {}).get("columns") or {}  # type: ignore[union-attr]
        mapped = {kind: columns[kind] for kind in MEDIA_COLUMNS if columns.get(kind)}
        if not mapped:
            continue
        try:
            records = read_records(path) if path.is_file() else None
        except (OSError, UnicodeDecodeError, ValueError) as err:
            return {"counted": False, "why": f"{name}: {path} {err}"}
        if records is None:
            return {"counted": False, "why": f"{name}: {path.name} maps {', '.join(mapped)} and is not read here"}
        counts["records"] += len(records)
        for kind, column in mapped.items():
            counts[kind] += sum(1 for r in records if isinstance(r, dict) and r.get(column))
    return counts


def check_dataset(lf: dict[str, Any]) -> Row:
    """The ``dataset`` row: every named dataset registered, present, and every record fitting its columns."""
    problems, seen = dataset_records(lf)
    if problems:
        return "dataset", "fail", "; ".join(problems)
    return "dataset", "ok", f"{', '.join(seen)} registered in {Path(str(lf.get('dataset_dir', 'data')))}"


def check_output(output_root: Path, smoke: bool) -> Row:
    probe = output_root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return "output", "fail", f"{output_root}: {probe} is not a folder; point launcher.output_root at a folder"
    try:
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".preflight-"):
            pass
    except OSError as err:
        return (
            "output",
            "fail",
            (
                f"{output_root} is not writable ({err}); mount the outputs volume read-write or "
                "point launcher.output_root at a writable folder"
            ),
        )
    free = shutil.disk_usage(probe).free / 2**30
    default = MIN_FREE_GIB["smoke" if smoke else "formal"]
    need = float(os.environ.get("LAUNCHER_MIN_FREE_GIB", default))
    detail = f"{output_root}: writable, {free:.1f} GiB free (need {need:g})"
    if free < need:
        return "output", "fail", detail + "; free space or point launcher.output_root elsewhere"
    return "output", "ok", detail
