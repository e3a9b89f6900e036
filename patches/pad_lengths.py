"""Pad every batch to a multiple of N tokens, so a run meets few distinct sequence lengths (off by default).

Upstream behaviour (LLaMA-Factory 0.9.5, ``src/llamafactory/train/sft/workflow.py``): the SFT collator is built with
``pad_to_multiple_of=8`` (when training), with no key to change it. On real data of unequal lengths every step can meet
a new padded length; kernels that specialise on the length (Triton's autotuning and compilation of the DeltaNet and
attention kernels, graph compilers on NPU) then compile again. On CUDA fla-core 0.6.0 keeps the length out of its
autotune keys, so a new length costs a compile only when the number of 64-token chunks crosses a power of two
(docs/lab/2026-12-01-performance-options.md); on NPU each new shape can cost more. Padding to a multiple such as 256
bounds the shapes at ``cutoff_len / 256``, at the price of computing padding (masked out of attention and labels, so the
loss is unchanged).

What this patch does: sets ``pad_to_multiple_of`` on each collator of the multimodal family to ``multiple``
before it pads (the padded positions get attention mask 0 and label -100, as LLaMA-Factory's own padding).
Proof per rank: the multiple, and at the first batch the padded length.

Versions: written and tested against llamafactory 0.9.5 (``SUPPORTED``). Delete this patch when LLaMA-Factory
lets a config choose ``pad_to_multiple_of``.
"""

from __future__ import annotations

import importlib
from typing import Any

from packaging.specifiers import SpecifierSet
from pydantic import BaseModel, ConfigDict, Field

from .core.proof import ProofFile, utc_now
from .core.versions import require_symbols
from .core.wrapping import unwrap, wrap_once

NAME = "pad_lengths"
SUPPORTED = {"llamafactory": SpecifierSet(">=0.9.5,<0.9.6")}
MODULE = "llamafactory.data.collator"
CLASS = "MultiModalDataCollatorForSeq2Seq"


class Options(BaseModel):
    """``launcher.patches.pad_lengths``: off unless named; ``multiple`` tokens (default 256)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    enabled: bool = False
    multiple: int = Field(256, ge=8, le=65536)


_state: dict[str, Any] = {}


def check_symbols() -> None:
    """The collator class exists and pads through ``pad_to_multiple_of`` (transformers' DataCollatorForSeq2Seq)."""
    module = require_symbols(NAME, MODULE, (CLASS,), "llamafactory")
    if "pad_to_multiple_of" not in getattr(getattr(module, CLASS), "__dataclass_fields__", {}):
        from .core.errors import PatchError

        raise PatchError(
            NAME,
            f"{MODULE}.{CLASS} has no pad_to_multiple_of field",
            "install llamafactory>=0.9.5,<0.9.6, or turn the patch off",
        )


def _make_call(original):
    def __call__(self, features):
        if _state.get("multiple"):
            self.pad_to_multiple_of = _state["multiple"]
        batch = original(self, features)
        if _state.get("multiple") and not _state.get("first_batch_recorded"):
            _state["first_batch_recorded"] = True
            _state["proof"].update(first_batch={"seq_len": int(batch["input_ids"].shape[-1]), "at": utc_now()})
        return batch

    return __call__


def apply(options: dict[str, Any], *, backend: str, proof: ProofFile, facts: dict[str, Any]) -> dict[str, Any]:
    """Wrap the collator once (idempotent; it wraps whatever ``__call__`` is there, our other wrapper too)."""
    wrap_once(getattr(importlib.import_module(MODULE), CLASS), "__call__", NAME, _make_call)
    _state.clear()
    _state.update(multiple=options["multiple"], proof=proof)
    return {"replaced": [f"{MODULE}.{CLASS}.__call__ (pad_to_multiple_of)"], "multiple": options["multiple"]}


def observe(*, backend: str, proof: ProofFile) -> None:
    """Disabled: LLaMA-Factory pads to a multiple of 8."""
    restore()


def restore() -> None:
    """Unwrap the collator if this patch's wrapper is the outermost one; forget the state either way."""
    unwrap(MODULE, CLASS, "__call__", NAME)
    _state.clear()
