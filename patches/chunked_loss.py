"""Compute the training loss from the final hidden states in token chunks, never holding the whole logits.

Upstream behaviour (transformers 5.6.0, ``models/qwen3_5/modeling_qwen3_5.py``,
``Qwen3_5ForConditionalGeneration.forward``): with ``labels`` given, the forward projects every position through
``lm_head`` (``logits = self.lm_head(hidden_states)``), and ``ForCausalLMLoss`` (``loss/loss_utils.py``) upcasts the
whole tensor to float32 before the cross-entropy. At vocabulary 248,320 and 4,096 tokens that is 2 GiB of bf16 logits, 4
GiB of fp32 logits and as much again for their gradient: about 9 GiB of the 65 GiB peak of a 27B LoRA step on one H200
(docs/lab/2026-12-01-performance-options.md), and the part that grows with the context, so anything above ~16k tokens
does not fit on one device. The class sets ``accepts_loss_kwargs = False`` and calls ``self.loss_function(logits=...,
labels=..., vocab_size=...)`` without ``num_items_in_batch``: the loss is the mean over the micro-batch's supervised
tokens (labels shifted by one, ``-100`` ignored); LLaMA-Factory 0.9.5 (``CustomSeq2SeqTrainer``, processor given) also
sets ``model_accepts_loss_kwargs = False``, so the Trainer divides by ``gradient_accumulation_steps``.

What this patch does (class-level wrapper of that ``forward``; nothing else of the model changes):

- when ``labels`` are given and ``logits_to_keep`` is 0, it runs the inner model (``self.model``) with the
  same arguments, keeps only the positions whose shifted label is supervised, and computes
  ``cross_entropy(lm_head(h).float(), y, reduction="sum")`` over chunks of ``chunk_tokens`` of them, each
  chunk under non-reentrant ``torch.utils.checkpoint`` when gradients are on (so no chunk's logits outlive
  it: the backward recomputes them one chunk at a time); the loss is the sum divided by the number of
  supervised tokens, exactly the upstream mean (NaN when there is none, as upstream). Prompt and padding
  positions never reach ``lm_head`` at all.
- the returned output has ``logits=None``; everything else (``past_key_values``, ``rope_deltas``, ...) is the
  inner model's. Code that needs the training logits (LLaMA-Factory's ``compute_accuracy``, the DFT/EAFT/ASFT
  losses, the Trainer's ``label_smoothing_factor``, which takes the labels away from the model) cannot run
  with it, which ``launcher check`` refuses (``checks/patch_check.py``).
- without ``labels`` (generation, ``predict_with_generate``) the upstream forward runs untouched.

Pure torch: runs on CPU, CUDA and NPU alike. Proof per rank: the class patched, the chunk size, and at the
first call the tokens, the supervised tokens and the number of chunks.

Versions: written and tested against transformers 5.6.0 (``SUPPORTED``); ``check_symbols`` fails the run when
the forward's parameters or the class's ``accepts_loss_kwargs`` change. Delete this patch when transformers
computes the causal-LM loss without materialising the full logits for this model (or LLaMA-Factory offers a
chunked loss that keeps its masking), and a run's record shows the peak memory drop with it off.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from typing import Any

from packaging.specifiers import SpecifierSet
from pydantic import BaseModel, ConfigDict, Field

from .core.errors import PatchError
from .core.proof import ProofFile, utc_now
from .core.versions import require_symbols
from .core.wrapping import original_of, unwrap, wrap_once

NAME = "chunked_loss"
SUPPORTED = {"transformers": SpecifierSet(">=5.6.0,<5.7")}
MODULE = "transformers.models.qwen3_5.modeling_qwen3_5"
CLASS = "Qwen3_5ForConditionalGeneration"
IGNORE_INDEX = -100  # transformers' ForCausalLMLoss default, LLaMA-Factory's IGNORE_INDEX
EXPECTED_PARAMETERS = (
    "input_ids",
    "attention_mask",
    "position_ids",
    "past_key_values",
    "inputs_embeds",
    "labels",
    "pixel_values",
    "pixel_values_videos",
    "image_grid_thw",
    "video_grid_thw",
    "mm_token_type_ids",
    "logits_to_keep",
)


class Options(BaseModel):
    """``launcher.patches.chunked_loss``: ``chunk_tokens`` supervised tokens per chunk (default 512: on one H200
    the 27B step peaked 1.3 GiB lower than at 1024 for about 0.6 % of its speed,
    docs/lab/2026-12-01-performance-options.md)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    enabled: bool = True
    chunk_tokens: int = Field(512, ge=16, le=1 << 20)


