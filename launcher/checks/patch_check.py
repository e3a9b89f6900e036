"""Combinations of patch options and LLaMA-Factory keys that cannot work, found before a run.

- ``chunked_loss`` returns no training logits, so LLaMA-Factory's ``compute_accuracy`` and its DFT, EAFT and
  ASFT losses (which read ``outputs.logits``) cannot run with it, nor the Trainer's ``label_smoothing_factor``
  (it takes the labels from the model and smooths the logits itself, so the patch would silently not run);
- ``checkpoint_all_layers.memory_budget_gib`` needs a device that reports its peak memory (not ``cpu``);
- ``checkpoint_all_layers.offload_inputs: true`` needs gradient checkpointing on;
- packing (``packing``/``neat_packing``) keeps the samples of a row apart only for stage ``sft`` (LLaMA-Factory's
  neat packing), with attention through the 4D block mask (not ``flash_attn: fa2``, where LLaMA-Factory 0.9.5
  swaps in its own Qwen3.5 forwards calling FLA directly), and with ``deltanet_routing`` and ``packed_rows`` on
  (transformers' DeltaNet layers alone run a packed row as one sequence), and not with
  ``include_num_input_tokens_seen: non_padding`` (the Trainer sums the attention mask, which on a packed row holds
  LLaMA-Factory's sample numbers or its 4D mask, not ones: the count of tokens seen would be wrong);
- ``fsdp2_frozen_dtype.trainable_units: shared`` under ``distribution: fsdp2`` needs torch >= 2.8 (the installed
  torch is asked; a check made for another machine passes ``torch_version=None`` and skips this rule).
"""

from __future__ import annotations

from typing import Any

LOGIT_READERS = ("compute_accuracy", "use_dft_loss", "use_eaft_loss", "use_asft_loss", "label_smoothing_factor")


def patch_problems(
    patches: dict[str, dict[str, Any]],
    lf: dict[str, Any],
    *,
    backend: str,
    distribution: str = "ddp",
    torch_version: str | None = None,
) -> list[tuple[str, str]]:
    """``(key, message)`` for every combination that cannot work; each message says how to fix it."""
    problems = []
    fsdp = patches.get("fsdp2_frozen_dtype", {})
    if distribution == "fsdp2" and fsdp.get("enabled") and torch_version is not None:
        from patches.core.errors import PatchError
        from patches.fsdp2_frozen_dtype import trainable_units_mode

        try:
            trainable_units_mode(fsdp.get("trainable_units", "auto"), torch_version)
        except PatchError as err:
            problems.append(
                (
                    "launcher.patches.fsdp2_frozen_dtype.trainable_units",
                    f"launcher.patches.fsdp2_frozen_dtype.{err.problem}; {err.fix}",
                )
            )
    chunked = patches.get("chunked_loss", {})
    for key in LOGIT_READERS:
        if chunked.get("enabled") and lf.get(key):
            shown = "true" if lf[key] is True else lf[key]
            problems.append(
                (
                    key,
                    f"{key}: {shown} reads the training logits, which launcher.patches.chunked_loss "
                    f"never builds; remove {key} or set launcher.patches.chunked_loss: false",
                )
            )
    ckpt = patches.get("checkpoint_all_layers", {})
    where = "launcher.patches.checkpoint_all_layers"
    if ckpt.get("enabled") and ckpt.get("memory_budget_gib") is not None and backend == "cpu":
        problems.append(
            (
                f"{where}.memory_budget_gib",
                (
                    f"{where}.memory_budget_gib needs a device that reports its peak memory (cuda, "
                    "npu); the backend is cpu: "
                    "use uncheckpointed_layers: N instead"
                ),
            )
        )
    checkpointing = not (lf.get("gradient_checkpointing") is False or lf.get("disable_gradient_checkpointing"))
    if ckpt.get("enabled") and ckpt.get("offload_inputs") is True and not checkpointing:
        problems.append(
            (
                f"{where}.offload_inputs",
                f"{where}.offload_inputs: true moves what checkpointed layers save, but the LLaMA-Factory config "
                "turns gradient checkpointing off; remove offload_inputs or turn checkpointing on",
            )
        )
    return problems + packing_problems(patches, lf)


