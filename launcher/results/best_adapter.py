"""The best checkpoint's adapter at the top of ``output/``, when the Trainer cannot load it back itself.

With ``launcher.early_stopping`` the HF Trainer tracks the best checkpoint (``metric_for_best_model``;
``best_model_checkpoint`` in ``trainer_state.json``) and never rotates it away. Under ``distribution: ddp`` its
``load_best_model_at_end`` puts that adapter back before LLaMA-Factory's final save. Under FSDP the Trainer refuses
``load_best_model_at_end`` with ``save_only_model`` (transformers 5.6.0 ``Trainer.__init__``), and loading would
need full-model FSDP checkpoints; so there the rank that wrote the adapter (world rank 0) copies the best
checkpoint's adapter files over the final ones after training and writes ``best_adapter.json`` naming it. The
final evaluation files (``eval_results.json``) still describe the last step's weights; the record says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.files import read_json_object, read_optional, write_bytes_atomic, write_json_atomic
from launcher.state.runs import ADAPTER_CONFIG, ADAPTER_FILE, BEST_ADAPTER_RECORD, TRAINER_STATE

ADAPTER_FILES = (ADAPTER_FILE, ADAPTER_CONFIG)


@dataclass(frozen=True)
class KeptAdapter:
    """``best_adapter.json``: which checkpoint's adapter ``keep_best_adapter`` copied to the top of ``output/``."""

    checkpoint: str | None = None
    metric: float | None = None
    files: list[str] = field(default_factory=list)
    last_step: int | None = None
    note: str | None = None


def read_kept_adapter(output: Path) -> tuple[KeptAdapter | None, str | None]:
    """``best_adapter.json`` in ``output`` (None when missing), and ``unreadable: PATH (why)`` when it cannot be
    read."""
    return read_optional(output / BEST_ADAPTER_RECORD, KeptAdapter)


def wanted(lf: dict[str, Any]) -> bool:
    """The run tracks a best checkpoint but the Trainer will not load it back (the launcher's FSDP2 mapping)."""
    return bool(lf.get("metric_for_best_model")) and not lf.get("load_best_model_at_end")


def keep_best_adapter(output: Path) -> dict[str, Any] | None:
    """Copy the best checkpoint's adapter files over ``output``'s and record it; None when there is no best."""
    state = read_json_object(output / TRAINER_STATE)
    if isinstance(state, str):
        raise OSError(f"cannot keep the best checkpoint's adapter: {state}")
    best = state.get("best_model_checkpoint")
    if not best:
        return None
    folder = output / Path(str(best)).name  # the Trainer records an absolute path; the run folder may have moved
    for name in ADAPTER_FILES:
        write_bytes_atomic(output / name, (folder / name).read_bytes())
    record = {
        "checkpoint": folder.name,
        "metric": state.get("best_metric"),
        "files": list(ADAPTER_FILES),
        "last_step": state.get("global_step"),
        "note": "the adapter in output/ is this checkpoint's; eval_results.json describes the last step",
    }
    write_json_atomic(output / BEST_ADAPTER_RECORD, record)
    return record
