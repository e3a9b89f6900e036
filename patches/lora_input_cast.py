"""LoRA without the fp32 round trip of the activations under autocast.

Upstream behaviour (peft 0.18.1, ``tuners/lora/layer.py``, ``Linear.forward``): before the LoRA branch,
``x = self._cast_input_dtype(x, lora_A.weight.dtype)`` (``tuners/tuners_utils.py``) casts the layer's input
to the dtype of the LoRA weights. LLaMA-Factory 0.9.5 keeps trainable parameters in fp32
(``upcast_trainable_params``), so every LoRA layer copies its bf16 input ``[B, T, hidden]`` to fp32, runs the
dropout on the fp32 copy, and then autocast (the Trainer's bf16 mixed precision, through accelerate) casts it
back to bf16 for ``lora_A``'s matmul: two copies and an fp32 dropout per layer, forward and in every recompute,
for a matmul that runs in bf16 either way. axolotl removes the same round trip (its PR #3732).

What this patch does: wraps ``BaseTunerLayer._cast_input_dtype`` so that, while autocast is on for the input's
device and the input already has autocast's dtype, the input is left as it is (autocast casts the fp32 LoRA
weights for the matmul, once per forward). The dropout probability is the config's, applied to the bf16
input; the matmuls are the bf16 ones autocast ran before, and the gradients reach the fp32 LoRA weights as
before. Without autocast (fp32 training, pure bf16) PEFT's cast runs unchanged, so nothing changes on CPU
tests unless they train under autocast. Proof per rank: how many casts the first training step skipped.

Versions: peft 0.18.x (``SUPPORTED``). Delete this patch when PEFT skips the cast under autocast.
"""

from __future__ import annotations

import importlib
from typing import Any

from packaging.specifiers import SpecifierSet
from pydantic import BaseModel, ConfigDict

from .core import trainer_hook
from .core.errors import PatchError
from .core.proof import ProofFile, utc_now
from .core.versions import require_symbols
from .core.wrapping import unwrap, wrap_once

NAME = "lora_input_cast"
SUPPORTED = {"peft": SpecifierSet(">=0.18.1,<0.19")}
MODULE = "peft.tuners.tuners_utils"
CLASS = "BaseTunerLayer"


class Options(BaseModel):
    """``launcher.patches.lora_input_cast``: no options besides ``enabled``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    enabled: bool = True


_state: dict[str, Any] = {}


def check_symbols() -> None:
    """The cast helper exists and LoRA's ``Linear.forward`` still calls it."""
    require_symbols(NAME, MODULE, (CLASS,), "peft")
    base = getattr(importlib.import_module(MODULE), CLASS)
    lora = require_symbols(NAME, "peft.tuners.lora.layer", ("Linear",), "peft")
    if not hasattr(base, "_cast_input_dtype") or "_cast_input_dtype" not in lora.Linear.forward.__code__.co_names:
        raise PatchError(
            NAME,
            "peft's LoRA Linear.forward no longer casts its input through "
            "BaseTunerLayer._cast_input_dtype; the code this patch targets has changed",
            "install peft 0.18.x, or update patches/lora_input_cast.py",
        )


def skips(x, dtype) -> bool:
    """Whether the cast of ``x`` to ``dtype`` is one autocast would undo: autocast on for x's device, x already
    in autocast's dtype, and a wider target."""
    import torch

    if not isinstance(x, torch.Tensor) or x.dtype == dtype:
        return False
    kind = x.device.type
    return torch.is_autocast_enabled(kind) and x.dtype == torch.get_autocast_dtype(kind) and dtype == torch.float32


def _make_cast(original):
    def _cast_input_dtype(self, x, dtype):
        if _state.get("active") and skips(x, dtype):
            _state["skipped"] += 1
            return x
        return original(self, x, dtype)

    return _cast_input_dtype


def apply(options: dict[str, Any], *, backend: str, proof: ProofFile, facts: dict[str, Any]) -> dict[str, Any]:
    """Wrap the cast helper once (idempotent)."""
    wrap_once(getattr(importlib.import_module(MODULE), CLASS), "_cast_input_dtype", NAME, _make_cast)
    _state.clear()
    _state.update(active=True, proof=proof, skipped=0)
    trainer_hook.on_first_training_step(NAME, before=_before_first_step, after=_after_first_step)
    return {"replaced": [f"{MODULE}.{CLASS}._cast_input_dtype"]}


def _before_first_step(trainer, model) -> None:
    _state["skipped_before"] = _state["skipped"]


def _after_first_step(trainer, model) -> None:
    skipped = _state["skipped"] - _state["skipped_before"]
    note = None if skipped else "no cast skipped: the step ran without autocast (fp32, or bf16 without amp)"
    _state["proof"].update(first_training_step={"skipped_casts": skipped, "note": note, "recorded_at": utc_now()})


def skipped_casts() -> int:
    """The casts skipped since ``apply`` in this process; 0 while the patch is not applied."""
    return _state.get("skipped", 0)


def observe(*, backend: str, proof: ProofFile) -> None:
    """Disabled: PEFT casts LoRA inputs to fp32."""
    restore()


def restore() -> None:
    unwrap(MODULE, CLASS, "_cast_input_dtype", NAME)
    _state.clear()