def packing_problems(patches: dict[str, dict[str, Any]], lf: dict[str, Any]) -> list[tuple[str, str]]:
    """Why a packing config would let the samples of a row see each other, or break, if it would."""
    stage = lf.get("stage", "sft")
    key = "neat_packing" if lf.get("neat_packing") else "packing"
    packs = bool(lf.get("neat_packing")) or (lf["packing"] if lf.get("packing") is not None else stage == "pt")
    if not packs:
        return []
    shown = f"{key}: true" if lf.get(key) else "packing (LLaMA-Factory's default for stage pt)"
    problems = []
    if stage != "sft":
        problems.append(
            (
                key,
                (
                    f"{shown} with stage {stage}: LLaMA-Factory packs stage {stage} rows as one token stream, so the "
                    "samples of a row would see each other and share DeltaNet state; samples are kept apart only for "
                    "stage sft. Set packing: false, or train with stage: sft"
                ),
            )
        )
    if lf.get("flash_attn") == "fa2":
        problems.append(
            (
                "flash_attn",
                (
                    f"flash_attn: fa2 with {key}: LLaMA-Factory 0.9.5 then replaces the Qwen3.5 decoder and DeltaNet "
                    "forwards with direct FLA calls, bypassing launcher.patches.deltanet_routing and packed_rows and "
                    "their proof; use flash_attn: sdpa (or eager): it attends through the block-diagonal mask"
                ),
            )
        )
    for name in ("deltanet_routing", "packed_rows"):
        if not patches.get(name, {}).get("enabled"):
            problems.append(
                (
                    f"launcher.patches.{name}",
                    (
                        f"{shown} needs launcher.patches.{name}: without it transformers' DeltaNet layers run a packed "
                        "row as one sequence (the convolution and the recurrent state flow from one sample into the "
                        f"next); enable {name}, or turn packing off"
                    ),
                )
            )
    if lf.get("include_num_input_tokens_seen") == "non_padding":
        problems.append(
            (
                "include_num_input_tokens_seen",
                (
                    f"include_num_input_tokens_seen: non_padding with {shown}: the Trainer counts the "
                    "tokens seen by summing "
                    "the attention mask, which on a packed row holds LLaMA-Factory's sample numbers (1, 2, 3 ... per "
                    "sample) or its 4D mask, not ones, so the total_tokens and throughput of "
                    "trainer_log.jsonl would be "
                    "wrong; use include_num_input_tokens_seen: all (each packed row counts every "
                    "token it is trained on, "
                    "padding included), or turn packing off"
                ),
            )
        )
    if stage == "sft":
        problems += _dummy_image_problems(patches, lf, shown)
    return problems


def _dummy_image_problems(patches: dict[str, dict[str, Any]], lf: dict[str, Any], shown: str) -> list[tuple[str, str]]:
    """LLaMA-Factory 0.9.5 appends its dummy image to a packed batch's first row without widening the packed
    mask to match, so packing trains only when ``text_only_batches`` keeps the dummy out."""
    from launcher.checks.data_check import dataset_media
    from patches.text_only_batches import media_verdict

    why = None if patches.get("text_only_batches", {}).get("enabled") else "launcher.patches.text_only_batches is off"
    if why is None:
        vision = not lf.get("freeze_vision_tower", True) or not lf.get("freeze_multi_modal_projector", True)
        text_only, verdict = media_verdict({"dataset_media": dataset_media(lf), "vision_trainable": vision})
        why = None if text_only else verdict
    if why is None:
        return []
    return [
        (
            "launcher.patches.text_only_batches",
            (
                f"{shown} needs batches without LLaMA-Factory's dummy image (0.9.5 appends it to a "
                "packed batch's first "
                f"row but not to its packed mask, and the first step fails), and here {why}; pack text-only data with "
                "text_only_batches on and the vision tower frozen, or turn packing off"
            ),
        )
    ]
