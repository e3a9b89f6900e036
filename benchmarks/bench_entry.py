"""Rank entry of the patch benchmark: measuring wrapped around ``launcher.entry`` (config ``launcher.entry``).

    python -m benchmarks.bench_entry RUN_DIR        (torchrun starts it through `launcher run CONFIG`)

In this process only, before handing over to ``launcher.entry.main`` (which applies the patches and runs
LLaMA-Factory exactly as a real run does):

1. on CUDA, lifts FLA's Hopper guard (``benchmarks.fla_guard``; the measuring H200 has Triton 3.6.0) and records it;
2. runs ``launcher validate-kernels`` cases (``$BENCH_KERNEL_CASES``, e.g. ``full:qwen3_5_27b``) on the
   kernel this run routes to, against the fp32 reference, and records the report and each case as it ends
   (``kernel_check_progress``): the guard is lifted only together with this evidence, from this rank or, where
   ``patch_bench`` runs the check in its first variant only (``--kernel-check first``), from that variant's rank
   on the same machine and kernels in the same invocation (``results.json``: ``kernel_check_in``);
3. makes ``PreTrainedModel.from_pretrained`` build a model folder marked ``random_init.json``
   (``benchmarks.bench_assets``) from its config with random weights directly on this rank's device, in the
   dtype LLaMA-Factory asks for (other folders load normally); under FSDP2 (``accelerate launch``) it builds
   on the meta device instead and each rank materializes only its own shards (``benchmarks.fsdp_init``);
4. times every ``Trainer.training_step`` (forward + backward, device synchronised before and after) and the
   host seconds Triton compiled and autotuned in it (``launcher.rank.profiling.TRITON_CLOCK``), the
   period from its start to the next step's start (the whole optimizer step: forward, backward, optimizer,
   logging, the next batch; the last step has none), the host seconds Python's garbage collector ran inside
   each (``GcClock``), the batch's samples (a packed row's, ``row_samples``) and
   reads the peak allocated memory after each step (``torch.cuda.max_memory_allocated``, the counter
   LLaMA-Factory's ``vram_allocated`` reads too; reset after the kernel check, so it holds the weights and
   the training, not the check).

It also records the rank's place in the job and the variables named in ``$BENCH_RECORD_ENV`` as the rank saw
them (``environment``). Everything lands in ``RUN_DIR/bench/rank<RANK>.json``, rewritten after every step so a
crash keeps the steps done. ``launcher.entry.main`` ends it, as the ``launcher.entry`` config key requires.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import fsdp_init
from launcher.files import write_json_atomic
from launcher.rank import entry
from patches.core.proof import utc_now

KERNEL_CASES_ENV = "BENCH_KERNEL_CASES"
RECORD_ENV = "BENCH_RECORD_ENV"
RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "ACCELERATE_USE_FSDP", "FSDP_VERSION")


class Recorder:
    """The rank's benchmark record, written atomically after every change."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "bench" / f"rank{os.environ.get('RANK', '0')}.json"
        self.data: dict[str, Any] = {"entry": __name__, "started_at": utc_now(), "steps": []}

    def update(self, **fields: Any) -> None:
        self.data.update(fields)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path, self.data)

    def add_step(self, step: dict[str, Any]) -> None:
        self.data["steps"].append(step)
        self.update()


def recorded_environment() -> dict[str, str | None]:
    """The rank's values of the variables named in ``$BENCH_RECORD_ENV`` (comma-separated) and its place in the job:
    what the rank itself saw, not what the caller meant to pass."""
    names = [n for n in os.environ.get(RECORD_ENV, "").split(",") if n]
    return {name: os.environ.get(name) for name in (*RANK_ENV, *names)}


def rank_device(backend: str) -> str:
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "npu":
        import torch_npu  # noqa: F401  (registers the npu device)
    return "cpu" if backend == "cpu" else f"{backend}:{local}"


def run_kernel_check(
    backend: str, patch_settings: dict[str, Any], spec: str, recorder: Recorder | None = None
) -> dict[str, Any] | None:
    """``launcher validate-kernels`` cases ``suite:case,case`` on the kernel this run routes to. Each case is
    printed as it starts and ends, and recorded (``kernel_check_progress``: the cases done, and the one running
    since when), so a run stopped inside the check says where its time went."""
    if not spec or spec == "none":
        return None
    from launcher.checks.kernels.validate import case_progress, select_cases, validate

    suite, _, names = spec.partition(":")
    cases = tuple(n for n in names.split(",") if n) or None
    routing = patch_settings.get("deltanet_routing") or {}
    kernel = routing.get("kernel", "auto") if routing.get("enabled", True) else "auto"  # upstream picks as auto
    printer = case_progress(len(select_cases(suite, cases)), sys.stdout)
    progress: dict[str, Any] = {"done": [], "running": None}

    def on_case(name: str, result) -> None:
        if os.environ.get("RANK", "0") == "0":  # one job log for all ranks: rank 0 speaks for them
            printer(name, result)
        if result is None:
            progress["running"] = {"case": name, "since": utc_now()}
        else:
            progress["running"] = None
            progress["done"].append({"case": name, "status": result.status, "seconds": result.seconds})
        if recorder is not None:
            recorder.update(kernel_check_progress=progress)

    report = validate(backend, kernel=kernel, suite=suite, cases=cases, on_case=on_case)
    return report.to_dict()


