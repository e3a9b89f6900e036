"""What a kernel case is and the pieces every case shares: shapes, model-like inputs, errors, the device.

``launcher.checks.kernels.validate`` (the chunk kernel, forward and backward), ``launcher.checks.kernels.decode``
(the recurrent kernel, step by step) and ``launcher.checks.kernels.glue`` (the fused glue ops) build their checks from
these; ``validate`` re-exports them. Every kind of case runs through the one runner, ``run_case``: the check fills the
case's result in, the runner times it and turns an exception into a failed case.


Import torch lazily: callers pass the ``torch`` module in.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Case:
    """One kernel call shape. ``heads`` are value heads; ``key_heads`` the q/k heads before interleaving."""

    name: str
    batch: int
    seq_len: int
    heads: int
    dim: int
    key_heads: int | None = None
    seq_lens: tuple[int, ...] | None = None  # varlen: the packed sequences (batch must be 1)
    timing: bool = False
    memory: bool = False
    about: str = ""
    prefill: int | None = None  # decode: prompt tokens before the seq_len one-token steps (decode.py)
    op: str | None = None  # a glue op (glue.py): conv, rms_norm, gated_norm or swiglu
    # the routed kernel takes the key heads as they are (packed rows on FLA: patches.packing.deltanet.value_heads), the
    # reference takes them repeated as Qwen3_5GatedDeltaNet.forward repeats them
    unrepeated: bool = False

    @property
    def shape(self) -> list[int]:
        return [self.batch, self.seq_len, self.heads, self.dim]

    @property
    def cu_seqlens(self) -> list[int] | None:
        if self.seq_lens is None:
            return None
        return [0, *(sum(self.seq_lens[: i + 1]) for i in range(len(self.seq_lens)))]


@dataclass
class CaseResult:
    name: str
    shape: list[int]
    key_heads: int | None
    status: str  # pass | fail | skip
    errors: dict[str, float] = field(default_factory=dict)
    finite: bool | None = None
    cu_seqlens: list[int] | None = None
    errors_vs_alone: dict[str, float] | None = None
    peak_memory_gib: float | None = None
    timing_ms: dict[str, float] | None = None
    seconds: float = 0.0
    note: str = ""

    @property
    def max_error(self) -> float | None:
        values = list(self.errors.values()) + list((self.errors_vs_alone or {}).values())
        return max(values) if values else None

    def judge(self, threshold: float, passed: str, non_finite: str = "non-finite output or gradient") -> None:
        """PASS when every value is finite and every error is within ``threshold``; the note says which error
        failed (the largest), or ``passed``. The one verdict of every kind of case."""
        worst = self.max_error
        self.status = "pass" if self.finite and worst is not None and worst <= threshold else "fail"
        if not self.finite:
            self.note = non_finite
        elif self.status == "fail":
            alone = {f"{k} vs alone": v for k, v in (self.errors_vs_alone or {}).items()}
            name, value = max({**self.errors, **alone}.items(), key=lambda kv: kv[1])
            self.note = f"{name} differs by {value:.2%} (threshold {threshold * 100:g}%)"
        else:
            self.note = passed


def run_case(result: CaseResult, check: Callable[[CaseResult], None]) -> CaseResult:
    """Run one case's ``check``, which fills ``result`` in (its errors, its verdict, or a skip with the reason); never
    raises: an exception is a failed case with the error as its note. ``result.seconds`` is the check's wall time."""
    started = time.monotonic()
    try:
        check(result)
    except Exception as err:  # a crashing kernel is a failed case, reported with the others
        result.note = f"{type(err).__name__}: {err}"
    finally:
        result.seconds = round(time.monotonic() - started, 2)
    return result


def make_inputs(torch, case: Case, seed: int = 0) -> dict[str, Any]:
    """Model-like inputs on the CPU: bfloat16-rounded q, k, v, beta and output gradient; float32 g."""
    gen = torch.Generator().manual_seed(seed)
    b, t, h, d = case.shape
    hk = case.key_heads or h
    bf16 = torch.bfloat16
    q = torch.randn(b, t, hk, d, generator=gen).to(bf16)
    k = torch.randn(b, t, hk, d, generator=gen).to(bf16)
    v = torch.randn(b, t, h, d, generator=gen).to(bf16)
    a = torch.randn(b, t, h, generator=gen)
    a_log = torch.linspace(math.log(1e-3), math.log(16.0), h)  # A per head, from long memory to fast decay
    g = -a_log.exp() * torch.nn.functional.softplus(a + 1.0)  # dt_bias initialised to ones
    beta = torch.randn(b, t, h, generator=gen).sigmoid().to(bf16)
    grad_out = torch.randn(b, t, h, d, generator=gen).to(bf16)
    return {"q": q, "k": k, "v": v, "g": g.float(), "beta": beta, "grad_out": grad_out}


def rel_error(torch, got, ref) -> float:
    """``|got - ref| / |ref|`` (L2, float64); infinite when ``got`` is missing or not finite."""
    if got is None or not bool(torch.isfinite(got).all()):
        return math.inf
    got, ref = got.detach().double(), ref.detach().double().to(got.device)
    return float(torch.linalg.vector_norm(got - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30))


class Device:
    """Synchronisation and memory counters of one device type (cuda, npu) or the CPU (no counters)."""

    def __init__(self, torch, device: str):
        self.torch, self.name, self.type = torch, device, device.split(":")[0]
        self.module = getattr(torch, self.type, None) if self.type != "cpu" else None

    def sync(self) -> None:
        if self.module is not None:
            self.module.synchronize()

    def reset_peak(self) -> None:
        if self.module is not None:
            self.sync()
            self.module.empty_cache()
            self.module.reset_peak_memory_stats()

    def peak_gib(self) -> float | None:
        if self.module is None:
            return None
        self.sync()
        return round(self.module.max_memory_allocated() / 2**30, 3)

    def alloc_retries(self) -> int | None:
        """The allocator's retries so far (``num_alloc_retries``: an allocation that failed, emptied the cache and
        synchronised the device before it tried again); None on the CPU. Near the memory's limit they make a step
        slower without showing in its peak."""
        if self.module is None:
            return None
        return int(self.module.memory_stats().get("num_alloc_retries", 0))


class _FullPrecision:
    """float32 matmuls and convolutions at full precision (no TF32) while the reference runs: the matmul precision
    does not reach cuDNN, whose convolutions take TF32 unless ``cudnn.allow_tf32`` is off."""

    def __init__(self, torch):
        self.torch = torch

    def __enter__(self):
        self.saved = self.torch.get_float32_matmul_precision(), self.torch.backends.cudnn.allow_tf32
        self.torch.set_float32_matmul_precision("highest")
        self.torch.backends.cudnn.allow_tf32 = False

    def __exit__(self, *exc):
        self.torch.set_float32_matmul_precision(self.saved[0])
        self.torch.backends.cudnn.allow_tf32 = self.saved[1]
