"""The patch registry: which patches exist, in which order they apply, and how one is applied.

Order (fixed; ``PATCH_NAMES``):

1. ``deltanet_routing`` - replaces module globals of transformers' qwen3_5 modeling code, which the
   DeltaNet constructor reads, so it must be in place before the model is built.
2. ``fused_ops`` - replaces the DeltaNet convolution global after ``deltanet_routing`` wrote it (so it must
   follow it and precede the model build) and wraps the forwards of the norms and the MLP (class level).
3. ``checkpoint_all_layers`` - replaces a LLaMA-Factory model-preparation function and hooks the first
   ``Trainer.training_step``; it needs nothing from the first patch and must also precede the model build.
4. ``chunked_loss`` - wraps the ``Qwen3_5ForConditionalGeneration`` forward (class level) for calls with
   labels; independent of the others.
5. ``text_only_batches`` - wraps LLaMA-Factory's multimodal collator; acts only on data the launcher counted
   text-only (``facts``).
6. ``final_eval_once`` - wraps ``transformers.Trainer.evaluate``.
7. ``pad_lengths`` (off unless named) - wraps the same collator as 5, outside it, to set its padding multiple.
8. ``lora_input_cast`` - wraps PEFT's ``BaseTunerLayer._cast_input_dtype``; independent of the others.
9. ``packed_rows`` - wraps the DeltaNet forward (class level) and LLaMA-Factory's 4D-mask collator; acts only
   on packed rows (``neat_packing``), whose DeltaNet layers it runs one sample at a time on the routed kernel,
   so it needs ``deltanet_routing``'s recorders (``launcher check`` refuses packing without them).
10. ``fsdp2_frozen_dtype`` - wraps the ``fsdp2_prepare_model`` global of ``accelerate.accelerator`` (and, in a CPU
   FSDP2 rank, ``AcceleratorState.__init__``); acts only when accelerate prepares a model for FSDP2.
11. ``fsdp2_resume_adapter`` - wraps the ``load_fsdp_model`` global of ``transformers.trainer``; acts only when the
   Trainer loads a checkpoint of a PEFT model under FSDP2 (resume), after the model was prepared, so it needs nothing
   from the others.
12. ``gc_freeze`` - hooks ``Trainer.training_step`` (through ``trainer_hook``) to freeze the objects of Python's
   garbage collector before the call after the first optimizer step; independent of the others.

Each ``apply`` also gets ``facts``: what the launcher knew about the run before it started (``launch.json``:
the datasets' media count, ``cutoff_len``, whether it packs; on NPU preflight's ``kernel_choice``), the same on every
rank.

For each patch, in that order, ``apply_enabled``:

- disabled: writes ``{"enabled": false, ...}``, undoes the patch if this process applied it earlier, and
  lets the patch record what upstream does by itself (read-only);
- enabled: checks the package versions against ``SUPPORTED`` and the upstream symbols, applies the patch
  idempotently, and records the result. Any failure is recorded in the proof file and raised as
  ``PatchError``, which stops the run before the model is built.

A patch module provides ``NAME``, ``SUPPORTED``, ``Options`` (pydantic, ``extra="forbid"``),
``check_symbols()``, ``apply(options, *, backend, proof, facts) -> dict``, ``observe(*, backend, proof)`` and
``restore()``. Patch modules import torch and upstream packages only inside functions.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from . import (
    checkpoint_all_layers,
    chunked_loss,
    deltanet_routing,
    final_eval_once,
    fsdp2_frozen_dtype,
    fsdp2_resume_adapter,
    fused_ops,
    gc_freeze,
    lora_input_cast,
    packed_rows,
    pad_lengths,
    text_only_batches,
)
from .core import settings, trainer_hook
from .core.errors import PatchError
from .core.proof import ProofFile, RankInfo
from .core.versions import check_versions

logger = logging.getLogger(__name__)

PATCHES: dict[str, ModuleType] = {
    deltanet_routing.NAME: deltanet_routing,
    fused_ops.NAME: fused_ops,
    checkpoint_all_layers.NAME: checkpoint_all_layers,
    chunked_loss.NAME: chunked_loss,
    text_only_batches.NAME: text_only_batches,
    final_eval_once.NAME: final_eval_once,
    pad_lengths.NAME: pad_lengths,
    lora_input_cast.NAME: lora_input_cast,
    packed_rows.NAME: packed_rows,
    fsdp2_frozen_dtype.NAME: fsdp2_frozen_dtype,
    fsdp2_resume_adapter.NAME: fsdp2_resume_adapter,
    gc_freeze.NAME: gc_freeze,
}
PATCH_NAMES: tuple[str, ...] = tuple(PATCHES)
BACKENDS = ("npu", "cuda", "cpu")


def normalize_settings(raw: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The ``launcher.patches`` section as name -> full options for every registered patch, in order
    (see ``settings.normalize_settings``); raises ``ValueError`` listing every problem."""
    return settings.normalize_settings(raw, PATCHES)


