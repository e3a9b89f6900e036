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

Versions: written and tested against transformers 5.6.0 and llamafactory 0.9.5 (``SUPPORTED``). Delete this
patch when transformers' Qwen3.5 DeltaNet takes ``cu_seqlens`` from packed inputs by itself and hands FLA's kernel
the key heads unrepeated (turning the patch off turns ``unpacked_forward`` off with it).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any

from packaging.specifiers import SpecifierSet
from pydantic import BaseModel, ConfigDict, Field

from . import fused_ops
from .core import trainer_hook
from .core.errors import PatchError
from .core.proof import ProofFile, utc_now
from .core.versions import require_symbols
from .core.wrapping import original_of, unwrap, wrap_once
from .kernels.recorder import KernelRecorder

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
TORCH_VARLEN = "torch.nn.attention.varlen.varlen_attn"
ATEN_FLASH = "torch.ops.aten._flash_attention_forward"
# the leading arguments ATEN_FLASH is called with (torch 2.7.1 through 2.14, in this order), and its keyword
FLASH_ARGUMENTS = (
    "query",
    "key",
    "value",
    "cum_seq_q",
    "cum_seq_k",
    "max_q",
    "max_k",
    "dropout_p",
    "is_causal",
    "return_debug_mask",
)
NPU_VARLEN = "torch_npu.npu_fusion_attention"
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
# The varlen attention kernels take a row's padding as segments of at most this many tokens (``Segments.cu_seqlens``):
# padding attends only to padding and no sample token or loss term depends on its outputs, so any cut is exact for
# the samples, and a run of
# P padding tokens as one causal segment costs about (P / 4096)^2 of a full row's attention (LLaMA-Factory pads each
# packed row to cutoff_len: 1,614 of 4,096 tokens in a row holding one sample of 2,482), cut into pieces of 128
# (two of FlashAttention 2's 64-token tiles at head dim 256) about 128 / P of that
PADDING_PIECE = 128
VARLEN_AGREEMENT = 2e-2  # relative L2 difference to SDPA with the mask on real tokens (bf16 rounding is ~4e-3)
# the tensors of a packed batch that hold one entry per token (``cut_padding``), as LLaMA-Factory 0.9.5's collator
# hands a text-only batch over (``position_ids``: ``[3 or 4, B, T]`` for Qwen3.5's rotary sections)
CUT = ("input_ids", "attention_mask", "labels", "position_ids", "token_type_ids", "mm_token_type_ids")
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


