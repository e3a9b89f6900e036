"""The AscendC gated-delta-rule kernels of flash-linear-attention-npu (``fla_npu``) behind FLA's call contract.

On an Ascend NPU, ``launcher preflight`` tries these after FLA's triton-ascend kernel and before transformers' torch
loop (``launcher.checks.kernels.choice``); training binds them only when they passed the validation cases at the
run's shapes there. Written from upstream's documentation and never run here (no NPU): the validation cases, not
this module, are what let it serve a run.

Read upstream (flashserve/flash-linear-attention-npu, the ``ChunkGatedDeltaRuleFwd`` operator's README and its
Python entry points in ``fla_npu/ops/ascendc``):

- ``fla_npu.ops.ascendc.npu_chunk_gated_delta_rule_fwd(q, k, v, g, beta, layout=, scale=, chunk_size=, use_exp2=,
  use_qk_l2norm_in_kernel=, disable_recompute=, output_final_state=)`` returns ten values ``(o, final_state,
  g_cumsum, A, beta_eff, h, q_hat, k_hat, q_rstd, k_rstd)``; ``o`` is ``[B, T, Hv, V]`` whatever the layout;
  ``g_cumsum`` and ``A`` only with ``disable_recompute=True``. K must be 128, V 128 or 256, chunk 64 or 128,
  ``Hv`` a multiple of ``Hk`` (grouped heads are paired inside, as FLA pairs them).
- ``npu_chunk_gated_delta_rule_bwd(q_hat, k_hat, v, g_cumsum, beta, A, d_o, scale, layout=, chunk_size=, use_exp2=,
  use_qk_l2norm_in_kernel=, q_rstd=, k_rstd=)`` returns ``(dq, dk, dv, d_beta, d_g, dh0, d_a_log, d_dt_bias)``;
  upstream ships no autograd wrapper, so ``_Function`` below is one.
- On the 910B (A2) the forward takes its "Phase6" path only with ``layout="BNSD"``, ``use_exp2=False`` and the
  q/k L2 norm off: so the norm runs here in torch (autograd takes its backward), and q, k, v go in as
  ``[B, H, T, D]`` views.
- ``import fla_npu`` needs CANN's ``set_env.sh`` sourced and the package's operator folder (OPP) installed; it
  raises otherwise, which ``available`` reports as the reason.

Not wired: ``cu_seqlens`` (packed rows). The entry takes no ``cu_seqlens`` argument, so the ``varlen`` cases skip it
and a packed run never binds it (``patches.packed_rows`` calls FLA's varlen kernels). Initial and final states are
not passed (training calls the chunk kernel without them); a call asking for them is refused.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

FWD, BWD = "npu_chunk_gated_delta_rule_fwd", "npu_chunk_gated_delta_rule_bwd"
MODULE = "fla_npu.ops.ascendc"
CHUNK = 64
LABEL = f"{MODULE}.{FWD}/{BWD} (AscendC)"


def available() -> str | None:
    """None when fla_npu imports and has the fused forward and backward; else why not (not installed, no CANN...)."""
    if importlib.util.find_spec("fla_npu") is None:
        return "fla_npu (flash-linear-attention-npu) is not installed"
    try:
        module = importlib.import_module(MODULE)
    except Exception as err:  # noqa: BLE001 - its import loads CANN libraries; any error means unusable
        return f"fla_npu does not import: {type(err).__name__}: {err}"
    missing = [name for name in (FWD, BWD) if not hasattr(module, name)]
    return f"fla_npu has no {', '.join(missing)} (an older release)" if missing else None


def _l2norm(x):
    return x * (x.float().pow(2).sum(-1, keepdim=True) + 1e-6).rsqrt().to(x.dtype)


class _Function:
    """Built on first use so that importing this module needs no torch."""

    cls: Any = None

    @classmethod
    def get(cls):
        if cls.cls is None:
            import torch

            ops = importlib.import_module(MODULE)

            class Function(torch.autograd.Function):
                @staticmethod
                def forward(ctx, q, k, v, g, beta, scale):
                    q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # [B, H, T, D]
                    out = getattr(ops, FWD)(
                        q,
                        k,
                        v,
                        g,
                        beta,
                        layout="BNSD",
                        scale=scale,
                        chunk_size=CHUNK,
                        use_exp2=False,
                        use_qk_l2norm_in_kernel=False,
                        disable_recompute=True,
                        output_final_state=False,
                    )
                    o, g_cumsum, a = out[0], out[2], out[3]
                    ctx.save_for_backward(q, k, v, g_cumsum, beta, a)
                    ctx.scale = scale
                    return o

                @staticmethod
                def backward(ctx, d_o):
                    q, k, v, g_cumsum, beta, a = ctx.saved_tensors
                    dq, dk, dv, d_beta, d_g = getattr(ops, BWD)(
                        q,
                        k,
                        v,
                        g_cumsum,
                        beta,
                        a,
                        d_o.contiguous(),
                        ctx.scale,
                        layout="BNSD",
                        chunk_size=CHUNK,
                        use_exp2=False,
                        use_qk_l2norm_in_kernel=False,
                        q_rstd=None,
                        k_rstd=None,
                    )[:5]
                    dq, dk, dv = (x.transpose(1, 2) for x in (dq, dk, dv))
                    return dq, dk, dv, d_g, d_beta, None

            cls.cls = Function
        return cls.cls


def chunk_gated_delta_rule(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs
):
    """FLA's ``chunk_gated_delta_rule`` contract: q, k ``[B, T, Hk, K]``, v ``[B, T, Hv, V]``, g and beta
    ``[B, T, Hv]``; returns ``(o [B, T, Hv, V], None)``."""
    if initial_state is not None or output_final_state or kwargs.get("cu_seqlens") is not None:
        raise ValueError("the AscendC adapter takes no initial_state, final state or cu_seqlens (training needs none)")
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _Function.get().apply(q, k, v, g, beta, float(scale)), None
