"""`launcher profile`, in each rank: the torch profiler over N steps after W warm-up steps, and where time went.

``ProfileCallback`` (installed by ``entry.py`` when ``launch.json`` has ``profile``) runs
``torch.profiler.profile`` on CPU and CUDA, ``torch_npu.profiler.profile`` on NPU, with the same schedule:
``skip_first=W``, then ``N`` active steps; the profiler's step boundary is the end of each optimizer step
(``on_step_end``), so a profiled step spans from the end of the previous step to the end of this one: the
next batch's loading, forward, backward, optimizer and logging. The same callback measures each such period
on its own clock (device synchronised), which is what the profile's parts are held against.

What each part is (``split_step``), per profiled step:

- device work: on CUDA and NPU the device's kernels, by name: DeltaNet (FLA's gated-delta-rule kernels), glue
  (the short convolution, the norms and SwiGLU where a named kernel runs them: FLA's, ``conv_depthwise2d``,
  ``npu_rms_norm``; unfused elementwise ops stay other compute), attention, matmul, communication (NCCL/HCCL
  all-gather, reduce-scatter, all-reduce, ...), optimizer (the fused/foreach optimizer kernels), other compute;
  on CPU the operators' own time inside our ``deltanet::`` ranges (``patches/kernels/recorder.py``), attention,
  matmul and communication operators, the optimizer's ``Optimizer.step`` range, and the rest;
- time the device idles (CPU: no operator runs), split by what the host was doing then: loading data (the
  DataLoader's ``__next__``), the optimizer step, compiling or autotuning Triton kernels (``launcher::compile``
  and ``launcher::autotune`` ranges this module puts around Triton's compile and autotuner benchmark), and
  other host-side gaps (Python, logging, callbacks).

The profiler records nothing in the warm-up steps, so the same wrappers also time Triton's compile and autotune
calls on the host's clock (``TRITON_CLOCK``) in every step: each period of ``rank<R>.json`` carries its
compile/autotune seconds, and the first step (where the cold compiles land) is read against the profiled ones.

The rank writes ``profile/rank<R>.trace.json`` (Chrome trace: chrome://tracing or Perfetto; on NPU the
Ascend profiler's folder ``profile/rank<R>.ascend/`` for MindStudio Insight) and ``profile/rank<R>.json``;
``results/profile_report.py`` merges the ranks into ``profile.json`` and ``profile.md``.

Layer 3, like ``stopsave.py``: torch, transformers and triton are imported in the rank only.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

from launcher.files import write_json_or_warn
from launcher.state.runs import PROFILE_ASCEND, PROFILE_DIR, PROFILE_RECORD, PROFILE_TRACE

DELTANET_KERNELS = (
    "chunk_gated_delta",
    "gated_delta",
    "chunk_fwd",
    "chunk_bwd",
    "chunk_scaled_dot_kkt",
    "recompute_w_u",
    "solve_tril",
    "chunk_local_cumsum",
    "fused_recurrent",
    "merge_16x16",
    "chunk_dplr",
    "l2norm",
)
# the layer glue that fused_ops serves: FLA's conv, norm and SwiGLU kernels, torch's depthwise conv, Ascend's norm
GLUE = ("causal_conv1d", "conv_depthwise", "layer_norm", "rms_norm", "rmsnorm", "swiglu")
ATTENTION = ("flash", "fmha", "attention", "sdpa", "softmax")
MATMUL = (
    "gemm",
    "matmul",
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::linear",
    "sm90_xmma",
    "cutlass",
    "cublas",
    "ampere_",
    "hopper_",
    "nvjet",
    "xmma",
    "gemv",
)  # (nvjet: cuBLASLt on Hopper)
RANGES = ("ProfilerStep", "enumerate(DataLoader)", "launcher::", "deltanet::", "Optimizer.", "## ")
COMMUNICATION = (
    "nccl",
    "hccl",
    "gloo",
    "allreduce",
    "all_reduce",
    "allgather",
    "all_gather",
    "reduce_scatter",
    "reducescatter",
    "broadcast",
    "c10d::",
)
OPTIMIZER_KERNELS = ("multi_tensor_apply", "foreach", "adam", "sgd")
DEVICE_PARTS = ("deltanet", "glue", "attention", "matmul", "communication", "optimizer", "other_compute")
# device runtime calls (cudaStreamIsCapturing, cudaLaunchKernel, ...): torch can attach an operator's kernels to
# them as well, so a chain starting there would count those kernels twice, under the wrong launcher
RUNTIME_CALLS = ("cu", "Command Buffer", "acl", "hip")  # cudaStreamIsCapturing, cuLaunchKernel, aclrt..., hip...
LAYER_INDEX = re.compile(r"\.\d+(?=[.)\s]|$)")  # "layers.27)" in a range name: one chain for every layer
IDLE_PARTS = ("data_loading", "optimizer_host", "compile_autotune", "host_gaps")


def kernel_part(name: str) -> str:
    """The part a device kernel (or, on CPU, an operator) belongs to, from its name."""
    low = name.lower()
    for part, needles in (
        ("communication", COMMUNICATION),
        ("deltanet", DELTANET_KERNELS),
        ("glue", GLUE),
        ("attention", ATTENTION),
        ("optimizer", OPTIMIZER_KERNELS),
        ("matmul", MATMUL),
    ):
        if any(n in low for n in needles):
            return part
    return "other_compute"


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _subtract(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out = []
    for start, end in a:
        cursor = start
        for bs, be in b:
            if be <= cursor or bs >= end:
                continue
            if bs > cursor:
                out.append((cursor, bs))
            cursor = max(cursor, be)
        if cursor < end:
            out.append((cursor, end))
    return out


def split_step(
    window: tuple[float, float], work: list[tuple[str, float, float]], host: dict[str, list[tuple[float, float]]]
) -> dict[str, float]:
    """Seconds of each part in one profiled step.

    Args:
        window: the step's start and end (seconds on the profiler's clock).
        work: ``(part, start, end)`` of each device kernel (CPU: each operator's own time, as intervals).
        host: host ranges by kind (``data_loading``, ``optimizer_host``, ``compile_autotune``).

    Returns:
        Each part of ``DEVICE_PARTS`` and ``IDLE_PARTS`` in seconds. Device parts are clipped to the window;
        where kernels of two parts overlap (communication beside compute on another stream) both count, so
        the device parts can add up to more than the busy time: the summary says how much overlapped.
    """
    clip = [window]
    parts = dict.fromkeys(DEVICE_PARTS + IDLE_PARTS, 0.0)
    busy: list[tuple[float, float]] = []
    for part, start, end in work:
        inside = _intersect([(start, end)], clip)
        parts[part] += _length(inside)
        busy.extend(inside)
    idle = _subtract(clip, _merge(busy))
    for kind in ("compile_autotune", "data_loading", "optimizer_host"):  # in this order where ranges nest
        spent = _intersect(idle, _merge(host.get(kind, [])))
        parts[kind] = _length(spent)
        idle = _subtract(idle, spent)
    parts["host_gaps"] = _length(idle)
    parts["overlap"] = sum(parts[p] for p in DEVICE_PARTS) - _length(_merge(busy))
    return parts


class ProfileCallback:
    """The Trainer callback of a profiled rank (built lazily so that this module imports without torch)."""

    def __new__(cls, run_dir: Path, backend: str, warmup: int, steps: int):
        from transformers import TrainerCallback

        class _Callback(TrainerCallback):
            def __init__(self) -> None:
                self.run_dir, self.backend, self.warmup, self.steps = run_dir, backend, warmup, steps
                self.rank = int(os.environ.get("RANK", "0"))
                self.folder = run_dir / PROFILE_DIR
                self.profiler = None
                self.periods: list[dict[str, Any]] = []
                self.lengths: list[int] = []
                self.last_end: float | None = None
                self.clock_at = TRITON_CLOCK.read()

            def _sync(self) -> None:
                import torch

                module = getattr(torch, self.backend, None) if self.backend != "cpu" else None
                if module is not None and hasattr(module, "synchronize"):
                    module.synchronize()

            def on_train_begin(self, args, state, control, model=None, **kwargs):
                self.folder.mkdir(exist_ok=True)
                self.summary: dict[str, Any] = {"profiled_steps": []}
                self.profiler = _start_profiler(
                    self.backend, self.warmup, self.steps, self.folder, self.rank, self._summarize
                )
                time_triton()
                if model is not None:
                    model.register_forward_pre_hook(self._length, with_kwargs=True)
                self._sync()
                self.last_end = time.perf_counter()
                self.clock_at = TRITON_CLOCK.read()

            def _summarize(self, profiler) -> None:  # when the active steps end: the events exist only now
                self.summary = summarize_profiler(profiler, self.backend, self.warmup, self.steps)

            def _length(self, module, args, kwargs):
                ids = kwargs.get("input_ids", args[0] if args else None)
                if getattr(ids, "shape", None) is not None and module.training:
                    self.lengths.append(int(ids.shape[-1]))

            def on_step_end(self, args, state, control, **kwargs):
                self._sync()
                now = time.perf_counter()
                profiled = self.warmup < state.global_step <= self.warmup + self.steps
                clock = TRITON_CLOCK.read()
                self.periods.append(
                    {
                        "step": state.global_step,
                        "seconds": now - self.last_end,
                        "profiled": profiled,
                        **{k: round(clock[k] - self.clock_at[k], 6) for k in clock},
                    }
                )
                self.last_end, self.clock_at = now, clock
                if self.profiler is not None:
                    self.profiler.step()
                return control

            def on_train_end(self, args, state, control, **kwargs):
                if self.profiler is None:
                    return control
                self.profiler.stop()
                record = dict(self.summary)
                record.update(
                    rank=self.rank,
                    backend=self.backend,
                    warmup=self.warmup,
                    steps=self.steps,
                    periods=self.periods,
                    seq_lens=sorted(set(self.lengths)),
                )
                write_json_or_warn(self.folder / PROFILE_RECORD.format(rank=self.rank), record, "the profile")
                self.profiler = None
                return control

        return _Callback()


def _start_profiler(backend: str, warmup: int, steps: int, folder: Path, rank: int, summarize):
    """The backend's profiler, started, with ``skip_first=warmup`` and ``steps`` active steps; ``summarize``
    gets it when the active steps end."""
    if backend == "npu":
        import torch_npu

        prof = torch_npu.profiler
        activities = [prof.ProfilerActivity.CPU, prof.ProfilerActivity.NPU]
        export = prof.tensorboard_trace_handler(str(folder / PROFILE_ASCEND.format(rank=rank)))

        def ready(p):
            export(p)
            summarize(p)

    else:
        import torch.profiler as prof

        activities = [prof.ProfilerActivity.CPU] + ([prof.ProfilerActivity.CUDA] if backend == "cuda" else [])

        def ready(p):
            p.export_chrome_trace(str(folder / PROFILE_TRACE.format(rank=rank)))
            summarize(p)

    schedule = prof.schedule(skip_first=warmup, wait=0, warmup=0, active=steps, repeat=1)
    # shapes name which tensor a copy or cast served (``other_compute_top``'s ``launched_by``)
    profiler = prof.profile(activities=activities, schedule=schedule, on_trace_ready=ready, record_shapes=True)
    profiler.start()
    return profiler


class TritonClock:
    """Host seconds inside Triton's compile and autotune calls, outermost calls only, in every step.

    ``compile_autotune_s`` counts a call nested in another (a compile inside an autotuner's benchmark, Triton's
    ``compile`` inside ``JITFunction._do_compile``) once; ``compiles`` and ``autotunes`` count the outermost calls
    of each kind. Calls from other threads (Triton's async compile mode) add up too.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()
        self._totals = {"compile_autotune_s": 0.0, "compiles": 0, "autotunes": 0}

    def read(self) -> dict[str, float]:
        with self._lock:
            return dict(self._totals)

    @contextlib.contextmanager
    def timing(self, kind: str):
        """Time one call of ``kind`` (``compiles`` or ``autotunes``)."""
        depth = self._local.__dict__.setdefault("depth", {})
        outermost, first_of_kind = not any(depth.values()), not depth.get(kind)
        depth[kind] = depth.get(kind, 0) + 1
        start = time.perf_counter()
        try:
            yield
        finally:
            depth[kind] -= 1
            elapsed = time.perf_counter() - start
            with self._lock:
                if outermost:
                    self._totals["compile_autotune_s"] += elapsed
                if first_of_kind:
                    self._totals[kind] += 1


TRITON_CLOCK = TritonClock()


def time_triton() -> None:
    """Name Triton's compile and autotune work as profiler ranges and time it on ``TRITON_CLOCK`` (nothing to do
    where Triton is absent)."""
    try:
        import triton.compiler as package
        import triton.compiler.compiler as compiler
        from triton.runtime import autotuner, jit
    except Exception:  # CPU images carry no Triton; triton-ascend has the same modules
        return
    from torch.profiler import record_function

    def ranged(func, name, kind):
        if getattr(func, "__launcher_ranged__", False):
            return func

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            with record_function(name), TRITON_CLOCK.timing(kind):
                return func(*args, **kwargs)

        wrapper.__launcher_ranged__ = True
        return wrapper

    # A JITFunction binds `triton.compiler.compile` (the package's name, not the submodule's) once, when it first
    # runs (`JITFunction.create_binder`: `from ..compiler import compile`); kernels that ran before this call (the
    # preflight's or a benchmark's kernel check) keep the original. `JITFunction._do_compile`, where newer
    # Triton has it, is looked up on the class at every compile, so it catches those too.
    compiler.compile = ranged(compiler.compile, "launcher::compile", "compiles")
    package.compile = ranged(package.compile, "launcher::compile", "compiles")
    if hasattr(jit.JITFunction, "_do_compile"):
        jit.JITFunction._do_compile = ranged(jit.JITFunction._do_compile, "launcher::compile", "compiles")
    if hasattr(autotuner.Autotuner, "_bench"):
        autotuner.Autotuner._bench = ranged(autotuner.Autotuner._bench, "launcher::autotune", "autotunes")


def summarize_profiler(profiler, backend: str, warmup: int, steps: int) -> dict[str, Any]:
    """Per profiled step, the seconds of each part (``split_step``), from the profiler's events.

    The step windows and host ranges are the CPU-side events. On a device the profiler also mirrors every
    ``record_function`` range onto the device timeline (user annotations: ``ProfilerStep#N``, ``deltanet::``,
    ...); those are not kernels: only the ``deltanet::`` ones are kept, to count the kernels inside them as
    DeltaNet whatever their names."""
    events = list(profiler.events())
    on_device = backend != "cpu"
    windows = sorted(
        (e.time_range.start / 1e6, e.time_range.end / 1e6, e.name)
        for e in events
        if e.name.startswith("ProfilerStep") and not _is_device_event(e)
    )
    host: dict[str, list[tuple[float, float]]] = {"data_loading": [], "optimizer_host": [], "compile_autotune": []}
    kernels: list[tuple[str, float, float]] = []
    deltanet: list[tuple[float, float]] = []
    for e in events:
        start, end = e.time_range.start / 1e6, e.time_range.end / 1e6
        name = e.name
        if on_device and _is_device_event(e):
            if name.startswith("deltanet::"):
                deltanet.append((start, end))
            elif not (getattr(e, "is_user_annotation", False) or name.startswith(RANGES)):
                kernels.append((kernel_part(name), start, end))
            continue
        if name.startswith("enumerate(DataLoader)"):
            host["data_loading"].append((start, end))
        elif name.startswith("Optimizer.step"):
            host["optimizer_host"].append((start, end))
        elif name.startswith("launcher::"):
            host["compile_autotune"].append((start, end))
    if on_device:
        ranges = _merge(deltanet)
        work = [("deltanet" if _inside(start, ranges) else part, start, end) for part, start, end in kernels]
    else:
        work = _cpu_work(events)
    per_step = []
    for start, end, name in windows:
        parts = split_step((start, end), work, host)
        per_step.append({"name": name, "seconds": end - start, **{k: round(v, 6) for k, v in parts.items()}})
    top = _top_other(events, windows, _merge(deltanet)) if on_device else []
    return {"profiled_steps": per_step, "other_compute_top": top}


def _top_other(events, windows, deltanet: list[tuple[float, float]], top: int = 8) -> list[dict[str, Any]]:
    """The device kernels of ``other_compute`` that took most time, milliseconds per profiled step (by name): what
    a fused kernel could still take away (copies and casts, elementwise ops). Kernels inside a ``deltanet::`` range
    are DeltaNet's, as in ``split_step``."""
    if not windows:
        return []
    spans = _merge([(start, end) for start, end, _ in windows])
    total: dict[str, float] = {}
    for e in events:
        if not _is_device_event(e) or getattr(e, "is_user_annotation", False) or e.name.startswith(RANGES):
            continue
        start = e.time_range.start / 1e6
        if kernel_part(e.name) == "other_compute" and _inside(start, spans) and not _inside(start, deltanet):
            total[e.name] = total.get(e.name, 0.0) + (e.time_range.end - e.time_range.start) / 1e3
    ranked = sorted(total.items(), key=lambda kv: -kv[1])[:top]
    callers = _launchers(events, {name for name, _ in ranked}, spans)
    return [
        {
            "kernel": name[:160],
            "ms_per_step": round(ms / len(windows), 3),
            **(
                {
                    "launched_by": [
                        {"ops": chain, "ms_per_step": round(us / 1e3 / len(windows), 3)} for chain, us in callers[name]
                    ]
                }
                if callers.get(name)
                else {}
            ),
        }
        for name, ms in ranked
    ]


def _launchers(
    events, names: set[str], spans: list[tuple[float, float]], depth: int = 4, top: int = 3
) -> dict[str, list[tuple[str, float]]]:
    """For each kernel name in ``names``, the operators that launched it inside the profiled steps, as chains of
    at most ``depth`` names from the launching operator outwards (``aten::copy_ < aten::_to_copy < ... <
    autograd::engine::evaluate_function: ToCopyBackward0``, with the launching operator's input shapes where the
    profiler recorded them), the ``top`` chains by device microseconds. Module indices in range names are folded
    (``FSDP::pre_forward (...layers.N)``), so the work of every layer adds up in one chain. Chains inside a
    ``deltanet::`` range are left out, as the kernels there are DeltaNet's."""
    found: dict[str, dict[str, float]] = {}
    for e in events:
        kernels = [k for k in getattr(e, "kernels", None) or () if k.name in names]
        if not kernels or _is_device_event(e) or not _inside(e.time_range.start / 1e6, spans):
            continue
        if e.name.startswith(RUNTIME_CALLS):  # shares the correlation id of the operator that launched the kernel
            continue
        chain, parent = [], e
        while parent is not None and not parent.name.startswith("ProfilerStep"):
            if parent.name.startswith("deltanet::"):
                chain = []
                break
            if len(chain) < depth:
                chain.append(LAYER_INDEX.sub(".N", parent.name))
            parent = parent.cpu_parent
        if not chain:
            continue
        shapes = [list(s) for s in getattr(e, "input_shapes", None) or () if s]
        key = " < ".join(chain) + (f" {shapes[:3]}" if shapes else "")
        for k in kernels:
            chains = found.setdefault(k.name, {})
            chains[key] = chains.get(key, 0.0) + k.duration
    return {name: sorted(chains.items(), key=lambda kv: -kv[1])[:top] for name, chains in found.items()}


def _is_device_event(event) -> bool:
    return str(getattr(event, "device_type", "")).split(".")[-1] in ("CUDA", "PrivateUse1")


def _inside(point: float, ranges: list[tuple[float, float]]) -> bool:
    """Whether ``point`` lies in one of the sorted, merged ``ranges``."""
    index = bisect.bisect_right(ranges, (point, float("inf"))) - 1
    return index >= 0 and ranges[index][0] <= point < ranges[index][1]


def _cpu_part(event) -> str | None:
    """The part of a CPU operator from the ranges around it; None inside data loading or compiling (those are
    host work, counted from their ranges)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(("enumerate(DataLoader)", "launcher::")):
            return None
        if parent.name.startswith("deltanet::"):
            return "deltanet"
        if parent.name.startswith("Optimizer.step"):
            return "optimizer"
        parent = parent.cpu_parent
    return kernel_part(event.name)


def _cpu_work(events) -> list[tuple[str, float, float]]:
    """On CPU, each operator's own time as intervals (its range minus its children's), with its part.

    An operator inside a ``deltanet::`` range is DeltaNet and inside ``Optimizer.step`` the optimizer,
    whatever its name; others go by name (``_cpu_part``). The ranges themselves are not work."""
    work = []
    for e in events:
        if e.name.startswith(RANGES):
            continue
        own = [(e.time_range.start / 1e6, e.time_range.end / 1e6)]
        own = _subtract(own, _merge([(c.time_range.start / 1e6, c.time_range.end / 1e6) for c in e.cpu_children]))
        part = _cpu_part(e)
        if part is not None:
            work.extend((part, a, b) for a, b in own)
    return work