@dataclass(frozen=True)
class Segments:
    """The samples of a batch of packed rows ``[B, T]``, read off a 4D mask.

    ``spans``: ``(row, start, end, real)`` of every segment in order, where ``real`` says whether it is a
    sample (its tokens attend to themselves) or padding (one segment per run of padding);
    ``position``: each token's offset inside its segment, ``[B, T]``.
    """

    rows: int
    length: int
    spans: tuple[tuple[int, int, int, bool], ...]
    position: Any
    _on_device: dict = field(default_factory=dict, compare=False, repr=False)  # index tensors, built once

    def heads(self, taps: int, device) -> tuple[Any, Any, Any]:
        """``(row, position, offset)`` of the first ``taps - 1`` tokens of every segment, as index tensors on
        ``device``: the only tokens whose causal window of ``taps`` would reach into the segment before."""
        key = ("heads", taps, str(device))
        if key not in self._on_device:
            import torch

            found = [
                (row, start + offset, offset)
                for row, start, end, _ in self.spans
                for offset in range(min(taps - 1, end - start))
            ]
            self._on_device[key] = tuple(
                torch.tensor(list(column), dtype=torch.long, device=device) for column in zip(*found, strict=True)
            )
        return self._on_device[key]

    def cu_seqlens_tensors(self, device, dtype=None, piece: int = 0, joined: bool = False) -> tuple[Any, Any]:
        """``cu_seqlens`` on ``device`` and on the CPU (FLA takes both, so it never reads them back); int64
        unless ``dtype`` (FlashAttention takes int32); the padding in pieces of ``piece`` tokens, or ``joined`` to
        the sample before it (``cu_seqlens``)."""
        key = ("cu_seqlens", str(device), str(dtype), piece, joined)
        if key not in self._on_device:
            import torch

            bounds = self.cu_seqlens(piece, joined)
            dtype = dtype or torch.long
            self._on_device[key] = (torch.tensor(bounds, dtype=dtype, device=device), torch.tensor(bounds, dtype=dtype))
        return self._on_device[key]

    def state_bounds(self, device) -> tuple[Any, Any]:
        """The ``cu_seqlens`` (on ``device``, on the CPU) FLA's DeltaNet kernels, the convolution and the chunk
        kernel, take for these rows: the padding joined to the sample before it, and (None, None) where that leaves
        one sequence (a batch of one row holding one sample: batch size 1 per device), which the kernels then run as
        they run an unpacked step. FLA's convolution took 1.59 ms forward+backward with ``cu_seqlens`` against 1.39
        without at the 27B width on an H100 (docs/lab/2026-12-06-packed-attention-alone.md), in each of 48 layers a
        step."""
        key = ("state", str(device))
        if key not in self._on_device:
            self._on_device[key] = (None, None) if self.one_sequence() else self.cu_seqlens_tensors(device, joined=True)
        return self._on_device[key]

    def one_sequence(self) -> bool:
        """Whether the DeltaNet kernels see one sequence here (one row of one sample, its padding joined to it)."""
        return len(self.cu_seqlens(joined=True)) == 2

    def longest(self, piece: int = 0) -> int:
        """The longest segment of ``cu_seqlens(piece)``."""
        bounds = self.cu_seqlens(piece)
        return max(end - start for start, end in zip(bounds[:-1], bounds[1:], strict=True))

    def real_tokens(self, device) -> Any:
        """``[B * T]`` booleans: the tokens of samples (not padding), rows laid end to end."""
        key = ("real", str(device))
        if key not in self._on_device:
            import torch

            real = torch.zeros(self.rows * self.length, dtype=torch.bool)
            for row, start, end, is_real in self.spans:
                real[row * self.length + start : row * self.length + end] = is_real
            self._on_device[key] = real.to(device)
        return self._on_device[key]

    def samples_per_row(self) -> list[int]:
        return [sum(1 for r, _, _, real in self.spans if r == row and real) for row in range(self.rows)]

    def cu_seqlens(self, piece: int = 0, joined: bool = False) -> list[int]:
        """The segment boundaries of the rows laid end to end (FLA's varlen layout, batch 1); with ``piece``, every
        run of padding cut into segments of at most that many tokens (``PADDING_PIECE``, the attention kernels'
        bounds), the samples' boundaries unchanged; ``joined``, every run of padding that follows a sample in its
        row made part of that sample (the DeltaNet kernels' bounds, ``state_bounds``: no sample token reads a later
        token, so this changes only the padding's outputs, which no sample token and no loss term depends on; a loss
        over every position, such as an MoE router's auxiliary loss, would: LLaMA-Factory 0.9.5 turns that one on for
        ``qwen3_moe``, not for ``qwen3_5_moe``, ``model_utils/moe.py``). A row that opens with padding keeps it as a
        segment of its own, and every row starts a segment."""
        if piece < 0:
            raise ValueError(f"a padding piece of {piece} tokens; give 0 (uncut) or more")
        if piece and joined:
            raise ValueError("padding is either cut into pieces or joined to the sample before it, not both")
        bounds, after_sample = [], False
        for row, start, end, real in self.spans:
            if not (joined and not real and start and after_sample):
                bounds += [
                    row * self.length + at for at in range(start, end, piece if piece and not real else end - start)
                ]
            after_sample = real
        return bounds + [self.rows * self.length]


