"""The checkpoints of a run's output folder, with one definition of "complete".

The HF Trainer saves ``checkpoint-N/`` in order: weights (``adapter_model.safetensors`` with
``adapter_config.json`` for LoRA, or ``model.safetensors``), then optimizer and scheduler state unless
``save_only_model``, then ``trainer_state.json`` last (``Trainer._save_checkpoint``). A checkpoint is
complete when it has non-empty weights and its ``trainer_state.json``; anything else (a save in
progress, an interrupted one, a temporary folder) is listed as ignored with the reason. Resuming is
exact only when the optimizer and scheduler state are there too (non-empty).

A complete checkpoint can still be damaged (a disk that filled during the save, a copy cut short, a planted file):
``damage`` reads what a resume loads first, the weights' safetensors header (every tensor inside the file) and
``trainer_state.json`` (parseable, with its ``global_step``), and ``last_complete_checkpoint`` passes over a
damaged one to the newest that holds, saying which it skipped and why. Nothing is ever deleted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from launcher.files import kind_of, read_json_object, shown
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
from launcher.state.safetensors_header import SafetensorsError, read_header

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
        optimizer = any(_non_empty(path / name) for name in (OPTIMIZER_STATE, OPTIMIZER_STATE_FSDP))
        exact = optimizer and _non_empty(path / SCHEDULER_STATE)
        found.append(Checkpoint(int(match.group(1)), path, size, exact))
    found.sort(key=lambda c: c.step)
    return found, ignored


def _non_empty(path: Path) -> bool:
    try:
        return path.is_file() and path.stat().st_size > 0
    except OSError:
        return False


def damage(checkpoint: Checkpoint) -> str | None:
    """Why a complete checkpoint cannot be loaded (its weights' header or its trainer state), or None."""
    weights = checkpoint.path / ADAPTER_FILE
    if not weights.is_file():
        weights = checkpoint.path / FULL_WEIGHTS
    try:
        read_header(weights)
    except (OSError, SafetensorsError) as err:
        return shown(err)
    state = read_json_object(checkpoint.path / TRAINER_STATE)
    if isinstance(state, str):
        return state
    step = state.get("global_step")
    if not isinstance(step, int) or isinstance(step, bool):
        return f"{TRAINER_STATE} has no global_step (found {kind_of(step)})"
    return None


def last_complete_checkpoint(
    output: Path, need_optimizer: bool = False, skipped: list[str] | None = None
) -> Checkpoint | None:
    """The newest complete checkpoint that is not damaged (``damage``), or None.

    Args:
        need_optimizer: pass over checkpoints without optimizer and scheduler state too.
        skipped: gets one ``checkpoint-N (why)`` for each newer checkpoint passed over.
    """
    found, _ = scan_checkpoints(output)
    for checkpoint in reversed(found):
        why = damage(checkpoint)
        if why is None and need_optimizer and not checkpoint.optimizer_state:
            why = "no optimizer and scheduler state"
        if why is None:
            return checkpoint
        if skipped is not None:
            skipped.append(f"{checkpoint.path.name} ({why})")
    return None
