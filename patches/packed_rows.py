"""Packed rows for the hybrid model: every sample of a row starts from a clean state in every kind of layer.

Upstream behaviour:

- LLaMA-Factory 0.9.5 (``data/processor/supervised.py``, ``PackedSupervisedDatasetProcessor``) packs whole
  samples into rows of the config's ``cutoff_len`` tokens (it lowers its own copy by one and pads each row to
  that plus one), at least one of them padding; a sample longer than ``cutoff_len - 1`` is dropped. Under
  ``neat_packing`` the row's 2D attention mask numbers the samples (1, 1, 2, 2, 2, 0 for padding), the Qwen3.5
  collator computes the position ids of each sample
  on its own (``_compute_rope_position_ids_with_packing``: they restart at 0), and
  ``SFTDataCollatorWith4DAttentionMask`` turns the mask into a 4D block-diagonal causal mask
  (``prepare_4d_attention_mask``) unless attention is ``flash_attention_2``. With plain ``packing`` the mask
  is all ones: samples see each other.
- transformers 5.6.0 (``masking_utils._preprocess_mask_arguments``) hands a 4D mask to the full-attention
  layers as it is, so attention stays inside each sample. But ``Qwen3_5GatedDeltaNet.forward`` knows no
  sample boundary: its causal convolution (kernel 4) reads the previous sample's last three tokens and its
  chunk kernel is called without ``cu_seqlens``, so the recurrent state flows from one sample into the next.
- LLaMA-Factory 0.9.5's own Qwen3.5 packing (``model/patcher.py``, only with ``flash_attn: fa2``) replaces
  the decoder and DeltaNet forwards with direct FLA varlen calls, bypassing the routing patch and its proof,
  and meets transformers 5.6.0's broken flash-attention function; ``launcher check`` refuses it.

What this patch does:

1. wraps ``Qwen3_5GatedDeltaNet.forward`` (and the MoE twin): when the layer's mask is 4D (a packed row),
   it reads the samples off the mask's diagonal and sub-diagonal (``segments``), checks once per process
   that the mask is exactly block-diagonal causal, and runs the layer with the convolution reset at every
   sample start (``segment_causal_conv``: the row's convolution, then the first ``K - 1`` tokens of every
   sample computed again from that sample alone; where the layer is bound to FLA's convolution by the ``fused_ops``
   patch, that kernel takes the row's ``cu_seqlens`` instead) and the routed chunk kernel per sample: FLA's kernel
   once, with the row's ``cu_seqlens`` (the rows flattened to batch 1, as FLA requires) and the key heads unrepeated
   (``value_heads``); the torch reference once per sample. FLA's two kernels take the padding joined to the sample
   before it (``Segments.state_bounds``), so a batch of one row holding one sample goes to them without
   ``cu_seqlens``, as an unpacked step does. An unpacked batch without a cache, where the layer's chunk kernel is
   FLA's and its key heads serve several value heads (the 27B: 16 for 48), goes through the same arithmetic
   (``packed_forward`` with no segments: transformers' padding zeroing, the layer's own convolution, one kernel
   call) so that its key heads reach the kernel unrepeated too (option ``unpacked_forward``, on by default;
   recorded as ``first_unpacked_call``). Everything else goes to the upstream forward unchanged (generation, the
   torch reference). A packed row with a cache (generation) or whose mask is not as long as the row
   (LLaMA-Factory's dummy image appended to a packed batch) stops the run.
2. routes the full-attention layers of a packed row (``Qwen3_5Attention``, the MoE twin; through the ``sdpa`` entry
   of transformers' attention functions, which the layers look up at every call) to a varlen kernel where the
   device has one: on CUDA FlashAttention 2 with the row's ``cu_seqlens`` through
   ``torch.ops.aten._flash_attention_forward`` (``ATEN_FLASH``: the operator ``varlen_attn`` wraps and torch's nested
   tensors call, in every torch from 2.7.1, the images', to 2.14; it shares key heads, which ``varlen_attn`` before
   ``enable_gqa`` repeats: a 27B attention layer 0.8 ms slower on an H100,
   docs/lab/2026-12-06-packed-padding-key-heads.md), or through
   ``torch.nn.attention.varlen.varlen_attn`` where the operator's arguments are not the ones expected;
   ``torch_npu.npu_fusion_attention`` (layout ``TND`` with the samples'
   cumulative lengths, causal ``sparse_mode`` 3) on NPU; bf16/fp16 only, the row's padding cut into segments of
   ``PADDING_PIECE`` tokens (``Segments.cu_seqlens``); elsewhere (CPU, fp32) the block mask stays with SDPA. On
   CUDA a batch of one row holding one sample, its padding after it, goes to SDPA causal over the whole row without
   the mask instead where SDPA would run that call with cuDNN's kernel (``ONE_SAMPLE``: the unpacked step's call and
   kernel, exact for the sample's tokens; ``sdpa_uses_cudnn``), and is checked at its first call too. Its
   first call is checked against SDPA with the mask on the row's real tokens; a disagreement stops the run (the
   option ``varlen_attention: false`` keeps the mask). Only the mask the DeltaNet layers read as packed rows (the
   same tensor object) takes this path; every other call goes to SDPA unchanged.
3. wraps ``SFTDataCollatorWith4DAttentionMask.__call__``: on every packed batch it checks that the text
   position ids restart at 0 at every sample start and never go back inside it, and stops the run otherwise.
   With ``device_mask`` (the default) the collator's 4D step is skipped: the batch keeps LLaMA-Factory's 2D
   sample numbers, as ``int32`` (``NUMBERS``: the mark; LLaMA-Factory's masks come from transformers'
   ``DataCollatorForSeq2Seq`` through ``tokenizer.pad``, int64, as the tokenizer's do), and the wrapped
   ``Qwen3_5TextModel.forward`` (and the MoE twin) builds the same 4D mask from them on their device
   (``block_causal_mask``: LLaMA-Factory's own function, on that device, in the collator's ``compute_dtype``, or the
   embeddings' dtype in a process that collated nothing) and reads the samples off the numbers
   (``numbered_segments``) instead of the mask's diagonals. At 4,096 tokens LLaMA-Factory's CPU mask took 7 to
   13 ms and its copy to the device 2 to 5 ms a batch, in the training process between two steps; the same mask
   built on the device 0.23 ms (three readings on H100 hosts, ``benchmarks.lab.attention_bench``; then by an
   elementwise build of our own, equal entry for entry, since replaced by LLaMA-Factory's function).
   Then it cuts the batch after the last sample token of its fullest row, rounded up to ``cut_padding`` tokens
   (default 256; ``cut_padding``): LLaMA-Factory pads every packed row to ``cutoff_len``, and the layers compute
   that padding as they compute tokens, though no sample token and no loss term depends on it.
   The collator wrapper only checks, converts and cuts, so it may run in DataLoader workers
   (``dataloader_num_workers > 0``); the packed batches are counted and recorded where the model meets them, in the
   wrapped text model's forward, in the training process.

Nothing is shared between samples, which ``tests/patches/test_packing.py`` shows on the tiny model: each sample's
loss and the LoRA gradients of a packed row equal those of the samples run alone (fp32, 1e-4), and a
planted leak (no convolution reset, or no ``cu_seqlens``) fails that comparison.

Proof per rank: the first packed batch the model met (rows, samples per row, position ids checked), the first
packed DeltaNet call (kernel, ``cu_seqlens``, mask checked), the first packed attention call (kernel, its check;
then the first of ``ONE_SAMPLE`` and the first on a row of several samples, each checked) and, at the first
training step, the packed and the unpacked DeltaNet calls in it (recomputes included); the first
unpacked call on the FLA route (``first_unpacked_call``: rows, key and value heads, padding zeroed). When the
launcher's facts say the run packs, a first training batch that reaches the model unpacked stops the run before
any layer runs it, and a first step whose DeltaNet layers met no packed row stops it before the second.

The machinery is in ``patches/packing/``, one module per concern: the samples of a row and its mask (``masks``),
the DeltaNet layer per sample (``deltanet``), the varlen attention kernels (``varlen``) and the collated batch
(``batches``); this module holds the patch: its options, the wrappers, the proof and ``apply``.

Versions: written and tested against transformers 5.6.0 and llamafactory 0.9.5 (``SUPPORTED``). Delete this
patch when transformers' Qwen3.5 DeltaNet takes ``cu_seqlens`` from packed inputs by itself and hands FLA's kernel
the key heads unrepeated (turning the patch off turns ``unpacked_forward`` off with it).
"""

