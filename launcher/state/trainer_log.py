"""Read LLaMA-Factory's ``trainer_log.jsonl`` safely while it is being written.

LLaMA-Factory's ``LogCallback`` appends one JSON object per line from a worker thread, without
fsync (``llamafactory/train/callbacks.py``, ``_write_log``). A reader can therefore see a last line
that is only partly written; such a line (no trailing newline, or not valid JSON) is ignored, never
raised. Every call opens the file afresh, so a file that is deleted and recreated (LLaMA-Factory does
that with ``overwrite_output_dir``) is simply read again.

Line format (LLaMA-Factory 0.9.5, ``LogCallback``; see docs/upstream.md): ``current_steps, total_steps,
loss, eval_loss, lr, epoch, percentage, elapsed_time, remaining_time`` and optionally ``throughput, total_tokens,
vram_allocated``. Training lines have ``loss``; evaluation lines have ``eval_loss`` and no ``loss``;
the line written when training ends has neither.

``read_trainer_log_tail`` reads from the end in blocks, so the progress of a day-long run costs a few
KB of reading however large the file is; ``iter_trainer_log`` streams the whole file for curves;
``TrainerLogFollower`` reads what was appended since its last poll and keeps a running summary (what
the supervisor records and ``launcher status`` shows without reading the whole log).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from launcher.files import FileFollower

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


class TrainerLogFollower:
    """Follow a growing trainer log as the supervisor does while a run lives.

    Each ``poll`` reads only the bytes appended since the last one and keeps a running summary: the
    newest progress line, the best eval loss and its step, the step this attempt started from, and
    whether the last optimizer step is done. A half-written last line waits for the next poll; a file
    that is deleted and recreated (LLaMA-Factory's ``overwrite_output_dir``) is read again from its start.
    """

    def __init__(self, path: Path):
        self.path = path
        self._file = FileFollower(path)
        self._partial = b""
        self.summary: dict[str, Any] = {}

    def poll(self) -> bool:
        """Read what was appended; return True if at least one new record arrived."""
        data, restarted = self._file.read_new()
        if restarted:
            self._partial = b""
        if not data:
            return False
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()  # empty if the data ended with a newline
        seen = False
        for line in lines:
            record = _parse(line) if line.strip() else None
            if record is not None:
                self._add(record)
                seen = True
        return seen

    def close(self) -> None:
        self._file.close()

    def _add(self, record: dict[str, Any]) -> None:
        s = self.summary
        step, total = record.get("current_steps"), record.get("total_steps")
        if step is None:
            return
        s.setdefault("first_step", step)
        s["records"] = s.get("records", 0) + 1
        s["step"], s["total_steps"] = step, total
        for key in ("epoch", "percentage", "elapsed_time", "lr", "throughput"):
            if key in record:
                s[key] = record[key]
        if "loss" in record:
            s["loss"], s["loss_step"] = record["loss"], step
            if total and step >= total:
                s["training_done"] = True  # last optimizer step done: final eval/save may follow
        if "eval_loss" in record:
            s["eval_loss"], s["eval_step"] = record["eval_loss"], step
            if s.get("best_eval_loss") is None or record["eval_loss"] < s["best_eval_loss"]:
                s["best_eval_loss"], s["best_eval_step"] = record["eval_loss"], step
        if "loss" not in record and "eval_loss" not in record and total and step >= total:
            s["training_done"] = True