def numbered_segments(numbered) -> Segments:
    """Samples of packed rows from LLaMA-Factory's sample numbers ``[B, T]`` (1, 1, 2, 2, 2, 0 for padding: what
    its collator turns into the 4D mask): the same segments ``segments`` reads off that mask."""
    import torch

    numbered = numbered.cpu()
    start = torch.ones_like(numbered, dtype=torch.bool)
    start[:, 1:] = numbered[:, 1:] != numbered[:, :-1]
    return _segments_from(start, numbered != 0)


def _segments_from(start, real) -> Segments:
    """Segments from ``[B, T]`` booleans: where a segment starts, and whether each token belongs to a sample."""
    import torch

    rows, length = start.shape
    index = torch.arange(length, device=start.device).expand(rows, length)
    first = torch.where(start, index, torch.zeros_like(index)).cummax(-1).values
    spans = []
    start_cpu, real_cpu = start.cpu(), real.cpu()
    for row in range(rows):
        at = torch.nonzero(start_cpu[row]).flatten().tolist()
        for begin, end in zip(at, [*at[1:], length], strict=True):
            spans.append((row, begin, end, bool(real_cpu[row, begin])))
    return Segments(rows=rows, length=length, spans=tuple(spans), position=index - first)


def block_causal_mask(numbered, dtype) -> Any:
    """The 4D additive block-diagonal causal mask ``[B, 1, T, T]`` of sample numbers ``[B, T]``, built where
    ``numbered`` lives: LLaMA-Factory's own ``prepare_4d_attention_mask``, run under ``numbered``'s device as the
    default device (it makes its causal triangle and its zero with factory calls, which then land there too)."""
    import torch
    from llamafactory.data.collator import prepare_4d_attention_mask

    with torch.device(numbered.device):
        return prepare_4d_attention_mask(numbered, dtype)


def allowed_of(mask) -> Any:
    """Booleans (True = attend) of a 4D mask or of a view into one: additive (0 = attend) or boolean."""
    import torch

    return mask == 0 if torch.is_floating_point(mask) else mask.bool()


def diagonal_of(mask, offset: int = 0) -> Any:
    """``[B, T - |offset|]``: whether each token attends to itself (0) or to the one before it (-1); reads
    only that diagonal of the ``[B, 1, T, T]`` mask."""
    return allowed_of(mask[:, 0].diagonal(offset, -2, -1))


def segments(mask) -> Segments:
    """Samples of packed rows from their 4D block-diagonal causal mask ``[B, 1, T, T]`` (only two diagonals read).

    A token starts a sample when it attends to itself but not to the token before it; padding (a token that
    attends to nothing) makes one segment per run of padding.
    """
    import torch

    itself = diagonal_of(mask)  # [B, T]
    previous = torch.zeros_like(itself)
    previous[:, 1:] = diagonal_of(mask, -1)
    was_real = torch.zeros_like(itself)
    was_real[:, 1:] = itself[:, :-1]
    start = (itself & ~previous) | (~itself & was_real)
    start[:, 0] = True
    return _segments_from(start, itself)


def block_causal_mismatch(mask, found: Segments, block: int = 1024) -> int:
    """How many entries of the mask differ from the block-diagonal causal mask of ``found`` (0 when exact);
    compared ``block`` query rows at a time, so the check holds at most ``B x block x T`` booleans."""
    import torch

    length = found.length
    index = torch.arange(length, device=mask.device)
    first = index[None, :] - found.position.to(mask.device)  # [B, T]: the start of each token's segment
    real = diagonal_of(mask)
    wrong = 0
    for top in range(0, length, block):
        rows = index[top : top + block]
        starts = first[:, top : top + block, None]
        expected = (index[None, None, :] <= rows[None, :, None]) & (index[None, None, :] >= starts)
        expected &= real[:, top : top + block, None] & real[:, None, :]
        wrong += int((expected != allowed_of(mask[:, 0, top : top + block])).sum())
    return wrong


