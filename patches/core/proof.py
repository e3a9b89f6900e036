"""Proof records: one JSON file per rank and patch, ``PROOF_DIR/rank<RANK>/<patch>.json``.

Every write goes to a temporary file in the same folder, is fsynced, and replaces the record with
``os.replace``, so a reader (``launcher status`` on the host) never sees half a file; a write the disk refuses is a
warning (``launcher.files.write_json_or_warn``), and the next one writes the whole record again. A record starts when
the patch is applied (or found disabled) and later facts, such as the first kernel call or the first training step,
are merged into it by the same process. Each rank writes only its own folder, so ranks never race. A DataLoader
worker (``dataloader_num_workers > 0``: a fork of the rank, where LLaMA-Factory's collator runs) writes nothing: its
copy of a record is the rank's as it was at the fork, and writing it would undo what the rank merged since.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from launcher import files
from launcher.state.runs import PROOF_FILE, PROOF_RANK


def utc_now() -> str:
    """The current time as an ISO-8601 UTC string with milliseconds."""
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the distributed job, from the environment torchrun/accelerate set."""

    rank: int
    local_rank: int
    world_size: int

    @classmethod
    def from_env(cls) -> RankInfo:
        values = {}
        for key, default in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1)):
            raw = os.environ.get(key)
            try:
                values[key] = default if raw in (None, "") else int(raw)
            except ValueError:
                raise ValueError(f"environment variable {key}={raw!r} is not an integer") from None
        return cls(values["RANK"], values["LOCAL_RANK"], values["WORLD_SIZE"])

    def as_record(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "world_size": self.world_size,
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
        }


class ProofFile:
    """The proof record of one patch on one rank, held in memory and written whole at every change.

    A write the disk refuses (full, read-only, failing) is a warning, never an error: the run must not die of its
    own proof. Because the whole record is written each time, the next update after the disk recovers writes what
    the refused one held.
    """

    def __init__(self, proof_dir: Path, patch: str, rank: int) -> None:
        self.patch = patch
        self.path = Path(proof_dir) / PROOF_RANK.format(rank=rank) / PROOF_FILE.format(patch=patch)
        self.record: dict[str, Any] | None = None
        self.refused: dict[str, Any] | None = None  # the last write the disk refused (files.disk_error)

    def _write(self) -> None:
        if in_loader_worker():
            return
        self.refused = files.write_json_or_warn(self.path, self.record, f"the proof of patch {self.patch}")

    def start(self, record: dict[str, Any]) -> None:
        """Begin a fresh record for this process (a stale file from an earlier process is replaced)."""
        self.record = {**record, "recorded_at": utc_now()}
        self._write()

    def read(self) -> dict[str, Any]:
        """The record as it is on disk, or ``{}`` when none was written yet or it is not a readable record
        (read bounded, ``files.read_json_bounded``: the next update writes it whole again)."""
        try:
            record = files.read_json_bounded(self.path)
        except (FileNotFoundError, files.Unreadable):
            return {}
        return record if isinstance(record, dict) else {}

    def update(self, **fields: Any) -> None:
        """Merge ``fields`` into the top level of the record."""
        self.record = {**(self.record if self.record is not None else self.read()), **fields, "updated_at": utc_now()}
        self._write()


def in_loader_worker() -> bool:
    """Whether this process is a torch DataLoader worker (never true where torch's data module is not loaded)."""
    data = sys.modules.get("torch.utils.data")
    return data is not None and data.get_worker_info() is not None


def proof_path(proof_dir: Path, patch: str, rank: int) -> Path:
    """Where the record of ``patch`` on ``rank`` lives (for readers such as the launcher)."""
    return ProofFile(proof_dir, patch, rank).path


def read_proof(proof_dir: Path, patch: str, rank: int = 0) -> dict[str, Any]:
    """The record of ``patch`` on ``rank``, or ``{}`` when that rank wrote none (yet)."""
    return ProofFile(proof_dir, patch, rank).read()
