"""Read LLaMA-Factory's ``trainer_log.jsonl`` safely while it is being written.

LLaMA-Factory's ``LogCallback`` appends one JSON object per line from a worker thread, without
fsync (``llamafactory/train/callbacks.py``, ``_write_log``). A reader can therefore see a last line
that is only partly written; such a line (no trailing newline, or not valid JSON) is ignored, never
raised. Every call opens the file afresh, so a file that is deleted and recreated (LLaMA-Factory does
that with ``overwrite_output_dir``) is simply read again.

Line format (DESIGN.md section 2): ``current_steps, total_steps, loss, eval_loss, lr, epoch,
percentage, elapsed_time, remaining_time`` and optionally ``throughput, total_tokens,
vram_allocated``. Training lines have ``loss``; evaluation lines have ``eval_loss`` and no ``loss``;
the line written when training ends has neither.

``read_trainer_log_tail`` reads from the end in blocks, so the progress of a day-long run costs a few
KB of reading however large the file is; ``read_trainer_log`` streams the whole file for curves.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TRAINER_LOG = "trainer_log.jsonl"
_BLOCK = 8192


def _parse(line: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) else None


def _read_block(fd: int, offset: int, size: int) -> bytes:
    """One positioned read; the only place the tail reader touches the file (tests count it)."""
    return os.pread(fd, size, offset)


def read_trainer_log_tail(path: Path, count: int = 1, block: int = _BLOCK) -> list[dict[str, Any]]:
    """The last ``count`` complete records of a trainer log, oldest first.

    Reads backwards in ``block``-sized pieces and stops as soon as ``count`` complete lines are
    found. A half-written last line and lines that are not JSON objects are skipped.

    Returns:
        Up to ``count`` records; empty if the file is missing or holds no complete record.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return []
    try:
        records: list[dict[str, Any]] = []  # newest first
        buf = b""
        pos = os.fstat(fd).st_size
        last_line_dropped = False
        while pos > 0 and len(records) < count:
            start = max(0, pos - block)
            buf = _read_block(fd, start, pos - start) + buf
            pos = start
            if not last_line_dropped:
                newline = buf.rfind(b"\n")
                if newline < 0:
                    continue  # still inside a last line that has no newline yet
                buf = buf[:newline]  # drop the newline and whatever is being written after it
                last_line_dropped = True
            lines = buf.split(b"\n")
            # Unless we reached the start of the file, the first piece may be the end of a longer line.
            buf = lines.pop(0) if pos > 0 else b""
            for line in reversed(lines):
                record = _parse(line) if line.strip() else None
                if record is not None:
                    records.append(record)
                    if len(records) == count:
                        break
        return records[::-1]
    finally:
        os.close(fd)


def read_trainer_log(path: Path) -> list[dict[str, Any]]:
    """Every complete record of a trainer log, in file order (empty if the file is missing)."""
    return list(iter_trainer_log(path))


def iter_trainer_log(path: Path) -> Iterator[dict[str, Any]]:
    """Stream the complete records of a trainer log; a half-written last line is skipped."""
    try:
        with open(path, "rb") as f:
            for line in f:
                if not line.endswith(b"\n"):
                    return  # the writer has not finished this line yet
                record = _parse(line) if line.strip() else None
                if record is not None:
                    yield record
    except FileNotFoundError:
        return


def last_progress(path: Path) -> dict[str, Any] | None:
    """The newest record with ``current_steps`` (what a progress display needs), or None."""
    for record in reversed(read_trainer_log_tail(path, count=4)):
        if "current_steps" in record:
            return record
    return None