def segment_causal_conv(x, weight, bias, found: Segments):
    """Depthwise causal convolution ``[B, C, T]`` that never reads across a sample start, then SiLU.

    The whole row goes through the convolution transformers' torch path runs (``weight`` is ``nn.Conv1d``'s
    ``[C, 1, K]``, zero padding of ``K - 1`` in front); then the first ``K - 1`` tokens of every segment, the only
    ones whose window reaches back into the segment before, are computed again from their own segment's
    tokens alone and put in place. That is each sample's convolution as if it ran alone.
    """
    import torch.nn.functional as F

    taps, length = weight.shape[-1], x.shape[-1]
    out = F.conv1d(x, weight, bias, padding=taps - 1, groups=x.shape[1])[..., :length]
    rows, cols, offsets = found.heads(taps, x.device)
    if not rows.numel():
        return F.silu(out)
    tokens = x.transpose(1, 2)  # [B, T, C]
    own = 0
    for back in range(taps - 1):  # tap `back` tokens back counts where the token is at least that far in
        reach = (offsets >= back).to(x.dtype)[:, None]
        own = own + tokens[rows, (cols - back).clamp(min=0)] * weight[:, 0, taps - 1 - back] * reach
    if bias is not None:
        own = own + bias
    out = out.transpose(1, 2).index_put((rows, cols), own.to(out.dtype)).transpose(1, 2)  # autocast: conv in bf16
    return F.silu(out)


def chunk_per_segment(kernel, query, key, value, g, beta, found: Segments | None):
    """The layer's routed chunk kernel over every segment, none seeing another's state (``found`` None: every row
    one sequence, FLA's kernel only)."""
    import torch

    if not isinstance(kernel, KernelRecorder):
        raise PatchError(
            NAME,
            (
                f"a DeltaNet layer is bound to {type(kernel).__name__}, not to the routed kernel, so its packed rows "
                "cannot be split by sample"
            ),
            "keep launcher.patches.deltanet_routing enabled when packing",
        )
    options = {"initial_state": None, "output_final_state": False, "use_qk_l2norm_in_kernel": True}
    if found is None:
        return kernel(query, key, value, g=g, beta=beta, **options)[0]
    if kernel.label == "fla":
        rows, length = query.shape[:2]
        flat = [t.reshape(1, rows * length, *t.shape[2:]) for t in (query, key, value, g, beta)]
        cu, cu_cpu = found.state_bounds(query.device)
        bounds = {} if cu is None else {"cu_seqlens": cu, "cu_seqlens_cpu": cu_cpu}
        out, _ = kernel(*flat[:3], g=flat[3], beta=flat[4], **bounds, **options)
        return out.reshape(rows, length, *out.shape[2:])
    rows = [
        torch.cat(
            [
                kernel(
                    query[r : r + 1, s:e],
                    key[r : r + 1, s:e],
                    value[r : r + 1, s:e],
                    g=g[r : r + 1, s:e],
                    beta=beta[r : r + 1, s:e],
                    **options,
                )[0]
                for r, s, e, _ in found.spans
                if r == row
            ],
            dim=1,
        )
        for row in range(found.rows)
    ]
    return torch.cat(rows, dim=0)


def value_heads(kernel, query, key, groups: int):
    """``query`` and ``key`` as the layer's chunk kernel takes them when each key head serves ``groups`` value heads.

    transformers repeats every key head ``groups`` times (``repeat_interleave``: value head ``j`` reads key head
    ``j // groups``), a copy of both tensors in every forward and recompute and a sum in the backward (19.8 ms of a
    4,096-token step of the 27B shape on an H200, ``launcher profile``). FLA's chunk kernel takes the key heads as
    they are (fla-core 0.6: grouped value attention, value head ``j`` on key head ``j // (HV // H)``, the same
    pairing), so on the FLA route they are passed unrepeated; the torch reference needs them repeated."""
    if groups > 1 and not (isinstance(kernel, KernelRecorder) and kernel.label == "fla"):
        return query.repeat_interleave(groups, dim=2), key.repeat_interleave(groups, dim=2)
    return query, key