from __future__ import annotations

import functools
import importlib
import sys
import weakref
from typing import Any

from packaging.specifiers import SpecifierSet
from pydantic import BaseModel, ConfigDict, Field

from .core import trainer_hook
from .core.errors import PatchError
from .core.proof import ProofFile, utc_now
from .core.versions import require_symbols
from .core.wrapping import original_of, unwrap, wrap_once
from .kernels import fused_kernels
from .packing import batches, deltanet, masks, varlen

NAME = "packed_rows"
SUPPORTED = {"transformers": SpecifierSet(">=5.6.0,<5.7"), "llamafactory": SpecifierSet(">=0.9.5,<0.9.6")}
DELTANET = (
    ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5GatedDeltaNet"),
    ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet"),
)
ATTENTION = (
    ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5Attention"),
    ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeAttention"),
)
TEXT_MODEL = (
    ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5TextModel"),
    ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeTextModel"),
)
COLLATOR = ("llamafactory.data.collator", "SFTDataCollatorWith4DAttentionMask")
MASKED = "sdpa with the block mask"
# A row of one sample, its padding after it, through SDPA causal over the whole row without the mask, as an unpacked
# step runs, where SDPA would run it with cuDNN's kernel: exact for every sample token (causal order keeps them off
# the padding, and nothing of a sample reads the padding's outputs), and 0.63 to 1.86 ms a checkpointed 27B attention
# layer cheaper than FlashAttention 2's varlen kernel on rows of 3,162 and 4,095 tokens on an H100 with torch 2.11
# (docs/lab/2026-12-06-unrepeated-key-heads.md); in training 5 to 9 ms a one-sample row
# (docs/lab/2026-12-06-one-sample-route.md).
# Where SDPA would pick FlashAttention 2 the whole row would cost more than the varlen call on the sample and its
# padding pieces, which stays there. SDPA on each sample's own slice of the row was measured too and left out: it
# gained 0.08 ms a layer on one sample (against the whole row) and 0.1 ms on two (against the varlen call), lost 0.9 ms
# on three, and cuDNN builds a graph for every new slice length (0.1 to 0.5 s each), which showed in training as
# slower steps.
ONE_SAMPLE = "sdpa, causal over the row (one sample, its padding after it)"
NUMBERS = "int32"  # the dtype that marks a batch's attention_mask as LLaMA-Factory's sample numbers (see device_mask)
VARLEN_AGREEMENT = 2e-2  # relative L2 difference to SDPA with the mask on real tokens (bf16 rounding is ~4e-3)
FIX = "turn packing off (packing: false, neat_packing: false), or report the LLaMA-Factory/transformers versions"