def _header(name: str, options: dict[str, Any], backend: str, rank: RankInfo) -> dict[str, Any]:
    module = PATCHES[name]
    return {
        "patch": name,
        "enabled": options["enabled"],
        "options": {k: v for k, v in options.items() if k != "enabled"},
        "backend": backend,
        **rank.as_record(),
        "supported": {dist: str(spec) for dist, spec in module.SUPPORTED.items()},
    }


def apply_enabled(
    settings: Mapping[str, Any], *, backend: str, proof_dir: Path, facts: Mapping[str, Any] | None = None
) -> list[str]:
    """Apply the enabled patches in registry order and write one proof record per patch on this rank.

    Args:
        settings: the ``launcher.patches`` mapping, raw or as returned by ``normalize_settings``.
        backend: ``npu``, ``cuda`` or ``cpu``.
        proof_dir: the run's proof folder; records go to ``proof_dir/rank<RANK>/<patch>.json``.
        facts: what the launcher knew before the run (``launch.json``'s ``facts``); none by default.

    Returns:
        The names of the patches applied, in order.

    Raises:
        ValueError: invalid settings or backend.
        PatchError: an enabled patch cannot apply (wrong version, missing upstream symbol, unusable kernel).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend is {backend!r}; expected one of {', '.join(BACKENDS)}")
    normalized = normalize_settings(settings)
    rank = RankInfo.from_env()
    trainer_hook.clear()
    applied: list[str] = []
    for name, module in PATCHES.items():
        options = normalized[name]
        proof = ProofFile(Path(proof_dir), name, rank.rank)
        header = _header(name, options, backend, rank)
        if not options["enabled"]:
            proof.start({**header, "status": "disabled"})
            try:
                module.observe(backend=backend, proof=proof)
            except Exception as exc:  # observing a disabled patch must never stop a run
                logger.exception("patch %s is disabled; recording upstream behaviour failed", name)
                proof.update(observer_error=f"{type(exc).__name__}: {exc}")
            logger.info("patch %s: disabled by the config", name)
            continue
        proof.start({**header, "status": "checking"})
        try:
            found = check_versions(name, module.SUPPORTED)
            proof.update(versions=found)
            module.check_symbols()
            facts_found = module.apply(options, backend=backend, proof=proof, facts=dict(facts or {}))
        except PatchError as exc:
            proof.update(status="failed", error=str(exc))
            raise
        except Exception as exc:
            error = PatchError(
                name,
                f"applying failed with {type(exc).__name__}: {exc}",
                f"see the traceback; turn the patch off with launcher.patches.{name}: false "
                "only if you accept the upstream behaviour it fixes",
            )
            proof.update(status="failed", error=str(error))
            raise error from exc
        proof.update(status="applied", **facts_found)
        logger.info("patch %s: applied (%s)", name, ", ".join(f"{d} {v}" for d, v in found.items()))
        applied.append(name)
    return applied


def restore_all() -> None:
    """Undo every patch in this process and unhook the Trainer (for tests)."""
    for module in reversed(PATCHES.values()):
        module.restore()
    trainer_hook.uninstall()
