"""Greedy answers in batches for ``launcher evaluate``: left padding, one attention mask, one state per row.

Why left padding is exact for the hybrid Qwen3.5 model (transformers 5.6.0, ``models/qwen3_5/modeling_qwen3_5.py``):

- DeltaNet layers: ``Qwen3_5TextModel._update_linear_attn_mask`` hands the 2-D mask to the linear-attention
  layers for the prompt's pass, and ``Qwen3_5GatedDeltaNet.forward`` starts with ``apply_mask_to_padding_states``,
  which zeroes the pad positions' hidden states (only when batch > 1 and length > 1: a batch of one has no pads,
  and decoding steps carry one real token per row). The projections and the depthwise ``conv1d`` have no bias,
  so a pad position's q, k, v are zero: the convolution over a row's first real tokens reads zeros, which is what
  its own zero padding reads in the unpadded row, and the conv state cached for decoding is the row's last
  ``conv_kernel_size`` positions (real tokens, or zeros for a row shorter than that, as unpadded). The recurrent
  state starts at zero; a pad step still decays it through ``g`` (``a`` and ``dt_bias`` give a non-zero ``g``
  for a zero input), but zero times a decay is zero and the zero k, v add nothing, so the state reaches the
  first real token at zero, as in the unpadded row. Each row has its own slice of the cache's conv and
  recurrent states (``Qwen3_5DynamicCache``: batch is their first dimension), so rows never mix.
- Full-attention layers: the causal mask built from the same 2-D mask hides the pads, and generation's
  position ids count only real tokens (``GenerationMixin._prepare_position_ids_for_generation``: the mask's
  cumulative sum; ``Qwen3_5ForConditionalGeneration`` stacks it to its 3-D text positions), so rotary
  positions start at 0 on each row's first real token.
- Stopping: ``generate`` marks a row finished at its own stop token and pads it from then on; the row's answer
  here ends at that stop token, so what follows it (pads, or the other rows' steps) is never read.

``tests/rank/test_evaluate_decode.py`` proves it on the tiny model: batched answers equal one-at-a-time answers token
for token (fp32, CPU), and a planted leak (the padding mask dropped) breaks that equality.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from launcher.checks.memory import GIB, SLACK_GIB, SLACK_SHARE

AUTO = "auto"  # ``--batch-size auto``: as many rows as the device's free memory holds, by the forecast
# At most this many rows a batch with ``auto``: one H200 decoded a step in about 0.21 s from 1 row to 32
# (docs/lab/2026-12-02-batched-decoding.md; not measured beyond 32), and each batch is one progress line.
AUTO_MAX_ROWS = 64
FALLBACK_ROWS = 16  # ``auto`` when the model's config gives no forecast (a model that is not Qwen3.5)


@dataclass(frozen=True)
class Progress:
    """After each batch: prompts answered of all, tokens generated so far and the seconds they took."""

    done: int
    total: int
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def cut_at_stop(tokens: Sequence[int], stop: Sequence[int]) -> list[int]:
    """The answer's tokens up to and with its first stop token (what one-at-a-time ``generate`` returns)."""
    stops = set(stop)
    for i, token in enumerate(tokens):
        if token in stops:
            return list(tokens[: i + 1])
    return list(tokens)