class Options(BaseModel):
    """``launcher.patches.packed_rows``: ``enabled``, ``varlen_attention``, ``device_mask``, ``unpacked_forward``,
    ``cut_padding``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    enabled: bool = True
    # attention of packed rows through a varlen kernel where the device has one (CUDA, NPU); false: the block mask
    varlen_attention: bool = True
    # build the packed row's 4D mask on the device from LLaMA-Factory's sample numbers; false: its collator builds
    # it on the CPU (32 MiB at 4,096 tokens in bf16: 7 to 13 ms and a 2 to 5 ms copy a batch,
    # docs/lab/2026-12-05-packed-target-three-readings.md)
    device_mask: bool = True
    # unpacked batches (no cache) through the same layer arithmetic where the chunk kernel is FLA, so their key
    # heads reach it unrepeated too; false: transformers' forward repeats them (see ``value_heads``)
    unpacked_forward: bool = True
    # cut a packed batch after the last sample token of its fullest row, rounded up to a multiple of this many tokens
    # (``cut_padding``); 0: every row as long as LLaMA-Factory pads it (cutoff_len)
    cut_padding: int = Field(256, ge=0, le=1 << 20)


_state: dict[str, Any] = {}
_cache: dict[str, Any] = {}  # "held": (weakref to the last packed mask, its segments); one mask per forward


def _packed_segments(mask) -> masks.Segments | None:
    """The segments of ``mask`` when it is the mask the DeltaNet layers read as packed rows, else None."""
    held = _cache.get("held")
    return held[1] if mask is not None and held is not None and held[0]() is mask else None


def _segments_of(mask) -> masks.Segments:
    """Segments of ``mask``, read once per mask object (recompute in the backward passes the same object)."""
    found = _packed_segments(mask)
    if found is None:
        found = masks.segments(mask)
        _cache["held"] = (weakref.ref(mask), found)
    return found


def sdpa_uses_cudnn(query, key, value, scaling: float | None) -> bool:
    """Whether torch's SDPA would run the unpacked step's call (causal, no mask, key heads shared) on tensors of these
    shapes with cuDNN's kernel (``torch._fused_sdp_choice``), asked once per shape; False where this torch cannot be
    asked so."""
    import torch

    shapes = (tuple(query.shape), tuple(key.shape), query.dtype, str(query.device), scaling)
    if shapes not in _cache.setdefault("sdpa_cudnn", {}):
        try:
            from torch.nn.attention import SDPBackend

            chosen = torch._fused_sdp_choice(query, key, value, None, 0.0, True, scale=scaling, enable_gqa=True)
            _cache["sdpa_cudnn"][shapes] = int(chosen) == SDPBackend.CUDNN_ATTENTION.value
        except (AttributeError, ImportError, TypeError, RuntimeError):
            _cache["sdpa_cudnn"][shapes] = False
    return _cache["sdpa_cudnn"][shapes]


def _check_attention(kernel, out, reference, found: masks.Segments, record: dict[str, Any], key: str) -> None:
    """Compare the kernel's output with SDPA under the mask on the real tokens, recorded as ``key``; stop the run
    when they disagree."""
    difference = varlen.agreement(out.detach(), reference, found)
    record.update(
        samples_per_row=found.samples_per_row(),
        checked_against=MASKED,
        limit=VARLEN_AGREEMENT,
        relative_l2_difference=round(difference, 6),
        recorded_at=utc_now(),
    )
    if not difference <= VARLEN_AGREEMENT:
        _state["proof"].update(**{key: record, "status": "failed"})
        raise PatchError(
            NAME,
            (
                f"the attention route {kernel} disagrees with SDPA under the block mask on a packed row "
                f"(relative difference {difference:.3g}, limit {VARLEN_AGREEMENT})"
            ),
            "set launcher.patches.packed_rows.varlen_attention: false to keep the block mask, and report the "
            "torch/torch_npu versions",
        )
    _state["proof"].update(**{key: record})


def _make_attention(original):
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        found = _packed_segments(attention_mask) if _state and isinstance(module, _state["attention"]) else None
        if found is None:
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        scaling, dropout = kwargs.get("scaling"), kwargs.get("dropout", 0.0)
        kernel = varlen.varlen_kernel(query, scaling, dropout) if _state["varlen_attention"] else None
        if (
            kernel in (varlen.ATEN_FLASH, varlen.TORCH_VARLEN)
            and found.one_sequence()
            and sdpa_uses_cudnn(query, key, value, scaling)
        ):
            kernel = ONE_SAMPLE
        if kernel is None:
            out = original(module, query, key, value, attention_mask, *args, **kwargs)
        elif kernel == ONE_SAMPLE:
            out = original(module, query, key, value, None, *args, **kwargs)
        else:
            try:
                out = (varlen.varlen_attention(kernel, query, key, value, found, scaling), None)
            except RuntimeError as error:
                raise PatchError(
                    NAME,
                    f"the varlen attention kernel {kernel} failed on a packed row: {error}",
                    "set launcher.patches.packed_rows.varlen_attention: false to keep the block mask",
                ) from error
        # checked against the mask: the first call, the first call of ONE_SAMPLE and, for a varlen kernel, the first
        # on a row holding several samples (only there would a kernel that ignores the sample boundaries show)
        several = False
        if kernel == ONE_SAMPLE:
            due = None if _state.get("one_sample_checked") else "first_one_sample_attention"
        elif kernel is not None and not _state.get("multi_sample_checked"):
            several = max(found.samples_per_row()) >= 2
            due = "first_multi_sample_attention" if several else None
        else:
            due = None
        if _state.get("first_attention"):
            if due is None:
                return out  # every later call once the checks are done: nothing counted per call
        else:
            due = "first_packed_attention"
        record = {
            "kernel": kernel or MASKED,
            "device": str(query.device),
            "dtype": str(query.dtype),
            "heads": query.shape[1],
            "key_heads": key.shape[1],
            "head_dim": query.shape[-1],
        }
        if kernel is None:
            _state["proof"].update(first_packed_attention={**record, "recorded_at": utc_now()})
        else:
            import torch

            with torch.no_grad():
                reference = original(module, query, key, value, attention_mask, *args, **kwargs)[0]
            _check_attention(kernel, out[0], reference, found, record, due)
            if kernel == ONE_SAMPLE:
                _state["one_sample_checked"] = True
            elif several:
                _state["multi_sample_checked"] = True
        _state["first_attention"] = True
        return out

    return attention


def _make_forward(original):
    zero_padding = sys.modules[original_of(original).__module__].apply_mask_to_padding_states  # its own module's

    def forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
        if attention_mask is None or attention_mask.dim() != 4 or not _state:
            if cache_params is None and _state.get("unpacked_forward") and deltanet.unrepeated(self):
                return _unpacked(self, hidden_states, attention_mask, zero_padding)
            return original(self, hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)
        if cache_params is not None:
            raise PatchError(
                NAME,
                "a packed row came with a cache (generation or use_cache); its DeltaNet "
                "state would not be filled per sample",
                "generate from unpacked prompts (packing: false)",
            )
        if attention_mask.shape[-1] != hidden_states.shape[1]:
            raise PatchError(
                NAME,
                (
                    f"a packed row's mask covers {attention_mask.shape[-1]} positions but the row has "
                    f"{hidden_states.shape[1]} tokens (LLaMA-Factory appended a dummy image to a packed batch), so "
                    "its samples cannot be told apart"
                ),
                "keep launcher.patches.text_only_batches on with text-only data, or turn packing off",
            )
        found = _segments_of(attention_mask)
        _state["calls"] += 1  # recomputes of checkpointed layers included
        if not _state.get("first_call"):
            wrong = masks.block_causal_mismatch(attention_mask, found)
            if wrong:
                raise PatchError(
                    NAME,
                    (
                        f"a DeltaNet layer got a 4D mask that is not block-diagonal causal ({wrong} entries differ), "
                        "so its samples cannot be told apart"
                    ),
                    FIX,
                )
            kernel = self.chunk_gated_delta_rule
            label = getattr(kernel, "label", None)
            one = found.one_sequence()  # state_bounds gives FLA's kernels no cu_seqlens
            _state["first_call"] = True
            _state["proof"].update(
                first_packed_call={
                    "rows": found.rows,
                    "row_length": found.length,
                    "samples_per_row": found.samples_per_row(),
                    "kernel": getattr(kernel, "kernel_name", type(kernel).__name__),
                    "kernel_label": label,
                    "cu_seqlens": (
                        (
                            "none: one row of one sample, its padding joined to it"
                            if one
                            else f"one kernel call per batch, the padding joined to the sample before it: "
                            f"{found.cu_seqlens(joined=True)}"
                        )
                        if label == "fla"
                        else "one kernel call per sample"
                    ),
                    "conv_reset": (
                        (
                            "none needed: one row of one sample (FLA causal_conv1d)"
                            if one
                            else "cu_seqlens (FLA causal_conv1d)"
                        )
                        if fused_kernels.conv_of(self) is not None
                        else "at every sample start"
                    ),
                    "mask": "block-diagonal causal (checked)",
                    "device": str(hidden_states.device),
                    "recorded_at": utc_now(),
                }
            )
        return deltanet.packed_forward(self, hidden_states, found)

    return forward


def _unpacked(layer, hidden_states, attention_mask, zero_padding):
    """An unpacked batch through ``packed_forward``: transformers' arithmetic (its padding zeroed first by
    ``zero_padding``, transformers' own function of the layer's module), the key heads unrepeated; the first call
    on each rank is recorded."""
    hidden_states = zero_padding(hidden_states, attention_mask)
    if not _state.get("first_unpacked_call"):
        _state["first_unpacked_call"] = True
        rows, length = hidden_states.shape[:2]
        _state["proof"].update(
            first_unpacked_call={
                "rows": rows,
                "length": length,
                "key_heads": layer.num_k_heads,
                "padding_zeroed": attention_mask is not None and rows > 1 and length > 1,  # as transformers decides
                "value_heads": layer.num_v_heads,
                "key_heads_repeated": False,
                "kernel_label": layer.chunk_gated_delta_rule.label,
                "device": str(hidden_states.device),
                "recorded_at": utc_now(),
            }
        )
    _state["unpacked_calls"] += 1
    return deltanet.packed_forward(layer, hidden_states, None)


def _collate_numbers(original, collator, features):
    """The batch with LLaMA-Factory's 2D sample numbers left as they are (its 4D step skipped), as ``NUMBERS``."""
    import torch

    before, collator.block_diag_attn = collator.block_diag_attn, False
    try:
        batch = original(collator, features)
    finally:
        collator.block_diag_attn = before
    mask = batch.get("attention_mask")
    if torch.is_tensor(mask) and mask.dim() == 2 and not torch.is_floating_point(mask):
        batch["attention_mask"] = mask.to(_numbers())
        _state["mask_dtype"] = collator.compute_dtype
    return batch


