"""Follow a growing ``trainer_log.jsonl`` incrementally, as the supervisor does while a run lives.

Each ``poll`` reads only the bytes appended since the last one and keeps a running summary: the
newest progress line, the best eval loss and its step, the step this attempt started from, and
whether the last optimizer step is done. A half-written last line waits for the next poll; a file
that is deleted and recreated (LLaMA-Factory's ``overwrite_output_dir``) is read again from its start.
The summary is what ``launcher status`` shows without reading the whole log.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class TrainerLogFollower:
    def __init__(self, path: Path):
        self.path = path
        # The followed file stays open: while it is, a deleted file's inode number cannot be reused by
        # the file that replaces it (ext4 reuses a freed number at once), so a new inode means a new file.
        self._file: Any = None
        self._offset = 0
        self._partial = b""
        self.summary: dict[str, Any] = {}

    def poll(self) -> bool:
        """Read what was appended; return True if at least one new record arrived."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        if self._file is None or os.fstat(self._file.fileno()).st_ino != st.st_ino or st.st_size < self._offset:
            self.close()
            try:
                self._file = open(self.path, "rb")  # noqa: SIM115  (kept open between polls, see __init__)
            except OSError:
                return False
            self._offset, self._partial = 0, b""
        self._file.seek(self._offset)
        data = self._file.read()
        if not data:
            return False
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()  # empty if the data ended with a newline
        seen = False
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                self._add(record)
                seen = True
        return seen

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

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