def install_random_init(device: str, recorder: Recorder) -> None:
    """``from_pretrained`` of a folder holding the random-init marker builds the model on ``device``."""
    import torch
    from transformers import AutoConfig, PreTrainedModel

    from benchmarks.bench_assets import MARKER

    original = PreTrainedModel.from_pretrained.__func__

    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        marker = Path(str(pretrained_model_name_or_path)) / MARKER
        if not marker.is_file():
            return original(cls, pretrained_model_name_or_path, *args, **kwargs)
        config = kwargs.get("config") or AutoConfig.from_pretrained(marker.parent)
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype", "auto"))
        if dtype in (None, "auto"):
            dtype = config.dtype or torch.float32
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        seed = json.loads(marker.read_text()).get("seed", 0)
        torch.manual_seed(seed)
        if fsdp_init.fsdp2_rank():  # FSDP2: no rank builds the whole model (benchmarks.fsdp_init)
            model = fsdp_init.build_on_meta(cls, config, dtype)
            model.eval()
            install_shard_materialization(device, seed, recorder)
            recorder.update(
                model_build={
                    "how": "built on the meta device; shards not materialized yet",
                    "parameters": sum(p.numel() for p in model.parameters()),
                    "dtype": str(dtype),
                }
            )
            return model
        started = time.perf_counter()
        with torch.device(device):
            model = cls._from_config(config, dtype=dtype)
        model.eval()  # as from_pretrained returns it; LLaMA-Factory switches to train()
        if device != "cpu":
            getattr(torch, device.split(":")[0]).synchronize()
        recorder.update(
            model_build={
                "how": f"{cls.__name__}._from_config(config, dtype={dtype}) under torch.device({device!r}), "
                "random init, seed from the marker; replaces from_pretrained for this folder only",
                "seconds": round(time.perf_counter() - started, 2),
                "parameters": sum(p.numel() for p in model.parameters()),
                "dtype": str(dtype),
            }
        )
        return model

    PreTrainedModel.from_pretrained = classmethod(from_pretrained)


def install_shard_materialization(device: str, seed: int, recorder: Recorder) -> None:
    """Under FSDP2: real storage for the trainable parameters before the Trainer builds its optimizer, and each
    rank's shards allocated and filled once accelerate's ``fsdp2_prepare_model`` sharded the meta model."""
    import accelerate.accelerator
    from transformers import Trainer

    original_create = Trainer.create_optimizer
    original_prepare = accelerate.accelerator.fsdp2_prepare_model

    @functools.wraps(original_create)
    def create_optimizer(self, *args, **kwargs):
        if fsdp_init.flagged_model(self.model) is not None:
            recorder.data["model_build"]["trainable_bytes_before_sharding"] = fsdp_init.materialize_trainable(
                self.model, device
            )
        return original_create(self, *args, **kwargs)

    @functools.wraps(original_prepare)
    def fsdp2_prepare_model(accelerator, model):
        model = original_prepare(accelerator, model)
        if fsdp_init.flagged_model(model) is not None and any(p.is_meta for p in model.parameters()):
            built = fsdp_init.materialize_shards(model, device, seed)
            recorder.update(model_build={**recorder.data.get("model_build", {}), **built})
        return model

    Trainer.create_optimizer = create_optimizer
    accelerate.accelerator.fsdp2_prepare_model = fsdp2_prepare_model  # Accelerator._prepare_fsdp2 calls this name


def real_tokens(mask, ids) -> int | None:
    """The batch's tokens that are not padding: the 2D mask's non-zero entries (its ones, or a packed row's sample
    numbers, 1, 1, 2, 2, 2, 0, as ``packed_rows.device_mask`` hands them to the model), or the tokens a packed row's
    4D mask lets attend to themselves (neat packing)."""
    if mask is None:
        return int(ids.numel()) if ids is not None else None
    if mask.dim() == 4:
        from patches.packing.masks import diagonal_of

        return int(diagonal_of(mask).sum())
    return int((mask != 0).sum())


def row_samples(mask) -> int | None:
    """The batch's samples: a packed row's largest sample number (its 2D mask as ``packed_rows.device_mask`` hands
    it, 1, 1, 2, 2, 2, 0), one for each row of an unpacked batch (its ones), summed over the rows; None for a 4D mask
    (LLaMA-Factory's own, built on the CPU), whose samples are not counted."""
    if mask is None or mask.dim() != 2:
        return None
    return int(mask.amax(dim=-1).sum())


