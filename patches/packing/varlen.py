"""The varlen attention kernels of packed rows: which one serves a call on this device (``varlen_kernel``), the
call itself with the rows' boundaries (``varlen_attention``: FlashAttention 2 through torch's operator or
``varlen_attn`` on CUDA, ``npu_fusion_attention`` on NPU) and the agreement of two outputs on the real tokens.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from .masks import Segments

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
# The varlen attention kernels take a row's padding as segments of at most this many tokens (``Segments.cu_seqlens``):
# padding attends only to padding and no sample token or loss term depends on its outputs, so any cut is exact for
# the samples, and a run of
# P padding tokens as one causal segment costs about (P / 4096)^2 of a full row's attention (LLaMA-Factory pads each
# packed row to cutoff_len: 1,614 of 4,096 tokens in a row holding one sample of 2,482), cut into pieces of 128
# (two of FlashAttention 2's 64-token tiles at head dim 256) about 128 / P of that
PADDING_PIECE = 128


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