def auto_rows(prompts: int, row_bytes: int, free_bytes: int, total_bytes: int) -> tuple[int, dict[str, Any]]:
    """Rows per greedy batch for ``--batch-size auto``, and the figures behind the choice.

    The rows that fit in the device's free memory (``free_bytes``: free on the device plus what the caching
    allocator holds unused), keeping free what the training forecast keeps as allocator slack (``SLACK_GIB`` and
    ``SLACK_SHARE`` of the device), at ``row_bytes`` a row (``launcher.checks.memory.decode_row_bytes`` at the
    longest prompt, which the first batch holds); at most ``AUTO_MAX_ROWS`` and the number of prompts, at least 1.
    """
    kept = int((SLACK_GIB * GIB) + SLACK_SHARE * total_bytes)
    fits = max(0, (free_bytes - kept) // row_bytes)
    rows = max(1, min(fits, AUTO_MAX_ROWS, prompts))
    return rows, {
        "free_gib": round(free_bytes / GIB, 2),
        "row_mib": round(row_bytes / 2**20, 2),
        "kept_free_gib": round(kept / GIB, 2),
        "rows_that_fit": int(fits),
        "most_rows": AUTO_MAX_ROWS,
    }


def free_memory(torch, device) -> tuple[int, int]:
    """``(free, total)`` bytes where the model runs: the accelerator's free memory plus the caching allocator's
    reserved but unallocated blocks (``cuda``, ``npu``), or the host's available RAM (``cpu``)."""
    device = torch.device(device)
    if device.type == "cpu":
        import psutil

        memory = psutil.virtual_memory()
        return memory.available, memory.total
    module = getattr(torch, device.type)
    free, total = module.mem_get_info(device)
    return free + module.memory_reserved(device) - module.memory_allocated(device), total


def _batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Row indices in batches of prompts of similar length (less padding), longest first: the first batch is
    the largest, so a batch size that does not fit fails in the first seconds, not at the end."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def _filled(rows: list[int], batch_size: int, n_batches: int) -> list[int]:
    """``rows`` and, when the prompts take more than one batch, copies of its last row up to ``batch_size``.

    Every ``generate`` call then has the same batch size, so no kernel meets a batch size the first batch did not
    compile it for: Triton specializes a kernel's plain integer arguments (1, a multiple of 16, or neither), and
    FLA 0.6.0's ``causal_conv1d_fwd_kernel``, which runs each prompt's pass, takes the batch size as one (16 rows and
    6 rows compile apart). On one H200 (27B shape, a cold cache, 38 prompts in batches of 16, before the fill) the
    last batch of 6 took 46.9 s against 25.8 s for the 16 before it (19.1 s against 16.5 s with the cache filled);
    how much of that the fill takes back is not measured. A copy of a real row finishes when that row does, so it
    adds no decoding step; its answer is dropped. One batch alone is not filled: there is no other size to match."""
    if n_batches == 1:
        return rows
    return rows + [rows[-1]] * (batch_size - len(rows))


def greedy_batched(
    torch,
    model,
    prompt_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop: Sequence[int],
    pad_id: int,
    batch_size: int,
    device,
    progress: Callable[[Progress], None] | None = None,
) -> list[list[int]]:
    """Greedy answers (token ids, each ending at its first stop token or at ``max_new_tokens``) to
    ``prompt_ids``, in their order, ``batch_size`` prompts per ``generate`` call (a short last batch filled up:
    ``_filled``)."""
    if batch_size < 1:
        raise ValueError(f"batch_size {batch_size}: use 1 or more")
    answers: list[list[int]] = [[] for _ in prompt_ids]
    started, tokens, done = time.monotonic(), 0, 0
    batches = _batches([len(p) for p in prompt_ids], batch_size)
    for real in batches:
        rows = _filled(real, batch_size, len(batches))
        width = max(len(prompt_ids[i]) for i in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):  # left padding: every row's last prompt token sits in the last column
            n = len(prompt_ids[i])
            ids[r, width - n :] = torch.tensor(list(prompt_ids[i]), dtype=torch.long)
            mask[r, width - n :] = 1
        with torch.no_grad():
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=list(stop),
                pad_token_id=pad_id,
            )
        for r, i in enumerate(real):  # the filled rows come after the real ones and are not read
            answers[i] = cut_at_stop(out[r, width:].tolist(), stop)
            tokens += len(answers[i])
        done += len(real)
        if progress is not None:
            progress(Progress(done, len(prompt_ids), tokens, time.monotonic() - started))
    return answers
