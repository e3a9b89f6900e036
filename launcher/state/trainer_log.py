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

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.files import FileFollower, Unreadable, kind_of, open_regular, parse_json

_BLOCK = 8192
# One line of LLaMA-Factory's log is a few hundred bytes; a longer one than this is damage (or planted) and
# is skipped and counted, never kept in memory. Skipping reads in larger blocks.
MAX_LINE_BYTES = 1 << 20
_SKIP_BLOCK = 1 << 20
# The types of the keys the launcher computes with (status, the supervisor's summary); a line whose key has
# another type is skipped like a line that is not JSON.
_NUMBER_KEYS = ("loss", "eval_loss", "lr", "epoch", "percentage", "throughput", "total_tokens")
_STEP_KEYS = ("current_steps", "total_steps")
_TIME_KEYS = ("elapsed_time", "remaining_time")
_DURATION = re.compile(r"(-?\d{1,9} days?, )?\d{1,2}:\d{2}:\d{2}(\.\d{1,6})?")
_LINE_DEPTH = 8  # LLaMA-Factory's lines are flat objects


def line_problem(line: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """One line of the log as a typed record, or why it is skipped (``files.parse_json``'s bounds: a 5,000-digit
    step, a non-finite number, a lone surrogate is made whole; then the types the launcher computes with)."""
    if len(line) > MAX_LINE_BYTES:
        return None, f"longer than {MAX_LINE_BYTES:,} bytes"
    try:
        record = parse_json(line, max_depth=_LINE_DEPTH)
    except Unreadable as err:
        return None, str(err)
    if not isinstance(record, dict):
        return None, f"{kind_of(record)}, not an object"
    for key in _STEP_KEYS:
        if key in record and (not isinstance(record[key], int) or isinstance(record[key], bool) or record[key] < 0):
            return None, f"{key!r} is {kind_of(record[key])}, not a step"
    for key in _NUMBER_KEYS:
        if (
            key in record
            and record[key] is not None
            and (not isinstance(record[key], int | float) or isinstance(record[key], bool))
        ):
            return None, f"{key!r} is {kind_of(record[key])}, not a number"
    for key in _TIME_KEYS:  # str(timedelta): "H:MM:SS", past a day "2 days, H:MM:SS"
        if key in record and not (isinstance(record[key], str) and _DURATION.fullmatch(record[key])):
            return None, f"{key!r} is {kind_of(record[key])}, not a duration"
    return record, None


def _parse(line: bytes) -> dict[str, Any] | None:
    return line_problem(line)[0]


def _read_block(fd: int, offset: int, size: int) -> bytes:
    """One positioned read; the only place the tail reader touches the file (tests count it)."""
    return os.pread(fd, size, offset)


@dataclass
class Tail:
    """The last complete records of a trainer log (oldest first), the lines longer than the cap that were
    skipped on the way, and the bytes read."""

    records: list[dict[str, Any]] = field(default_factory=list)
    long_lines_skipped: int = 0
    bytes_read: int = 0


def read_tail(path: Path, count: int = 1, block: int = _BLOCK, max_line: int = MAX_LINE_BYTES) -> Tail:
    """The last ``count`` complete records of a trainer log, read backwards from its end.

    Each byte is read once and each kept line joined once, so the cost is linear in what is read; a line
    longer than ``max_line`` is skipped (and counted) without being held, so memory stays within
    ``max_line`` plus a block. A half-written last line and lines that are not typed JSON objects are skipped.
    """
    tail = Tail()
    try:
        fd = open_regular(path)  # a FIFO or a device in its place is never opened for reading
    except (OSError, Unreadable):
        return tail
    try:
        records = tail.records  # newest first until the end
        pos = os.fstat(fd).st_size
        if pos == 0:
            return tail
        # the last line counts only when it ends with a newline; otherwise it is still being written
        discard = _read_block(fd, pos - 1, 1) != b"\n"
        if not discard:
            pos -= 1
        pieces: list[bytes] = []  # the current line's bytes after the block at hand, rightmost first
        length, overlong = 0, False

        def finish(head: bytes) -> None:
            nonlocal discard, length, overlong
            if discard:  # the half-written last line: dropped (counted too when it is over the cap)
                tail.long_lines_skipped += overlong or length + len(head) > max_line
                discard = False
            elif overlong or length + len(head) > max_line:
                tail.long_lines_skipped += 1
            elif (line := head + b"".join(reversed(pieces))).strip() and (record := _parse(line)) is not None:
                records.append(record)
            pieces.clear()
            length, overlong = 0, False

        while pos > 0 and len(records) < count:
            start = max(0, pos - (_SKIP_BLOCK if overlong else block))
            chunk = _read_block(fd, start, pos - start)
            tail.bytes_read += len(chunk)
            end = len(chunk)
            while len(records) < count and (newline := chunk.rfind(b"\n", 0, end)) >= 0:
                finish(chunk[newline + 1 : end])
                end = newline
            if len(records) < count and not overlong:
                length += end
                if length > max_line:
                    overlong = True
                    pieces.clear()
                elif not discard:
                    pieces.append(chunk[:end])
            pos = start
        if pos == 0 and len(records) < count and (pieces or overlong):
            finish(b"")  # the file's first line
        records.reverse()
        return tail
    finally:
        os.close(fd)


def read_trainer_log_tail(path: Path, count: int = 1, block: int = _BLOCK) -> list[dict[str, Any]]:
    """The last ``count`` complete records of a trainer log, oldest first (see ``read_tail``).

    Returns:
        Up to ``count`` records; empty if the file is missing or holds no complete record.
    """
    return read_tail(path, count, block).records


def iter_trainer_log(path: Path) -> Iterator[dict[str, Any]]:
    """Stream the complete records of a trainer log (a regular file); a half-written last line is skipped, and
    a line over ``MAX_LINE_BYTES`` is skipped without being held."""
    try:
        f = os.fdopen(open_regular(path), "rb")
    except (OSError, Unreadable):
        return
    with f:
        overlong = False
        while line := f.readline(MAX_LINE_BYTES + 1):
            if not line.endswith(b"\n"):
                if len(line) <= MAX_LINE_BYTES:
                    return  # the writer has not finished this line yet
                overlong = True  # the rest of it follows: skipped up to its newline
                continue
            if overlong:
                overlong = False
                continue
            record = _parse(line) if line.strip() else None
            if record is not None:
                yield record


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
        self._skipping = False
        self._line = 0  # lines read of the file as it is now (a recreated file counts from 1 again)
        self.long_lines_skipped = 0
        self.summary: dict[str, Any] = {}
        self.skipped: list[str] = []  # "line N: why" of each line skipped since the caller last took them

    def take_skipped(self) -> list[str]:
        """The lines skipped since the last call (``line N: why``), each handed out once."""
        skipped, self.skipped = self.skipped, []
        return skipped

    def poll(self) -> bool:
        """Read what was appended; return True if at least one new record arrived. A line that cannot be used
        (not JSON, out of bounds, a key of the wrong type) is skipped and noted in ``skipped``."""
        data, restarted = self._file.read_new()
        if restarted:
            self._partial, self._skipping, self._line = b"", False, 0
        if not data:
            return False
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()  # empty if the data ended with a newline
        if self._skipping:  # the rest of a line over the cap
            if not lines:
                self._partial = b""
                return False
            lines[0], self._skipping = b"", False
        if len(self._partial) > MAX_LINE_BYTES:  # never held, never joined again: skipped up to its newline
            self._partial, self._skipping = b"", True
            self.long_lines_skipped += 1
            self.skipped.append(f"line {self._line + len(lines) + 1}: longer than {MAX_LINE_BYTES:,} bytes")
        seen = False
        for line in lines:
            self._line += 1
            if not line.strip():
                continue
            record, why = line_problem(line)
            if record is None:
                self.skipped.append(f"line {self._line}: {why}")
                continue
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
