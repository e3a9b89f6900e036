"""A packed batch as the collator leaves it: whether its position ids restart in every sample (``restarts``),
whether LLaMA-Factory builds its 4D mask (``builds_4d_mask``), and the padding after its last sample token cut
(``cut_padding``).
"""

from __future__ import annotations

from .masks import Segments

# the tensors of a packed batch that hold one entry per token (``cut_padding``), as LLaMA-Factory 0.9.5's collator
# hands a text-only batch over (``position_ids``: ``[3 or 4, B, T]`` for Qwen3.5's rotary sections)
CUT = ("input_ids", "attention_mask", "labels", "position_ids", "token_type_ids", "mm_token_type_ids")


def restarts(positions) -> bool:
    """A sample's text position ids start at 0 and never go back (image tokens may repeat a position)."""
    return int(positions[0]) == 0 and bool((positions[1:] >= positions[:-1]).all())


def builds_4d_mask(collator) -> bool:
    """Whether LLaMA-Factory's collator turns this batch's sample numbers into the 4D mask (its own condition)."""
    return bool(collator.block_diag_attn) and collator.attn_implementation != "flash_attention_2"


def cut_length(found: Segments, multiple: int) -> int:
    """The length ``cut_padding`` cuts rows of ``found`` to: the last sample token of the fullest row, rounded up to
    ``multiple`` (at least ``multiple``), never longer than the rows; the rows' length where ``multiple`` is 0."""
    last = max((end for _, _, end, real in found.spans if real), default=0)
    return min(found.length, max(multiple, -(-last // multiple) * multiple)) if multiple else found.length


def cut_padding(batch, found: Segments, multiple: int):
    """``batch`` (a packed batch as the collator leaves it, ``found`` its samples) cut after the last sample token of
    its fullest row, rounded up to ``multiple`` tokens (``cut_length``), where that is shorter than the rows.

    LLaMA-Factory pads every packed row to ``cutoff_len``; the padding after the last sample attends only to padding,
    carries label -100 and feeds no sample token (causal order), yet every layer computes it as it computes a token.
    Cutting it changes no loss term and no gradient (``tests/patches/test_packing.py``; with LoRA dropout the masks
    drawn differ, as they would for a batch of another length). The per-token tensors (``CUT``; the 4D mask in both
    of its last two dimensions) are cut; a batch is left whole where any other tensor is as long as its rows, or
    where a label after the cut is not -100 (``ignore_pad_token_for_loss: false`` makes the collator's own padding a
    target), which the proof's first packed batch then shows (``left_whole``). Rounding up to ``multiple`` bounds the
    lengths a run meets (cuDNN builds a graph, an NPU compiles, at each new one), as ``pad_lengths`` does for unpacked
    batches."""
    import torch
    from llamafactory.extras.constants import IGNORE_INDEX

    keep = cut_length(found, multiple)
    if keep >= found.length:
        return batch
    cut = {
        name: value
        for name, value in batch.items()
        if torch.is_tensor(value) and value.dim() and value.shape[-1] == found.length
    }
    labels = cut.get("labels")
    if set(cut) - set(CUT) or (labels is not None and bool((labels[..., keep:] != IGNORE_INDEX).any())):
        return batch
    for name, value in cut.items():
        value = value[..., :keep, :keep] if name == "attention_mask" and value.dim() == 4 else value[..., :keep]
        batch[name] = value.contiguous()
    return batch