class GcClock:
    """Host seconds inside Python's cyclic garbage collector (``gc.callbacks``), and its full collections (generation
    2, which walk every tracked object of the process), since the clock was installed."""

    def __init__(self) -> None:
        self.seconds, self.full, self._start = 0.0, 0, None

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self.full += info["generation"] == 2
            self._start = None

    def read(self) -> tuple[float, int]:
        return self.seconds, self.full


def install_step_timer(torch, dev, recorder: Recorder) -> None:
    """Time each ``Trainer.training_step`` and the period between step starts, and the host seconds Triton spent
    compiling and autotuning inside it and Python's garbage collector spent inside it and inside its period (``gc_s``,
    ``period_gc_s``, with the full collections); read peak memory after it."""
    import gc

    from transformers import Trainer

    from launcher.rank.profiling import TRITON_CLOCK

    original = Trainer.training_step
    gc_clock = GcClock()
    gc.callbacks.append(gc_clock)
    state: dict[str, Any] = {"last_start": None, "gc_at_last_start": gc_clock.read()}

    @functools.wraps(original)
    def training_step(self, model, inputs, *args, **kwargs):
        dev.sync()
        start = time.perf_counter()
        collected = gc_clock.read()
        if state["last_start"] is not None:  # the previous step's whole period ends where this one starts
            before = state["gc_at_last_start"]
            recorder.data["steps"][-1].update(
                period_s=round(start - state["last_start"], 4),
                period_gc_s=round(collected[0] - before[0], 4),
                period_full_gcs=collected[1] - before[1],
            )
        state["last_start"], state["gc_at_last_start"] = start, collected
        allocated = dev.module.memory_allocated() / 2**30 if dev.module is not None else None
        clock = TRITON_CLOCK.read()
        result = original(self, model, inputs, *args, **kwargs)
        dev.sync()
        compiled = {key: value - clock[key] for key, value in TRITON_CLOCK.read().items()}
        after = gc_clock.read()
        ids = inputs.get("input_ids") if hasattr(inputs, "get") else None
        mask = inputs.get("attention_mask") if hasattr(inputs, "get") else None
        labels = inputs.get("labels") if hasattr(inputs, "get") else None
        recorder.add_step(
            {
                "step": len(recorder.data["steps"]) + 1,
                "seconds": round(time.perf_counter() - start, 4),
                "period_s": None,  # with period_gc_s and period_full_gcs, set when the next step starts
                "period_gc_s": None,
                "period_full_gcs": None,
                # LLaMA-Factory's collator appends a masked dummy image to text-only batches of VL models (and pads
                # to a multiple of 8): seq_len counts those positions, tokens only the sample's own tokens.
                "tokens": real_tokens(mask, ids),
                "samples": row_samples(mask),
                "seq_len": int(ids.shape[-1]) if ids is not None else None,
                "supervised_tokens": int((labels[..., 1:] != -100).sum()) if labels is not None else None,
                "compile_autotune_s": round(compiled["compile_autotune_s"], 3),
                "compiles": compiled["compiles"] + compiled["autotunes"],
                "gc_s": round(after[0] - collected[0], 4),
                "full_gcs": after[1] - collected[1],
                "allocated_at_start_gib": None if allocated is None else round(allocated, 3),
                "peak_allocated_gib": dev.peak_gib(),
                "alloc_retries": dev.alloc_retries(),
            }
        )
        return result

    Trainer.training_step = training_step


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m benchmarks.bench_entry RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(argv[0]).resolve()
    launch = json.loads((run_dir / entry.LAUNCH_FILE).read_text())
    backend = launch["backend"]
    recorder = Recorder(run_dir)
    try:
        import torch

        from launcher.checks.kernels.cases import Device

        dev = Device(torch, rank_device(backend))
        guard = None
        if backend == "cuda":
            from benchmarks.fla_guard import lift_hopper_guard

            guard = lift_hopper_guard()
        recorder.update(backend=backend, device=dev.name, fla_guard=guard, environment=recorded_environment())
        from launcher.rank.profiling import time_triton

        time_triton()  # before any kernel runs: a JITFunction binds Triton's compile at its first call
        check = run_kernel_check(backend, launch["patches"], os.environ.get(KERNEL_CASES_ENV, ""), recorder)
        recorder.update(kernel_check=check)
        dev.reset_peak()  # the kernel check's memory is not the training's
        install_random_init(dev.name, recorder)
        install_step_timer(torch, dev, recorder)
    except BaseException as exc:
        entry.write_error_file(run_dir, exc)
        raise
    try:
        return entry.main(argv)
    finally:
        recorder.update(ended_at=utc_now(), process_peak_allocated_gib=dev.peak_gib())


if __name__ == "__main__":
    sys.exit(main())
