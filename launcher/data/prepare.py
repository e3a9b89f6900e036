"""``launcher data prepare``: SoulChat-R1 files to LLaMA-Factory data files, a split, and a rejects file.

Writes into ``--out DIR`` (``NAME`` defaults to ``soulchat_r1[_dialogue]_{nothink|think}``)::

    NAME.json              training samples
    NAME_val.json          validation samples (when there are any)
    NAME.rejects.jsonl     one line per malformed record: source file, index, kind, reason (no text)
    NAME.prepare.json      counts, options, seed, source checksums: how to reproduce the files
    dataset_info.json      LLaMA-Factory registration of NAME and NAME_val (other entries are kept)

The split is deterministic for a seed and keeps every sample of one conversation on the same side
(``soulchat.conversation_key``); ``--val FILE`` uses the user's own validation file instead. Nothing
is overwritten without ``force``, and no conversation text is printed unless ``show_samples`` asks.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.data import soulchat
from launcher.data.soulchat import Kind, Options, Rejected
from launcher.errors import LauncherError
from launcher.files import default_mode, read_json_object, sha256_file, write_text_atomic

INFO_FILE = "dataset_info.json"


class PrepareError(LauncherError):
    """Bad input or a refused overwrite; the message says what, shows the value, and how to fix it."""


@dataclass
class Converted:
    """The samples of one source file, with its rejects and their source indices."""

    source: Path
    kind: Kind
    records: int
    samples: list[dict[str, Any]] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    rejects: list[dict[str, Any]] = field(default_factory=list)


def read_records(path: Path) -> list[Any]:
    """Read a JSON array (or JSON Lines) file of records.

    Raises:
        PrepareError: missing file, invalid JSON or not an array; the message never quotes the data.
    """
    if not path.is_file():
        hint = "check the path" if path.exists() else "download it from the SoulChat-R1 release or check the path"
        raise PrepareError(f"source file not found: {path} ({hint})")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise PrepareError(f"cannot read {path}: {err.__class__.__name__} (expected UTF-8 JSON)") from err
    if path.suffix == ".jsonl":
        records = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise PrepareError(
                        f"{path} line {number} is not valid JSON ({err.msg}, column {err.colno})"
                    ) from err
        return records
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise PrepareError(
            f"{path} is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno}); the SoulChat-R1 "
            "files are JSON arrays of records (use .jsonl for one record per line)"
        ) from err
    if not isinstance(data, list):
        raise PrepareError(f"{path} holds a JSON {type(data).__name__}; expected an array of records")
    return data


def convert_file(path: Path, options: Options, kind: Kind | None = None) -> Converted:
    """Read and convert one SoulChat-R1 file; malformed records become rejects, never exceptions."""
    records = read_records(path)
    if not records:
        raise PrepareError(f"{path} holds no records")
    found = soulchat.detect_kind(records)
    if found is None:
        first = next((r for r in records if isinstance(r, dict)), None)
        keys = sorted(first) if first else []
        raise PrepareError(
            f"{path} does not look like a SoulChat-R1 file (first record's keys: {keys}); expected "
            "catch_mdpcot.json (instruction, output, history) or catch_dialogue.json (conversation)"
        )
    if kind is not None and found != kind:
        raise PrepareError(f"{path} is a {found} file but the training file is {kind}; give files of one kind")
    if options.system_from_target and found != "dialogue":
        raise PrepareError(f"--system-from-target needs catch_dialogue.json; {path} is the {found} file")
    out = Converted(source=path, kind=found, records=len(records))
    for index, record in enumerate(records):
        try:
            sample = soulchat.convert(found, record, options)
        except Rejected as err:
            out.rejects.append({"source": path.name, "index": index, "kind": err.kind, "reason": err.reason})
            continue
        out.samples.append(sample)
        out.keys.append(soulchat.conversation_key(found, record, sample))
    return out


def split_by_conversation(keys: list[str], val_size: float, seed: int) -> tuple[list[int], list[int]]:
    """Indices of training and validation samples; whole conversations go to one side.

    Args:
        keys: One conversation key per sample.
        val_size: A share in (0, 1), or a number of samples (>= 1); 0 means no validation set.
        seed: The shuffle seed; the same keys, size and seed always give the same split.
    """
    n = len(keys)
    target = round(val_size * n) if 0 < val_size < 1 else min(int(val_size), n)
    groups: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    order = sorted(groups)  # independent of file order, so reordering records does not change the split
    random.Random(seed).shuffle(order)
    val: list[int] = []
    for key in order:
        if len(val) >= target:
            break
        val.extend(groups[key])
    chosen = set(val)
    return [i for i in range(n) if i not in chosen], sorted(val)


def default_name(kind: Kind, reasoning: str) -> str:
    return f"soulchat_r1{'_dialogue' if kind == 'dialogue' else ''}_{'nothink' if reasoning == 'drop' else 'think'}"


def _read_info(out: Path) -> dict[str, Any]:
    path = out / INFO_FILE
    if not path.exists():
        return {}
    info = read_json_object(path)
    if isinstance(info, str):
        raise PrepareError(f"{info}; it must be a JSON object of dataset entries: fix or remove it")
    return info


@dataclass
class PrepareResult:
    name: str
    kind: Kind
    out: Path
    files: dict[str, Path]
    counts: dict[str, Any]
    train: list[dict[str, Any]]
    val: list[dict[str, Any]]
    sources: str = ""
    reasoning: str = "drop"


def _check_size(flag: str, size: float) -> None:
    if size < 0 or (size >= 1 and not float(size).is_integer()):
        raise PrepareError(f"{flag} {size:g} is neither a share in (0, 1) nor a whole count (e.g. 0.05 or 300)")


def prepare(
    src: Path,
    out: Path,
    options: Options,
    *,
    val_file: Path | None = None,
    val_size: float = 0.05,
    seed: int = 42,
    name: str | None = None,
    force: bool = False,
    test_size: float = 0,
) -> PrepareResult:
    """Convert ``src`` (and ``val_file``) and write the LLaMA-Factory files into ``out``.

    ``test_size`` (a share or a count; 0: none) holds whole conversations of ``src`` out first, into
    ``NAME_test.json``: never registered in ``dataset_info.json`` (so no config can name it as a train or
    eval dataset), its sha256 in ``NAME.prepare.json`` (``launcher check`` refuses a config whose datasets are
    that file); the validation split is then drawn from the rest.

    Raises:
        PrepareError: bad input, no sample left, or outputs that exist while ``force`` is false. Nothing
            is written in that case.
    """
    _check_size("--val-size", val_size)
    _check_size("--test-size", test_size)
    train_part = convert_file(src, options)
    val_part = convert_file(val_file, options, kind=train_part.kind) if val_file else None
    name = name or default_name(train_part.kind, options.reasoning)
    files = {
        "train": out / f"{name}.json",
        "val": out / f"{name}_val.json",
        "test": out / f"{name}_test.json",
        "rejects": out / f"{name}.rejects.jsonl",
        "summary": out / f"{name}.prepare.json",
    }
    info = _read_info(out) if out.is_dir() else {}
    if not force:
        taken = [str(p) for p in files.values() if p.exists()]
        taken += [f"{out / INFO_FILE} entry {n!r}" for n in (name, f"{name}_val") if n in info]
        if taken:
            raise PrepareError(
                f"output exists: {', '.join(taken)}; pass --force to replace it, or choose another --out or --name"
            )
    if out.exists() and not out.is_dir():
        raise PrepareError(f"--out {out} is a file; give a folder")

    samples, keys, test = train_part.samples, train_part.keys, []
    if test_size:
        rest_idx, test_idx = split_by_conversation(keys, test_size, seed + 1)  # its own draw, before validation
        test = [samples[i] for i in test_idx]
        samples, keys = [samples[i] for i in rest_idx], [keys[i] for i in rest_idx]
    if val_part is not None:
        train, val = samples, val_part.samples
        split = {"mode": "file", "file": str(val_file)}
    else:
        train_idx, val_idx = split_by_conversation(keys, val_size, seed)
        train = [samples[i] for i in train_idx]
        val = [samples[i] for i in val_idx]
        split = {"mode": "seeded", "seed": seed, "val_size": val_size, "conversations": len(set(train_part.keys))}
    if test_size:
        split["test"] = {"test_size": test_size, "seed": seed + 1, "samples": len(test)}
    if not train and train_part.samples:
        raise PrepareError(
            (
                f"--val-size {val_size:g} and --test-size {test_size:g} take"
                if test_size
                else f"--val-size {val_size:g} takes"
            )
            + f" all {len(train_part.samples)} accepted samples; leave some for training"
        )
    if not train:
        raise PrepareError(
            f"no training sample left from {src} ({train_part.records} records, {len(train_part.rejects)} rejected: "
            f"{_kind_counts(Counter(r['kind'] for r in train_part.rejects))}); nothing written"
        )

    rejects = train_part.rejects + (val_part.rejects if val_part else [])
    out.mkdir(parents=True, exist_ok=True)
    # conversations: never more open than the file they came from (nor than the umask allows)
    private = default_mode() & src.stat().st_mode & (val_file.stat().st_mode if val_file else 0o777)
    write_text_atomic(files["train"], json.dumps(train, ensure_ascii=False, indent=1) + "\n", private)
    info[name] = soulchat.dataset_info_entry(train_part.kind, files["train"].name)
    if val:
        write_text_atomic(files["val"], json.dumps(val, ensure_ascii=False, indent=1) + "\n", private)
        info[f"{name}_val"] = soulchat.dataset_info_entry(train_part.kind, files["val"].name)
    else:
        files.pop("val")
        (out / f"{name}_val.json").unlink(missing_ok=True)  # a stale one from an earlier --force run
        info.pop(f"{name}_val", None)
    if test:  # held out: written, hashed, never registered
        write_text_atomic(files["test"], json.dumps(test, ensure_ascii=False, indent=1) + "\n", private)
    else:
        files.pop("test")
    write_text_atomic(files["rejects"], "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rejects), private)
    counts = {
        "records": train_part.records + (val_part.records if val_part else 0),
        "train": len(train),
        "val": len(val),
        "test": len(test),
        "rejected": len(rejects),
        "rejected_by_kind": dict(Counter(r["kind"] for r in rejects)),
    }
    summary = {
        "format": "soulchat-r1",
        "kind": train_part.kind,
        "name": name,
        "sources": [
            {"path": str(p.source), "sha256": sha256_file(p.source), "records": p.records}
            for p in (train_part, val_part)
            if p is not None
        ],
        "options": {
            "reasoning": options.reasoning,
            "system": _system_origin(train_part.kind, options),
            "system_sha256": hashlib.sha256(options.system.encode()).hexdigest() if options.system else None,
        },
        "split": split,
        "test": {"file": files["test"].name, "sha256": sha256_file(files["test"]), "samples": len(test)}
        if test
        else None,
        "counts": counts,
        "files": {k: p.name for k, p in files.items()},
    }
    write_text_atomic(files["summary"], json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    write_text_atomic(out / INFO_FILE, json.dumps(info, indent=2, ensure_ascii=False) + "\n")
    files["info"] = out / INFO_FILE
    sources = ", ".join(p.source.name for p in (train_part, val_part) if p is not None)
    return PrepareResult(
        name=name,
        kind=train_part.kind,
        out=out,
        files=files,
        counts=counts,
        train=train,
        val=val,
        sources=sources,
        reasoning=options.reasoning,
    )


def _system_origin(kind: Kind, options: Options) -> str:
    if kind == "mdpcot":
        return "option" if options.system is not None else "record"
    parts = (["option"] if options.system else []) + (["consultation_target"] if options.system_from_target else [])
    return "+".join(parts) or "none"


def _kind_counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {n}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1])) or "none"


def summary_lines(result: PrepareResult, rejects_shown: int = 5) -> list[str]:
    """What ``launcher data prepare`` prints: counts and reject reasons, never conversation text."""
    c = result.counts
    lines = [
        f"read {c['records']} records from {result.sources} ({result.kind}, reasoning {result.reasoning}); wrote "
        f"{c['train']} train + {c['val']} validation"
        + (f" + {c['test']} held-out test (not registered)" if c.get("test") else "")
        + f" samples; rejected {c['rejected']}"
        + (f" ({_kind_counts(c['rejected_by_kind'])})" if c["rejected"] else ""),
    ]
    if c["rejected"]:
        shown = [json.loads(line) for line in result.files["rejects"].read_text().splitlines()[:rejects_shown]]
        lines += [f"  reject {r['source']}[{r['index']}] {r['kind']}: {r['reason']}" for r in shown]
        if c["rejected"] > rejects_shown:
            lines.append(f"  ... {c['rejected'] - rejects_shown} more in {result.files['rejects']}")
    lines += [f"{key:>8}: {path}" for key, path in result.files.items()]
    lines.append(f"dataset: {result.name}" + (f", eval_dataset: {result.name}_val" if c["val"] else ""))
    return lines


__all__ = [
    "PrepareError",
    "PrepareResult",
    "convert_file",
    "prepare",
    "read_records",
    "split_by_conversation",
    "summary_lines",
]