def _make_collate(original):
    def __call__(self, features):
        import torch

        numbers = bool(_state) and _state["device_mask"] and batches.builds_4d_mask(self)
        batch = _collate_numbers(original, self, features) if numbers else original(self, features)
        mask = batch.get("attention_mask")
        if not _state or not torch.is_tensor(mask) or mask.dim() != (2 if numbers else 4):
            return batch
        if mask.shape[-1] != batch["input_ids"].shape[-1]:
            raise PatchError(
                NAME,
                (
                    f"a packed batch's mask covers {mask.shape[-1]} positions but its rows hold "
                    f"{batch['input_ids'].shape[-1]} tokens (LLaMA-Factory appended its dummy image to a packed batch)"
                ),
                "keep launcher.patches.text_only_batches on with text-only data, or turn packing off",
            )
        found = masks.numbered_segments(mask) if numbers else masks.segments(mask)
        position = batch.get("position_ids")
        text = position[0] if position is not None and position.dim() == 3 else position
        if text is None:
            raise PatchError(
                NAME,
                "a packed batch has no position_ids, so every sample would continue the positions of the one before it",
                FIX,
            )
        bad = [
            (row, start) for row, start, end, real in found.spans if real and not batches.restarts(text[row, start:end])
        ]
        if bad:
            raise PatchError(
                NAME,
                (
                    f"the position ids of {len(bad)} packed sample(s) do not restart at 0 at the sample start (row, "
                    f"position: {bad[:3]}), so rotary positions would run on across samples"
                ),
                FIX,
            )
        # counted where the model meets it: maybe a worker
        return batches.cut_padding(batch, found, _state["cut_padding"])

    return __call__