def packed_forward(layer, hidden_states, found: Segments | None):
    """One Gated DeltaNet layer without a cache: projections, convolution, chunk kernel, gated norm, output
    projection (transformers' layer arithmetic). ``found``: packed rows, each segment convolved and run alone;
    None: an unpacked batch (its padding already zeroed) on the FLA route, each row one sequence, the convolution
    the layer's own as transformers calls it."""
    import torch
    import torch.nn.functional as F

    batch, length, _ = hidden_states.shape
    # the projections in transformers' order (LoRA's dropout, where it wraps them, draws its masks in that order)
    projected = layer.in_proj_qkv(hidden_states)
    gate = layer.in_proj_z(hidden_states).reshape(-1, layer.head_v_dim)
    beta = layer.in_proj_b(hidden_states).sigmoid()
    a = layer.in_proj_a(hidden_states)
    if found is None:
        x = projected.transpose(1, 2)
        mixed = (
            F.silu(layer.conv1d(x)[:, :, :length])
            if layer.causal_conv1d_fn is None
            else layer.causal_conv1d_fn(
                x=x,
                weight=layer.conv1d.weight.squeeze(1),
                bias=layer.conv1d.bias,
                activation=layer.activation,
                seq_idx=None,
            )
        ).transpose(1, 2)
    elif (conv := fused_ops.conv_of(layer)) is not None:  # FLA's convolution takes the samples' boundaries itself
        cu, cu_cpu = found.state_bounds(hidden_states.device)
        mixed = conv.varlen(
            projected.reshape(1, batch * length, -1),
            layer.conv1d.weight.squeeze(1),
            layer.conv1d.bias,
            layer.activation,
            cu,
            cu_cpu,
        ).reshape(batch, length, -1)
    else:
        mixed = segment_causal_conv(projected.transpose(1, 2), layer.conv1d.weight, layer.conv1d.bias, found).transpose(
            1, 2
        )
    query, key, value = torch.split(mixed, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    query = query.reshape(batch, length, -1, layer.head_k_dim)
    key = key.reshape(batch, length, -1, layer.head_k_dim)
    value = value.reshape(batch, length, -1, layer.head_v_dim)
    g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias)
    query, key = value_heads(layer.chunk_gated_delta_rule, query, key, layer.num_v_heads // layer.num_k_heads)
    core = chunk_per_segment(layer.chunk_gated_delta_rule, query, key, value, g, beta, found)
    core = layer.norm(core.reshape(-1, layer.head_v_dim), gate).reshape(batch, length, -1)
    return layer.out_proj(core)


@functools.cache
def torch_varlen_options() -> dict[str, Any] | None:
    """How this torch's ``varlen_attn`` is told to be causal and to share key heads (its arguments changed
    between releases: ``is_causal`` in 2.10, ``window_size`` and ``enable_gqa`` later); None where it is absent
    or cannot be made causal."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal: dict[str, Any] = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None
    return {"causal": causal, "scale": "scale" in params, "gqa": "enable_gqa" in params}


@functools.cache
def aten_flash_op() -> Any:
    """torch's FlashAttention 2 operator with cumulative sequence lengths (``ATEN_FLASH``), or None where this torch
    lacks it, was built without FlashAttention, or names its leading arguments otherwise than ``FLASH_ARGUMENTS``
    with a ``scale`` keyword (its autograd formula gives the backward)."""
    import torch

    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if op is None or not getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)():
        return None
    names = [argument.name for argument in op.default._schema.arguments]
    if tuple(names[: len(FLASH_ARGUMENTS)]) != FLASH_ARGUMENTS or "scale" not in names:
        return None
    return op


def varlen_kernel(query, scaling: float | None, dropout: float) -> str | None:
    """The attention kernel of packed rows for ``query``'s device and dtype, or None where the block mask is used."""
    import torch

    if dropout or query.dtype not in (torch.bfloat16, torch.float16):
        return None
    if query.device.type == "npu":
        return NPU_VARLEN
    if query.device.type != "cuda" or torch.cuda.get_device_capability(query.device)[0] < 8:
        return None
    # the operator shares key heads, which varlen_attn before enable_gqa repeats (torch 2.11: 3.07 against 2.22 ms a
    # checkpointed 27B attention layer on an H100, docs/lab/2026-12-06-packed-padding-key-heads.md); later varlen_attn
    # wraps the same call
    if aten_flash_op() is not None:
        return ATEN_FLASH
    options = torch_varlen_options()
    if options is not None and (options["scale"] or scaling in (None, query.shape[-1] ** -0.5)):
        return TORCH_VARLEN
    return None


@functools.cache
def npu_causal_tile(device: str):
    """The compressed causal tile ``npu_fusion_attention`` takes with ``sparse_mode`` 3: 2048 x 2048, True above
    the diagonal (masked)."""
    import torch

    return torch.ones(2048, 2048, dtype=torch.bool, device=device).triu(1)


def varlen_attention(
    kernel: str, query, key, value, found: Segments, scaling: float | None, padding_piece: int | None = None
):
    """Causal attention inside every segment of packed rows: ``query`` ``[B, H, T, D]``, ``key``/``value``
    ``[B, Hkv, T, D]`` (the layout transformers' attention functions take) to ``[B, T, H, D]`` (the one they
    return), the rows laid end to end as the varlen kernels take them, the padding in pieces of ``padding_piece``
    (``PADDING_PIECE`` unless given; 0: whole)."""
    import torch

    padding_piece = PADDING_PIECE if padding_piece is None else padding_piece
    rows, heads, length, _ = query.shape
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    q, k, v = (t.transpose(1, 2).reshape(rows * length, t.shape[1], t.shape[-1]) for t in (query, key, value))
    if kernel == NPU_VARLEN:
        import torch_npu

        ends = found.cu_seqlens(padding_piece)[1:]  # cumulative lengths without the leading 0
        out = torch_npu.npu_fusion_attention(
            q,
            k,
            v,
            heads,
            "TND",
            atten_mask=npu_causal_tile(str(q.device)),
            scale=scaling,
            sparse_mode=3,
            actual_seq_qlen=ends,
            actual_seq_kvlen=ends,
        )[0]
    else:  # FlashAttention 2 on CUDA: the operator itself, or varlen_attn, which wraps it
        cu, _ = found.cu_seqlens_tensors(q.device, torch.int32, padding_piece)
        longest = found.longest(padding_piece)
        out = (
            aten_flash_op()(q, k, v, cu, cu, longest, longest, 0.0, True, False, scale=scaling)[0]
            if kernel == ATEN_FLASH
            else torch_varlen(q, k, v, cu, longest, scaling)
        )
    return out.reshape(rows, length, heads, out.shape[-1])


def torch_varlen(q, k, v, cu, longest: int, scaling: float):
    """``varlen_attn`` of this torch, causal, with ``scaling`` where it takes one; key heads repeated for the query
    heads where it cannot share them (``torch_varlen_options``). ATEN_FLASH shares them: FlashAttention does."""
    from torch.nn.attention.varlen import varlen_attn

    options = torch_varlen_options()
    extra = dict(options["causal"])
    if options["scale"]:
        extra["scale"] = scaling
    if k.shape[1] != q.shape[1]:
        if options["gqa"]:
            extra["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return varlen_attn(q, k, v, cu, cu, longest, longest, **extra)


def agreement(out, reference, found: Segments) -> float:
    """Relative L2 difference of two ``[B, T, H, D]`` attention outputs on the real tokens (padding rows
    attend to nothing under the mask, so their outputs are arbitrary)."""
    real = found.real_tokens(out.device)
    a, b = (t.reshape(found.rows * found.length, -1)[real].float() for t in (out, reference))
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


_state: dict[str, Any] = {}
_cache: dict[str, Any] = {}  # "held": (weakref to the last packed mask, its segments); one mask per forward


def _packed_segments(mask) -> Segments | None:
    """The segments of ``mask`` when it is the mask the DeltaNet layers read as packed rows, else None."""
    held = _cache.get("held")
    return held[1] if mask is not None and held is not None and held[0]() is mask else None


def _segments_of(mask) -> Segments:
    """Segments of ``mask``, read once per mask object (recompute in the backward passes the same object)."""
    found = _packed_segments(mask)
    if found is None:
        found = segments(mask)
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


def _check_attention(kernel, out, reference, found: Segments, record: dict[str, Any], key: str) -> None:
    """Compare the kernel's output with SDPA under the mask on the real tokens, recorded as ``key``; stop the run
    when they disagree."""
    difference = agreement(out.detach(), reference, found)
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
        kernel = varlen_kernel(query, scaling, dropout) if _state["varlen_attention"] else None
        if (
            kernel in (ATEN_FLASH, TORCH_VARLEN)
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
                out = (varlen_attention(kernel, query, key, value, found, scaling), None)
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
            if cache_params is None and _state.get("unpacked_forward") and unrepeated(self):
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
            wrong = block_causal_mismatch(attention_mask, found)
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
                        if fused_ops.conv_of(self) is not None
                        else "at every sample start"
                    ),
                    "mask": "block-diagonal causal (checked)",
                    "device": str(hidden_states.device),
                    "recorded_at": utc_now(),
                }
            )
        return packed_forward(self, hidden_states, found)

    return forward