_state: dict[str, Any] = {}


def check_symbols() -> None:
    """The forward still has the parameters we pass on and computes the loss without loss kwargs."""
    module = require_symbols(NAME, MODULE, (CLASS,), "transformers")
    cls = getattr(module, CLASS)
    forward = original_of(cls.forward)
    found = tuple(p for p in inspect.signature(forward).parameters if p not in ("self", "kwargs"))
    if found != EXPECTED_PARAMETERS or getattr(cls, "accepts_loss_kwargs", None) is not False:
        raise PatchError(
            NAME,
            f"{CLASS}.forward has parameters {', '.join(found)} and accepts_loss_kwargs="
            f"{getattr(cls, 'accepts_loss_kwargs', None)!r}; the patch was written for "
            f"{', '.join(EXPECTED_PARAMETERS)} and accepts_loss_kwargs=False",
            "install transformers>=5.6.0,<5.7, or turn the patch off with launcher.patches.chunked_loss: false",
        )


def chunked_causal_lm_loss(hidden, labels, head, chunk_tokens: int):
    """The mean cross-entropy of ``head(hidden)`` against ``labels`` shifted by one, in chunks.

    Args:
        hidden: final hidden states, [batch, seq, hidden].
        labels: [batch, seq] token ids, ``-100`` where nothing is supervised.
        head: the output projection (``lm_head``), called on [chunk, hidden] rows.
        chunk_tokens: supervised positions per chunk.

    Returns:
        ``(loss, supervised, chunks)``: the float32 sum over chunks divided by the number of supervised
        positions, that number, and how many chunks it took.
    """
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1).to(hidden.device)
    rows = hidden.reshape(-1, hidden.shape[-1])
    keep = (shifted != IGNORE_INDEX).nonzero().squeeze(-1)
    rows, targets = rows.index_select(0, keep), shifted.index_select(0, keep)

    def chunk_sum(h, y):
        return F.cross_entropy(head(h).float(), y, reduction="sum")

    total = (rows.sum() * 0).float()  # a graph even without a supervised token: NaN with zero gradients, as upstream
    for start in range(0, rows.shape[0], chunk_tokens):
        h, y = rows[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        grad = torch.is_grad_enabled()
        total = total + (checkpoint(chunk_sum, h, y, use_reentrant=False) if grad else chunk_sum(h, y))
    return total / keep.numel(), keep.numel(), -(-rows.shape[0] // chunk_tokens)


def _make_forward(original):
    def forward(self, *args, labels=None, **kwargs):
        if labels is None or args or kwargs.get("logits_to_keep", 0) not in (0, None) or not _state.get("active"):
            return original(self, *args, labels=labels, **kwargs)
        kwargs.pop("logits_to_keep", None)
        outputs = self.model(**kwargs)
        loss, supervised, chunks = chunked_causal_lm_loss(outputs[0], labels, self.lm_head, _state["chunk_tokens"])
        if not _state.get("first_call_recorded"):
            _state["first_call_recorded"] = True
            _state["proof"].update(
                first_call={
                    "tokens": int(labels.numel()),
                    "supervised_tokens": supervised,
                    "chunks": chunks,
                    "grad": bool(loss.requires_grad),
                    "device": str(outputs[0].device),
                    "recorded_at": utc_now(),
                }
            )
        output_cls = sys.modules[MODULE].Qwen3_5CausalLMOutputWithPast
        return output_cls(
            loss=loss,
            logits=None,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            rope_deltas=outputs.rope_deltas,
        )

    return forward


def apply(options: dict[str, Any], *, backend: str, proof: ProofFile, facts: dict[str, Any]) -> dict[str, Any]:
    """Wrap the class's forward once (idempotent) and switch the chunked path on for this process."""
    wrap_once(getattr(importlib.import_module(MODULE), CLASS), "forward", NAME, _make_forward)
    _state.clear()
    _state.update(active=True, chunk_tokens=options["chunk_tokens"], proof=proof)
    return {"replaced": [f"{MODULE}.{CLASS}.forward (with labels)"], "chunk_tokens": options["chunk_tokens"]}


def observe(*, backend: str, proof: ProofFile) -> None:
    """Disabled: the upstream forward computes the full logits."""
    restore()


def restore() -> None:
    """Put the upstream forward back and forget this process's state."""
    unwrap(MODULE, CLASS, "forward", NAME)
    _state.clear()