def _make_text_forward(original):
    def forward(self, *args, **kwargs):
        if not _state:
            return original(self, *args, **kwargs)
        mask, found, numbers = kwargs.get("attention_mask"), None, False
        if _state["device_mask"] and mask is not None and mask.dim() == 2 and mask.dtype == _numbers():
            found, numbers = masks.numbered_segments(mask), True
            kwargs["attention_mask"] = masks.block_causal_mask(mask, _state.get("mask_dtype") or _embedding_dtype(self))
            _cache["held"] = (weakref.ref(kwargs["attention_mask"]), found)  # the numbers are not read again
        elif mask is not None and mask.dim() == 4:
            found = _segments_of(mask)  # held for the DeltaNet layers, which get the same mask
        if self.training and _state.pop("awaiting_first_batch", False) and found is None:
            error = PatchError(
                NAME,
                (
                    "the run packs samples, but its first training batch reached the model unpacked (no sample numbers "
                    "and no 4D block mask: none came from LLaMA-Factory's neat packing), so the samples could not be "
                    "told apart"
                ),
                FIX,
            )
            _state["proof"].update(status="failed", error=str(error))
            raise error
        if found is not None:
            _record_batch(found, numbers)
        return original(self, *args, **kwargs)

    return forward


def _record_batch(found: masks.Segments, numbers: bool) -> None:
    """Count a packed batch the model met, and record the first, in the training process: the collator may have run
    in a DataLoader worker, whose counts never reach the training process and which writes no proof
    (``patches.core.proof``)."""
    _state["batches"] += 1
    _state["samples"] += sum(found.samples_per_row())
    _state["rows"] += found.rows
    if not _state.get("first_batch"):
        _state["first_batch"] = True
        _state["proof"].update(
            first_packed_batch={
                "rows": found.rows,
                "row_length": found.length,
                "samples_per_row": found.samples_per_row(),
                "padding_tokens": sum(end - start for _, start, end, real in found.spans if not real),
                "cut_padding": _state["cut_padding"] or "off (rows as long as LLaMA-Factory pads them)",
                # True: padding that cut_padding would cut reached the model (another per-token tensor, a label
                # after it)
                "left_whole": batches.cut_length(found, _state["cut_padding"]) < found.length,
                "position_ids": "restart at 0 in every sample (checked by the collator on every batch)",
                "mask": (
                    f"sample numbers ({NUMBERS}); the 4D mask is built on the device"
                    if numbers
                    else "4D, built by LLaMA-Factory's collator"
                ),
                "recorded_at": utc_now(),
            }
        )