def unrepeated(layer) -> bool:
    """Whether the layer's key heads serve several value heads and its chunk kernel (FLA's) takes them unrepeated."""
    kernel = layer.chunk_gated_delta_rule
    return layer.num_v_heads // layer.num_k_heads > 1 and isinstance(kernel, KernelRecorder) and kernel.label == "fla"


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
    return packed_forward(layer, hidden_states, None)


def restarts(positions) -> bool:
    """A sample's text position ids start at 0 and never go back (image tokens may repeat a position)."""
    return int(positions[0]) == 0 and bool((positions[1:] >= positions[:-1]).all())


def builds_4d_mask(collator) -> bool:
    """Whether LLaMA-Factory's collator turns this batch's sample numbers into the 4D mask (its own condition)."""
    return bool(collator.block_diag_attn) and collator.attn_implementation != "flash_attention_2"


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

        numbers = bool(_state) and _state["device_mask"] and builds_4d_mask(self)
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
        found = numbered_segments(mask) if numbers else segments(mask)
        position = batch.get("position_ids")
        text = position[0] if position is not None and position.dim() == 3 else position
        if text is None:
            raise PatchError(
                NAME,
                "a packed batch has no position_ids, so every sample would continue the positions of the one before it",
                FIX,
            )
        bad = [(row, start) for row, start, end, real in found.spans if real and not restarts(text[row, start:end])]
        if bad:
            raise PatchError(
                NAME,
                (
                    f"the position ids of {len(bad)} packed sample(s) do not restart at 0 at the sample start (row, "
                    f"position: {bad[:3]}), so rotary positions would run on across samples"
                ),
                FIX,
            )
        return cut_padding(batch, found, _state["cut_padding"])  # counted where the model meets it: maybe a worker

    return __call__


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


def _make_text_forward(original):
    def forward(self, *args, **kwargs):
        if not _state:
            return original(self, *args, **kwargs)
        mask, found, numbers = kwargs.get("attention_mask"), None, False
        if _state["device_mask"] and mask is not None and mask.dim() == 2 and mask.dtype == _numbers():
            found, numbers = numbered_segments(mask), True
            kwargs["attention_mask"] = block_causal_mask(mask, _state.get("mask_dtype") or _embedding_dtype(self))
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


def _record_batch(found: Segments, numbers: bool) -> None:
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
                "left_whole": cut_length(found, _state["cut_padding"]) < found.length,
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
    varlen = bool(options.get("varlen_attention", True))
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
        varlen_attention=varlen,
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
        "varlen_attention": varlen,
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
