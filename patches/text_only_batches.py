"""Text-only runs: no dummy image in every batch, so the vision tower does no work at all.

Upstream behaviour (LLaMA-Factory 0.9.5, ``src/llamafactory/data/collator.py``,
``MultiModalDataCollatorForSeq2Seq.__call__``): when the template's multimodal plugin has an image token
(the ``qwen3_5*`` and ``qwen3_vl*`` templates do) and a batch holds no image and no video, the collator
appends a 64x64 white image to the first sample, with its tokens masked out of attention and labels ("avoid
process hanging in zero3/fsdp case"). So a text-only run still sends the 27-block vision tower through
forward, recompute and backward on every step, and attention gets an explicit mask: measured on one H200
through the launcher, turning it off took the 27B step from 2,545 to 2,814 tokens/s
(docs/lab/2026-12-01-performance-options.md).
The dummy exists for a real reason: under FSDP or ZeRO-3 every rank must run the vision tower's
collectives if any rank does, so a batch with an image on one rank and none on another would hang.

What this patch does: only when the launcher found, before the run, that none of the run's datasets (train
and eval) holds an image or a video (``facts["dataset_media"]``, written into ``launch.json`` from
``dataset_info.json`` and the records), and that the vision tower and projector stay frozen (LLaMA-Factory's
default; a trainable one would get no gradient, which DDP refuses at the next step), it gives each
collator its own copy of the template whose plugin
has no image token, so the dummy is never built; no rank ever runs the vision tower, so no rank can wait on
another's. A run whose data has any image or video, or whose media could not be counted, keeps
LLaMA-Factory's behaviour unchanged (the proof says which). A batch that does carry media under the patch
(the data changed after the check) stops the run with the reason instead of training wrongly.

Pure Python, no device code. Proof per rank: whether the dummy was skipped and why, and at the first batch
the collator class and the batch's sequence length.

Versions: written and tested against llamafactory 0.9.5 (``SUPPORTED``). Delete this patch when
LLaMA-Factory skips the dummy image for text-only datasets by itself.
"""

from __future__ import annotations

import copy
import importlib
from typing import Any

from packaging.specifiers import SpecifierSet
from pydantic import BaseModel, ConfigDict

from .core.errors import PatchError
from .core.proof import ProofFile, utc_now
from .core.versions import require_symbols
from .core.wrapping import original_of, unwrap, wrap_once

NAME = "text_only_batches"
SUPPORTED = {"llamafactory": SpecifierSet(">=0.9.5,<0.9.6")}
MODULE = "llamafactory.data.collator"
CLASS = "MultiModalDataCollatorForSeq2Seq"
MEDIA_KEYS = ("images", "videos")
_OWN_TEMPLATE = "__deltanet_launcher_text_only_template__"


class Options(BaseModel):
    """``launcher.patches.text_only_batches``: no options besides ``enabled``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    enabled: bool = True


_state: dict[str, Any] = {}


def check_symbols() -> None:
    """The collator class exists and still reads the plugin's image token to decide on the dummy."""
    module = require_symbols(NAME, MODULE, (CLASS,), "llamafactory")
    call = getattr(module, CLASS).__call__
    code = original_of(call).__code__
    if "image_token" not in code.co_names or "mm_plugin" not in code.co_names:
        raise PatchError(
            NAME,
            f"{MODULE}.{CLASS}.__call__ no longer reads template.mm_plugin.image_token, so hiding it would not "
            "skip the dummy image",
            "install llamafactory>=0.9.5,<0.9.6, or turn the patch off with launcher.patches.text_only_batches: false",
        )


def media_verdict(facts: dict[str, Any]) -> tuple[bool, str]:
    """Whether the dummy can go: the run's data is known to be text-only and nothing of the vision tower
    trains (under DDP a trainable parameter without a gradient stops the next step), and why."""
    if facts.get("vision_trainable"):
        return False, (
            "the vision tower or projector trains (freeze_vision_tower or freeze_multi_modal_projector "
            "is false): its parameters need the dummy image's gradient; dummy kept"
        )
    media = facts.get("dataset_media")
    if not isinstance(media, dict) or not media.get("counted"):
        why = (media or {}).get("why") if isinstance(media, dict) else None
        return False, f"the run's media could not be counted ({why or 'no count in launch.json'}); dummy kept"
    found = {key: int(media.get(key) or 0) for key in MEDIA_KEYS}
    if any(found.values()):
        return False, f"the data holds {found['images']} image(s) and {found['videos']} video(s); dummy kept"
    names = ", ".join(media.get("datasets", []))
    if not media.get("records"):
        return True, f"no dataset of {names} maps an image or video column"
    return True, f"no image or video in the {media['records']} records of {names} that map a media column"


def _text_only_template(collator):
    own = getattr(collator, _OWN_TEMPLATE, None)
    if own is None:
        own = copy.copy(collator.template)
        own.mm_plugin = copy.copy(own.mm_plugin)
        own.mm_plugin.image_token = None
        setattr(collator, _OWN_TEMPLATE, own)
    return own


def _make_call(original):
    def __call__(self, features):
        if not _state.get("active"):
            return original(self, features)
        carried = [key for feature in features for key in MEDIA_KEYS if feature.get(key)]
        if carried:
            raise PatchError(
                NAME,
                f"a batch carries {', '.join(sorted(set(carried)))} although the data was counted text-only "
                "before the run (the dataset changed since)",
                "start the run again so the launcher counts the data anew",
            )
        shared, self.template = self.template, _text_only_template(self)
        try:
            batch = original(self, features)
        finally:
            self.template = shared
        if not _state.get("first_batch_recorded"):
            _state["first_batch_recorded"] = True
            _state["proof"].update(
                first_batch={
                    "collator": type(self).__name__,
                    "samples": len(features),
                    "seq_len": int(batch["input_ids"].shape[-1]),
                    "pixel_values": "pixel_values" in batch,
                    "recorded_at": utc_now(),
                }
            )
        return batch

    return __call__


def apply(options: dict[str, Any], *, backend: str, proof: ProofFile, facts: dict[str, Any]) -> dict[str, Any]:
    """Wrap the collator once (idempotent); skip the dummy only for data counted text-only."""
    wrap_once(getattr(importlib.import_module(MODULE), CLASS), "__call__", NAME, _make_call)
    text_only, why = media_verdict(facts)
    _state.clear()
    _state.update(active=text_only, proof=proof)
    return {"replaced": [f"{MODULE}.{CLASS}.__call__"], "dummy_image": "skipped" if text_only else "kept", "why": why}


def observe(*, backend: str, proof: ProofFile) -> None:
    """Disabled: LLaMA-Factory appends its dummy image to every text-only batch."""
    restore()


def restore() -> None:
    """Put the upstream collator back and forget this process's state."""
    unwrap(MODULE, CLASS, "__call__", NAME)
    _state.clear()