def _numbers():
    import torch

    return getattr(torch, NUMBERS)


def _embedding_dtype(model):
    """The mask's dtype where neither this process's collator nor the Trainer's said it (a forward outside a
    training run): the model's compute dtype, which LLaMA-Factory's ``compute_dtype`` is."""
    return model.get_input_embeddings().weight.dtype


def check_symbols() -> None:
    """The DeltaNet classes exist and their constructors still set what the packed forward reads; the 4D
    collator exists."""
    needed = (
        "in_proj_qkv",
        "in_proj_z",
        "in_proj_b",
        "in_proj_a",
        "conv1d",
        "A_log",
        "dt_bias",
        "norm",
        "out_proj",
        "key_dim",
        "value_dim",
        "head_k_dim",
        "head_v_dim",
        "num_k_heads",
        "num_v_heads",
        "chunk_gated_delta_rule",
        "causal_conv1d_fn",
        "activation",
        "layer_idx",
    )
    for module_name, class_name in DELTANET:
        module = require_symbols(NAME, module_name, (class_name, "apply_mask_to_padding_states"), "transformers")
        missing = [name for name in needed if name not in getattr(module, class_name).__init__.__code__.co_names]
        if missing:
            raise PatchError(
                NAME,
                f"{class_name}.__init__ no longer sets {', '.join(missing)}",
                "install transformers>=5.6.0,<5.7, or turn packing off",
            )
    for module_name, class_name in ATTENTION + TEXT_MODEL:
        require_symbols(NAME, module_name, (class_name,), "transformers")
    utils = require_symbols(NAME, "transformers.modeling_utils", ("ALL_ATTENTION_FUNCTIONS",), "transformers")
    if "sdpa" not in utils.ALL_ATTENTION_FUNCTIONS:
        raise PatchError(
            NAME,
            "transformers' attention functions have no 'sdpa' entry",
            "install transformers>=5.6.0,<5.7, or turn packing off",
        )
    collator = getattr(require_symbols(NAME, COLLATOR[0], (COLLATOR[1],), "llamafactory"), COLLATOR[1])
    missing = [
        f
        for f in ("block_diag_attn", "attn_implementation", "compute_dtype")
        if f not in getattr(collator, "__dataclass_fields__", {})
    ]
    if missing:
        raise PatchError(
            NAME,
            f"{COLLATOR[1]} no longer has the field(s) {', '.join(missing)}",
            "install llamafactory>=0.9.5,<0.9.6, or turn packing off",
        )


