"""A Gated DeltaNet layer over packed rows, each sample alone: the convolution reset at every sample start
(``segment_causal_conv``, or FLA's convolution with the samples' boundaries), the routed chunk kernel per sample
(``chunk_per_segment``), the key heads unrepeated where FLA's kernel takes them so (``value_heads``), and the whole
layer in transformers' arithmetic (``packed_forward``).
"""

from __future__ import annotations

from ..core.errors import PatchError
from ..kernels.fused_kernels import conv_of
from ..kernels.recorder import KernelRecorder
from .masks import Segments

NAME = "packed_rows"  # the patch this arithmetic serves: its errors name it


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
    elif (conv := conv_of(layer)) is not None:  # FLA's convolution takes the samples' boundaries itself
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


def unrepeated(layer) -> bool:
    """Whether the layer's key heads serve several value heads and its chunk kernel (FLA's) takes them unrepeated."""
    kernel = layer.chunk_gated_delta_rule
    return layer.num_v_heads // layer.num_k_heads > 1 and isinstance(kernel, KernelRecorder) and kernel.label == "fla"
