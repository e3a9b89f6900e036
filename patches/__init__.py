"""Runtime patches for upstream problems, one module per problem.

Contract used by the launcher (the host side imports this package without torch; patch modules import
torch, transformers and LLaMA-Factory only inside functions):

- ``PATCH_NAMES``: the registry's names, in the fixed order they are applied (see ``registry``).
- ``normalize_settings(raw)``: the ``launcher.patches`` section of a run config (name -> bool, or
  name -> mapping with ``enabled`` and patch options) turned into name -> {"enabled": bool, ...} for
  every registered patch, defaults filled in; raises ``ValueError`` listing every problem at once.
- ``apply_enabled(settings, *, backend, proof_dir, facts)``: inside a training process, before the model is
  built, apply every enabled patch in order and write proof records into ``proof_dir``
  (``proof_dir/rank<RANK>/<patch>.json``); raises ``PatchError`` when an enabled patch cannot apply.

Patches: ``deltanet_routing`` (DeltaNet kernel per backend), ``fused_ops`` (fused convolution, norms and SwiGLU
on CUDA and NPU), ``checkpoint_all_layers`` (non-reentrant
checkpointing of every layer, optionally a measured layer plan), ``chunked_loss`` (the loss without the whole
logits), ``text_only_batches`` (no dummy image for text-only data), ``final_eval_once`` (no second evaluation of the
final model) ``pad_lengths`` (off unless named: padding to a multiple of N tokens), ``lora_input_cast`` (no fp32 copy
of LoRA inputs under autocast), ``packed_rows`` (samples of a packed row kept apart), ``fsdp2_frozen_dtype`` (FSDP2
keeps the frozen base in its load dtype), ``fsdp2_resume_adapter`` (an FSDP2 resume restores every rank's LoRA
shards) and ``gc_freeze`` (full garbage collections skip the objects alive after the first optimizer step).
Each module's docstring says which upstream behaviour it changes, for which versions, and when it can be deleted.

Layout: the patches at the top of this package, one module each, and ``registry`` (their order and how one is
applied); below them their machinery by role, none of which imports a patch: ``core/`` (errors, proof records,
settings, version and symbol checks, wrapping, the Trainer hook), ``kernels/`` (what FLA can do here, the fused and
AscendC kernels, the kernel recorder), ``planning/`` (the measured layer plan and the FSDP2 shard census) and
``packing/`` (the machinery of ``packed_rows``).
"""

from __future__ import annotations

from .core.errors import PatchError
from .core.proof import proof_path, read_proof
from .registry import BACKENDS, PATCH_NAMES, apply_enabled, normalize_settings

__all__ = ["BACKENDS", "PATCH_NAMES", "PatchError", "apply_enabled", "normalize_settings", "proof_path", "read_proof"]