def apply(options: dict[str, Any], *, backend: str, proof: ProofFile, facts: dict[str, Any]) -> dict[str, Any]:
    """Wrap the DeltaNet forwards, the ``sdpa`` attention function and the 4D collator once (idempotent)."""
    use_varlen = bool(options.get("varlen_attention", True))
    for module_name, class_name in DELTANET:
        wrap_once(getattr(importlib.import_module(module_name), class_name), "forward", NAME, _make_forward)
    for module_name, class_name in TEXT_MODEL:
        wrap_once(getattr(importlib.import_module(module_name), class_name), "forward", NAME, _make_text_forward)
    wrap_once(getattr(importlib.import_module(COLLATOR[0]), COLLATOR[1]), "__call__", NAME, _make_collate)
    _install_attention()
    _state.clear()
    _cache.clear()
    _state.update(
        proof=proof,
        packing=bool(facts.get("packing")),
        calls=0,
        unpacked_calls=0,
        batches=0,
        samples=0,
        rows=0,
        varlen_attention=use_varlen,
        device_mask=bool(options.get("device_mask", True)),
        unpacked_forward=bool(options.get("unpacked_forward", True)),
        cut_padding=int(options.get("cut_padding", Options().cut_padding)),
        attention=tuple(getattr(importlib.import_module(m), c) for m, c in ATTENTION),
    )
    trainer_hook.on_first_training_step(NAME, before=_before_first_step, after=_after_first_step)
    trainer_hook.on_training_step(NAME, 2, before=_before_second_step)
    return {
        "replaced": [f"{m}.{c}.forward" for m, c in DELTANET + TEXT_MODEL]
        + [".".join(COLLATOR) + ".__call__", "ALL_ATTENTION_FUNCTIONS['sdpa']"],
        "packing": _state["packing"],
        "varlen_attention": use_varlen,
        "device_mask": _state["device_mask"],
        "unpacked_forward": _state["unpacked_forward"],
        "cut_padding": _state["cut_padding"],
    }


