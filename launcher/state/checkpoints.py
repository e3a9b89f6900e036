"""The checkpoints of a run's output folder, with one definition of "complete".

The HF Trainer saves ``checkpoint-N/`` in order: weights (``adapter_model.safetensors`` with
``adapter_config.json`` for LoRA, or ``model.safetensors``), then optimizer and scheduler state unless
``save_only_model``, then ``trainer_state.json`` last (``Trainer._save_checkpoint``). A checkpoint is
complete when it has non-empty weights and its ``trainer_state.json``; anything else (a save in
progress, an interrupted one, a temporary folder) is listed as ignored with the reason. Resuming is
exact only when the optimizer and scheduler state are there too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from launcher.state.runs import (
    ADAPTER_CONFIG,
    ADAPTER_FILE,
    CHECKPOINT_FOLDER,
    FULL_WEIGHTS,
    OPTIMIZER_STATE,
    OPTIMIZER_STATE_FSDP,
    SCHEDULER_STATE,
    TRAINER_STATE,
)

CHECKPOINT_DIR = re.compile("^" + CHECKPOINT_FOLDER.format(step=r"(\d+)") + "$")


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path
    weights_bytes: int
    optimizer_state: bool  # optimizer.pt (optimizer.bin under FSDP) and scheduler.pt: an exact resume is possible

    def relative_to(self, base: Path) -> str:
        try:
            return str(self.path.relative_to(base))
        except ValueError:
            return str(self.path)


def _weights(folder: Path) -> tuple[int, str | None]:
    """Bytes of the folder's weights, or 0 and what is missing."""
    adapter = folder / ADAPTER_FILE
    if adapter.is_file():
        if not (folder / ADAPTER_CONFIG).is_file():
            return 0, ADAPTER_CONFIG
        size = adapter.stat().st_size
        return (size, None) if size > 0 else (0, f"an empty {ADAPTER_FILE}")
    full = folder / FULL_WEIGHTS
    if full.is_file() and full.stat().st_size > 0:
        return full.stat().st_size, None
    return 0, ADAPTER_FILE


def scan_checkpoints(output: Path) -> tuple[list[Checkpoint], list[str]]:
    """Complete checkpoints sorted by step, and the folders ignored, each with its reason."""
    try:
        entries = sorted(p for p in output.iterdir() if p.is_dir())
    except OSError:
        return [], []
    found, ignored = [], []
    for path in entries:
        match = CHECKPOINT_DIR.match(path.name)
        if not match:
            if "checkpoint" in path.name:
                ignored.append(f"{path.name} (not a finished checkpoint folder name)")
            continue
        size, missing = _weights(path)
        if missing is None and not (path / TRAINER_STATE).is_file():
            missing = TRAINER_STATE
        if missing is not None:
            ignored.append(f"{path.name} (incomplete: no {missing})")
            continue
        # under FSDP the Trainer saves the optimizer through accelerate's save_fsdp_optimizer, as optimizer.bin
        # (transformers 5.6.0 Trainer._save_optimizer_and_scheduler, accelerate 1.11 utils/fsdp_utils.py)
        optimizer = any((path / name).is_file() for name in (OPTIMIZER_STATE, OPTIMIZER_STATE_FSDP))
        exact = optimizer and (path / SCHEDULER_STATE).is_file()
        found.append(Checkpoint(int(match.group(1)), path, size, exact))
    found.sort(key=lambda c: c.step)
    return found, ignored


def last_complete_checkpoint(output: Path) -> Checkpoint | None:
    """The newest complete checkpoint, or None."""
    found, _ = scan_checkpoints(output)
    return found[-1] if found else None
