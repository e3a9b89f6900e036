"""Combinations of patch options and LLaMA-Factory keys that cannot work, found before a run.

- ``chunked_loss`` returns no training logits, so LLaMA-Factory's ``compute_accuracy`` and its DFT, EAFT and
  ASFT losses (which read ``outputs.logits``) cannot run with it, nor the Trainer's ``label_smoothing_factor``
  (it takes the labels from the model and smooths the logits itself, so the patch would silently not run);
- ``checkpoint_all_layers.memory_budget_gib`` needs a device that reports its peak memory (not ``cpu``);
- the layer plan (``uncheckpointed_layers``, ``memory_budget_gib``) measures one layer outside the model's
  forward, which FSDP would all-gather out of order: not under ``distribution: fsdp2``.
"""

from __future__ import annotations

from typing import Any

LOGIT_READERS = ("compute_accuracy", "use_dft_loss", "use_eaft_loss", "use_asft_loss", "label_smoothing_factor")


def patch_problems(patches: dict[str, dict[str, Any]], lf: dict[str, Any], *, backend: str,
                   distribution: str) -> list[tuple[str, str]]:  # fmt: skip
    """``(key, message)`` for every combination that cannot work; each message says how to fix it."""
    problems = []
    chunked = patches.get("chunked_loss", {})
    for key in LOGIT_READERS:
        if chunked.get("enabled") and lf.get(key):
            shown = "true" if lf[key] is True else lf[key]
            problems.append((key, f"{key}: {shown} reads the training logits, which launcher.patches.chunked_loss "
                             f"never builds; remove {key} or set launcher.patches.chunked_loss: false"))  # fmt: skip
    ckpt = patches.get("checkpoint_all_layers", {})
    where = "launcher.patches.checkpoint_all_layers"
    if ckpt.get("enabled") and ckpt.get("memory_budget_gib") is not None and backend == "cpu":
        problems.append((f"{where}.memory_budget_gib", (
            f"{where}.memory_budget_gib needs a device that reports its peak memory (cuda, npu); the backend is cpu: "
            "use uncheckpointed_layers: N instead")))  # fmt: skip
    planned = [k for k in ("uncheckpointed_layers", "memory_budget_gib") if ckpt.get(k) is not None]
    if ckpt.get("enabled") and planned and distribution == "fsdp2":
        problems.append((f"{where}.{planned[0]}", (
            f"{where}.{planned[0]} is not supported with distribution: fsdp2 (the layer measurement would run one "
            f"FSDP unit outside the model's forward); remove it to checkpoint every layer")))  # fmt: skip
    return problems