_installed: dict[str, Any] = {}  # "wrapper": the sdpa entry this patch put in place, "previous": what it wrapped


def _install_attention() -> None:
    """Put the packed-row attention in front of the ``sdpa`` entry of transformers' attention functions (the
    entry's own override, once: nothing to do while the entry, or anything wrapping it, is ours)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    current = ALL_ATTENTION_FUNCTIONS["sdpa"]
    chain = []
    while current is not None and len(chain) < 16:
        chain.append(current)
        current = getattr(current, "__wrapped__", None)
    if _installed.get("wrapper") is not None and any(f is _installed["wrapper"] for f in chain):
        return
    previous = ALL_ATTENTION_FUNCTIONS["sdpa"]
    wrapper = functools.update_wrapper(_make_attention(previous), previous)
    _installed.update(wrapper=wrapper, previous=previous, was_local="sdpa" in ALL_ATTENTION_FUNCTIONS._local_mapping)
    ALL_ATTENTION_FUNCTIONS["sdpa"] = wrapper


def _remove_attention() -> None:
    """Put back the ``sdpa`` entry this patch replaced, where its wrapper is still the entry."""
    module = sys.modules.get("transformers.modeling_utils")
    functions = getattr(module, "ALL_ATTENTION_FUNCTIONS", None)
    wrapper = _installed.get("wrapper")
    if functions is not None and wrapper is not None and functions._local_mapping.get("sdpa") is wrapper:
        if _installed["was_local"]:
            functions["sdpa"] = _installed["previous"]
        else:
            del functions["sdpa"]
    _installed.clear()


def _before_first_step(trainer, model) -> None:
    """A run that packs must meet a packed row in its first training batch: the text model's forward checks it
    before any layer runs the batch, so the run stops before any sample could see another."""
    _state["awaiting_first_batch"] = _state["packing"]
    _state["calls_before_step"] = _state["calls"]
    _state["unpacked_before_step"] = _state["unpacked_calls"]
    if not _state.get("mask_dtype"):  # the collator ran in DataLoader workers: its dtype, not the embeddings'
        _state["mask_dtype"] = getattr(getattr(trainer, "data_collator", None), "compute_dtype", None)


def _after_first_step(trainer, model) -> None:
    calls = _state["calls"] - _state.pop("calls_before_step", 0)
    _state["first_step_calls"] = calls
    _state["proof"].update(
        first_training_step={
            "packed_deltanet_calls": calls,  # checkpointed layers count again when the backward recomputes them
            "unpacked_deltanet_calls": _state["unpacked_calls"] - _state.pop("unpacked_before_step", 0),
            "packed_batches_so_far": _state["batches"],
            "samples_per_row_mean": round(_state["samples"] / max(_state["rows"], 1), 2),
            "recorded_at": utc_now(),
        }
    )


def _before_second_step(trainer, model) -> None:
    """A run that packs must have met packed rows in the DeltaNet layers by now (the first step's record)."""
    if _state["packing"] and not _state.get("first_step_calls"):
        error = PatchError(
            NAME,
            (
                "the run packs samples, but no DeltaNet layer met a packed row in the first training step (the mask "
                "reaching them was not 4D), so state would flow between samples"
            ),
            FIX,
        )
        _state["proof"].update(status="failed", error=str(error))
        raise error


def observe(*, backend: str, proof: ProofFile) -> None:
    """Disabled: transformers' DeltaNet layers run packed rows as one sequence."""
    restore()


def restore() -> None:
    """Unwrap what this patch wrapped (where its wrapper is the outermost) and forget the state."""
    for module_name, class_name in DELTANET + TEXT_MODEL:
        unwrap(module_name, class_name, "forward", NAME)
    unwrap(*COLLATOR, "__call__", NAME)
    _remove_attention()
    _state.clear()
    _cache.clear()
