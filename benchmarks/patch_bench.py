"""Benchmark: the patches and performance options through the real launcher path.

    python -m benchmarks.patch_bench --out DIR [--steps 6] [--all-steps N] [--variants on,off,...]
                                     [--shape 27b|tiny] [--backend cuda|cpu] [--kernel-check first|each|none]
                                     [--rounds R]

Variants (``VARIANTS``, run in the order given): ``on`` (the product's defaults), ``off`` (every patch off:
LLaMA-Factory 0.9.5's own behaviour), ``budget120`` (``checkpoint_all_layers.memory_budget_gib: 120``),
``glue-off`` (``fused_ops`` and ``lora_input_cast`` off: the product before the fused glue), ``fused-nolora``
(``lora_input_cast`` off), ``budget120-glue-off``, ``spread`` and ``spread-pad256`` (samples of about 1,000 to 4,096
tokens, the second padded to a multiple of 256), ``ctx32k`` and ``ctx64k`` (cutoff 8x and 16x), ``on-warm`` (``on``
again, its first step with the Triton cache the earlier variants filled: ``TRITON_CACHE_DIR`` is ``DIR/triton-cache``
for every variant unless the caller sets it), ``profile``
(``on``'s config through ``launcher profile`` instead of ``launcher run``: 5 steps, the last ``5 - --warmup``
of them profiled), ``spread-packed`` (the spread's samples with ``packing: true``: rows of 4,096 tokens holding
several samples each; the packing issue's target is 1.5x the supervised tokens/s of ``spread``),
``spread-packed-profile`` (``spread-packed`` through ``launcher profile``, like ``profile``),
``spread-packed-full`` (``spread-packed`` with ``packed_rows.cut_padding: 0``: every row as long as LLaMA-Factory
pads it, the packed row before that option),
``spread-packed-cpu-mask`` (``spread-packed`` with ``packed_rows.device_mask: false``: LLaMA-Factory's 4D mask
built on the CPU, the packed row before that option), ``spread-packed-workers`` and ``on-workers`` (the batches
collated in 2 DataLoader workers instead of the training process), ``short`` and
``short-packed`` (the same pair with samples of about 500 to 2,048 tokens), ``gc-off`` (``on`` with ``gc_freeze``
off: Python's collector as upstream leaves it), ``heads-repeated`` (``on`` with ``packed_rows.unpacked_forward``
off: transformers' DeltaNet forward for unpacked steps, the key heads repeated before FLA's chunk kernel),
``on-reply70`` (``on`` with samples that answer in 70 % of their tokens, as the spread's do, instead of half),
``on-nooffload`` (``on`` with ``checkpoint_all_layers.offload_inputs: false``: against ``on``, whose ``auto`` must
choose off at 4,096 tokens), ``ctx16k-nooffload`` / ``ctx16k-offload`` and ``ctx32k-nooffload`` / ``ctx32k-offload``
(cutoff 4x and 8x with ``offload_inputs`` false and true: the pairs whose tokens/s the offload issue compares, the
first on an 80 GB H100, the second on an H200), ``ctx64k-offload`` and ``ctx128k-offload`` (cutoff 16x and 32x with
it on: one H100, one H200).

1. ``DIR/model``: a config-only folder of the Qwen3.5-27B shape (``--shape 27b``; ``tiny`` for a CPU run of
   the plumbing) with the demo tokenizer and a matching processor (``benchmarks.bench_assets``); the rank
   entry builds the model from it with random weights on the device.
2. ``DIR/data-<cutoff>``: samples longer than ``cutoff_len``, each side longer than half of it, so every step sees
   exactly the cutoff (4096 for ``27b``, 256 for ``tiny``, times the variant's factor), half of it the response's
   (``DIR/data-<cutoff>-reply70``: 70 % of it); ``DIR/data-spread`` and ``DIR/data-short`` for the spreads.
3. ``DIR/configs/<variant>.yaml``: the seed's LoRA settings (r8 on q/k/v/o, batch 1, bf16 on CUDA, gradient
   checkpointing on) for ``--all-steps`` steps if given, else the variant's own count, else ``--steps``;
   ``launcher.entry: benchmarks.bench_entry``.
4. ``python -m launcher run CONFIG --quiet`` for each variant (``profile``: ``python -m launcher profile CONFIG
   --steps S-W --warmup W --quiet``), with ``RECORD_VRAM=1`` (LLaMA-Factory logs
   ``vram_allocated``) and ``LAUNCHER_PREFLIGHT_SKIP=packages,kernel,model,data_stats``: a measuring host is
   not the
   CUDA image (packages), its Triton trips FLA's Hopper guard in the preflight child process, where the guard
   is not lifted (kernel; the rank entry runs the kernel check instead: in the first variant's rank by default,
   ``--kernel-check``), the folder has no weights (model), and
   the samples are longer than the cutoff on purpose, which a formal run's data check refuses (data_stats).
5. ``DIR/results.json`` (the results schema, ``benchmarks/results_schema.py``): the steps each variant ran (``steps``,
   by variant), then per variant the run's end state, step times (median after ``--warmup`` steps, and by the samples of
   the step's batch: ``by_samples``), tokens/s = tokens per step / median forward+backward time, the garbage collector's
   host seconds and full collections over the measured steps, supervised tokens/s after the warm-up (less the host's
   seconds inside Triton's compile and autotune calls, and over the steps of lengths seen before), the step period and
   LLaMA-Factory's own throughput, peak allocated memory, which kernel ran (proof records), how layers were checkpointed
   in the first step, and the kernel check of the rank process (with each case's seconds as it ran,
   ``kernel_check_progress``, and for a run that did not succeed the end of its job log, Triton's reproducer dumps
   folded); then the targets (docs/performance.md) are compared. With ``--rounds R`` the list runs R times in turn,
   round R's runs keyed ``VARIANT#R``; a packed variant's target (``spread-packed-row``: its median step period and
   forward+backward against ``on``'s, with a 95 % bootstrap interval of the difference, and beside it
   ``at_equal_supervised``: the packed rows read at the unpacked steps' supervised tokens; ``spread-packed-row-reply70``
   the same against ``on-reply70``, ``spread-packed-full-row-reply70`` ``spread-packed-full`` against it) pools the
   rounds; the other targets read the first round. Rounds split over several calls pool with ``pooled_targets(FILE,
   FILE, ...)``. Interrupted (Ctrl-C, ``timeout -s INT``, SIGTERM) while it runs the variants, it stops the running
   variant's run, waits for it to end, records it (``interrupted``), writes what it has and exits 130 (between two runs:
   ``"interrupted": "between runs"`` at the top of the results). ``profile`` adds the run's ``profile.json``
   (``launcher/results/profile_report.py``) and ``profile.md``, which is also copied to ``DIR/profile.md``; the traces
   stay in the run directory (their paths are in the results).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks import bench_entry, results_schema
from benchmarks.bench_assets import SPREAD_REPLY_SHARE
from launcher.files import tail_lines
from launcher.state.runs import JOB_LOG

REPO = Path(__file__).resolve().parent.parent
BENCH = "benchmarks.patch_bench"  # its results file's ``bench``
ALL_OFF = {
    "deltanet_routing": False,
    "fused_ops": False,
    "checkpoint_all_layers": False,
    "chunked_loss": False,
    "text_only_batches": False,
    "final_eval_once": False,
    "lora_input_cast": False,
    "packed_rows": False,
    "fsdp2_frozen_dtype": False,
    "fsdp2_resume_adapter": False,
    "gc_freeze": False,
}
GLUE_OFF = {"fused_ops": False, "lora_input_cast": False}  # the product before the fused-glue issue
# name -> patches (on top of the product's defaults), cutoff factor, data ("full": every sample at the cutoff;
# "spread": about 1,000 to 4,096 tokens), steps (None: --steps)
VARIANTS: dict[str, dict[str, Any]] = {
    "on": {"patches": {}},
    "off": {"patches": ALL_OFF},
    "budget120": {"patches": {"checkpoint_all_layers": {"memory_budget_gib": 120.0}}},
    "glue-off": {"patches": GLUE_OFF},
    "fused-nolora": {"patches": {"lora_input_cast": False}},  # the fused ops alone, PEFT's fp32 copy kept
    "budget120-glue-off": {"patches": {**GLUE_OFF, "checkpoint_all_layers": {"memory_budget_gib": 120.0}}},
    "spread": {"data": "spread", "steps": 32},
    "spread-pad256": {"data": "spread", "steps": 32, "patches": {"pad_lengths": {"multiple": 256}}},
    "ctx32k": {"cutoff_factor": 8, "steps": 3},
    "ctx64k": {"cutoff_factor": 16, "steps": 3},
    "on-warm": {"steps": 3},  # "on" again: its first step with the Triton cache the earlier runs filled
    # "on" through `launcher profile`: 5 steps in all (max_steps), --warmup of them before the profiled ones
    "profile": {"steps": 5, "profile": True},
    "spread-packed": {"data": "spread", "steps": 24, "lf": {"packing": True}},
    "spread-packed-profile": {"data": "spread", "steps": 5, "profile": True, "lf": {"packing": True}},
    # spread-packed with every row as long as LLaMA-Factory pads it (packed_rows before cut_padding)
    "spread-packed-full": {
        "data": "spread",
        "steps": 24,
        "lf": {"packing": True},
        "patches": {"packed_rows": {"cut_padding": 0}},
    },
    # spread-packed with LLaMA-Factory's 4D mask built on the CPU by its collator (packed_rows before device_mask)
    "spread-packed-cpu-mask": {
        "data": "spread",
        "steps": 24,
        "lf": {"packing": True},
        "patches": {"packed_rows": {"device_mask": False}},
    },
    # spread-packed and on with the batches collated in 2 DataLoader workers, off the training process
    "spread-packed-workers": {"data": "spread", "steps": 24, "lf": {"packing": True, "dataloader_num_workers": 2}},
    "on-workers": {"lf": {"dataloader_num_workers": 2}},
    # "on" with Python's garbage collector as upstream leaves it: a full collection walks the whole heap, 0.4 s
    # inside the 16th step of a 20-step run on the 27B shape (docs/lab/2026-12-06-row-costs-and-stall.md)
    "gc-off": {"patches": {"gc_freeze": False}},
    # "on" with transformers' own DeltaNet forward for unpacked steps: the key heads repeated for the value heads
    # before FLA's chunk kernel (packed_rows.unpacked_forward off)
    "heads-repeated": {"patches": {"packed_rows": {"unpacked_forward": False}}},
    # "on" with samples that answer in the spread's share of their tokens (70 %, not half): an unpacked step that
    # holds what the packed rows hold, token for token, save their padding (the packed-row target's like pair)
    "on-reply70": {"reply_share": SPREAD_REPLY_SHARE},
    # shorter samples (about 500 to 2,048 tokens): where several share a row
    "short": {"data": "short", "steps": 32},
    "short-packed": {"data": "short", "steps": 24, "lf": {"packing": True}},
    # the memory forecast against a run: "on" at 4,096 tokens (forecast 55 GiB, fits an H200) beside 131,072 tokens
    # (forecast about 181 GiB, will not fit); preflight's memory row would refuse the second, so it is skipped there,
    # and the run must end OUT_OF_MEMORY with the phase recorded (results.json: forecast, out_of_memory)
    "forecast-fits": {"steps": 3},
    # checkpoint_all_layers.offload_inputs (the offload issue): the checkpointed layers' inputs in pinned host memory
    "on-nooffload": {"patches": {"checkpoint_all_layers": {"offload_inputs": False}}},
    "ctx16k-nooffload": {
        "cutoff_factor": 4,
        "steps": 6,
        "patches": {"checkpoint_all_layers": {"offload_inputs": False}},
    },
    "ctx16k-offload": {"cutoff_factor": 4, "steps": 6, "patches": {"checkpoint_all_layers": {"offload_inputs": True}}},
    "ctx32k-nooffload": {
        "cutoff_factor": 8,
        "steps": 4,
        "patches": {"checkpoint_all_layers": {"offload_inputs": False}},
    },
    "ctx32k-offload": {"cutoff_factor": 8, "steps": 4, "patches": {"checkpoint_all_layers": {"offload_inputs": True}}},
    "ctx64k-offload": {"cutoff_factor": 16, "steps": 3, "patches": {"checkpoint_all_layers": {"offload_inputs": True}}},
    "ctx128k-offload": {
        "cutoff_factor": 32,
        "steps": 3,
        "patches": {"checkpoint_all_layers": {"offload_inputs": True}},
    },
    # with the allocator's history recorded for its first 2 steps, so the OOM leaves memory_snapshot_rank0.pickle
    "forecast-oom": {
        "cutoff_factor": 32,
        "steps": 3,
        "preflight_skip": "memory",
        "launcher": {"memory_history_steps": 2},
    },
}
VARIANT_PATCHES = {name: v.get("patches", {}) for name, v in VARIANTS.items()}
CUTOFF = {"27b": 4096, "tiny": 256}
# data name -> (fewest, most tokens) per shape, and how many samples (enough for the packed variant's steps)
SPREAD = {
    "spread": ({"27b": (1000, 4096), "tiny": (64, 256)}, 40),
    "short": ({"27b": (500, 2048), "tiny": (32, 128)}, 80),
}
# through `launcher run` on one H200, 27B shape (the performance issue's targets)
TARGETS: dict[str, dict[str, float]] = {
    "on": {"peak_max": 56.0, "tokens_per_s_min": 3400.0},  # the fused-glue issue (before it: 2,790)
    "budget120": {"peak_max": 120.0, "tokens_per_s_min": 4600.0},  # before it: 3,500
    "profile": {"other_compute_max_s": 0.25},
    "ctx32k": {"peak_max": 90.0},
    "ctx64k": {"peak_max": 125.0},
    "ctx64k-offload": {"peak_max": 76.0},  # one 80 GB H100 (the offload issue)
    "ctx128k-offload": {},  # one H200: it must succeed
}
# the offload issue: tokens/s with offload_inputs on against off at a length where both fit (16,384 tokens on an H100,
# 32,768 on an H200), and at 4,096 tokens the default (auto, which must choose off) against off: the same speed and peak
OFFLOAD_PAIRS = {"ctx16k-offload": "ctx16k-nooffload", "ctx32k-offload": "ctx32k-nooffload"}
OFFLOAD_SPEED_MIN = 0.90
DEFAULT_PATH_PAIR = ("on", "on-nooffload")
DEFAULT_PATH_SPEED_MIN, DEFAULT_PATH_PEAK_GIB = 0.98, 0.1  # noise: 2 % of tokens/s, 0.1 GiB of peak
PACKING_GAIN_MIN = 1.5  # supervised tokens/s of spread-packed over spread (the packing issue)
# the fused-glue issue's last target, a packed 4,096-token row no slower than an unpacked 4,096-token step: the
# target's key -> the packed variant and the unpacked one it is held against (same collation: in the training
# process, or in workers). "on"'s samples answer in half their tokens, the spread's in 70 %: ``-reply70`` pairs the
# packed rows with unpacked steps of the same share, so that both train on the same kind of sample
PACKED_ROW_PAIRS = {
    "spread-packed-row": ("spread-packed", "on"),
    "spread-packed-row-reply70": ("spread-packed", "on-reply70"),
    "spread-packed-full-row-reply70": ("spread-packed-full", "on-reply70"),
    "spread-packed-workers-row": ("spread-packed-workers", "on-workers"),
}
BOOTSTRAP_DRAWS = 2000  # resamples of each side's measured steps for the interval of a difference of medians
# the routed chunk kernel (and its packed call with the key heads unrepeated, as packed rows make it) and the fused
# glue, in the rank, with FLA's guard lifted as for training
KERNEL_CASES = {
    "27b": "full:qwen3_5_27b,varlen_grouped,conv_27b,conv_varlen_27b,rms_norm_27b,q_norm_27b,gated_norm_27b,swiglu_27b",
    "tiny": "quick:layout",
}
PREFLIGHT_SKIP = "packages,kernel,model,data_stats"
LOG_TAIL_LINES = 30  # of a run that did not succeed, the end of its job log in results.json
# Triton's NVIDIA backend prints a failed ptxas run's PTX between two rules of 64 "=" and then this line (its
# compiler.py); autotuning skips such a config and goes on, so in a job log the dump is noise that can fill a tail
REPRODUCER_RULE, REPRODUCER_END = "=" * 64, "please share the reproducer above with Triton project."
CENSUS_KEYS = ("layers", "gradient_checkpointing_true", "functions", "observed", "by_layer_type")
CASE_KEYS = ("name", "shape", "key_heads", "status", "errors", "finite", "peak_memory_gib", "timing_ms", "note")


def run_name_of(variant: str, shape: str) -> str:
    """The config's run name; `launcher profile` appends ``-profile`` itself."""
    if VARIANTS[variant].get("profile"):
        return f"bench-{shape}" if variant == "profile" else f"bench-{shape}-{variant.removesuffix('-profile')}"
    return f"bench-{shape}-{variant}"


def launcher_args(variant: str, config_path: Path, steps: int, warmup: int, profiled: bool | None = None) -> list[str]:
    """The ``launcher`` verb and arguments that run a variant: ``run``, or ``profile`` with the steps after
    ``warmup`` profiled (``max_steps`` in the config is the same ``steps``, which `launcher profile` sets).
    ``profiled``: for a variant that is not one of ``VARIANTS`` (``fsdp_bench``'s), whether it is profiled."""
    if VARIANTS[variant].get("profile") if profiled is None else profiled:
        return ["profile", str(config_path), "--steps", str(steps - warmup), "--warmup", str(warmup), "--quiet"]
    return ["run", str(config_path), "--quiet"]


def steps_of(variant: str, steps: int, every: int | None = None) -> int:
    """``every`` (``--all-steps``) if given, else the variant's own count, else ``steps`` (``--steps``)."""
    return every or VARIANTS[variant].get("steps") or steps


def cutoff_of(variant: str, shape: str) -> int:
    return CUTOFF[shape] * VARIANTS[variant].get("cutoff_factor", 1)


def data_dir(out: Path, variant: str, shape: str) -> tuple[Path, str]:
    """The dataset folder and name of a variant (one folder per cutoff and reply share, one for each spread)."""
    from benchmarks.bench_assets import DATASET
    from benchmarks.bench_assets import SPREAD as SPREAD_NAME

    if VARIANTS[variant].get("data") in SPREAD:
        return out / f"data-{VARIANTS[variant]['data']}", SPREAD_NAME
    share = VARIANTS[variant].get("reply_share")
    suffix = f"-reply{round(share * 100)}" if share else ""
    return out / f"data-{cutoff_of(variant, shape)}{suffix}", DATASET


def run_config(out: Path, variant: str, shape: str, backend: str, steps: int) -> dict[str, Any]:
    """The run config of one variant for ``steps`` optimizer steps: LLaMA-Factory keys plus the launcher section."""
    folder, dataset = data_dir(out, variant, shape)
    config: dict[str, Any] = {
        "launcher": {
            "backend": backend,
            "nproc_per_node": 1,
            "distribution": "ddp",
            "run_name": run_name_of(variant, shape),
            "output_root": str(out / "runs"),
            "smoke": shape != "27b",
            "entry": "benchmarks.bench_entry",
            "stop_grace_s": 20,
            "patches": VARIANT_PATCHES[variant],
            **VARIANTS[variant].get("launcher", {}),
        },
        "model_name_or_path": str(out / "model"),
        "dataset_dir": str(folder),
        "dataset": dataset,
        "template": "qwen3_vl_nothink",
        "cutoff_len": cutoff_of(variant, shape),
        "overwrite_cache": True,
        "preprocessing_num_workers": 1,
        "dataloader_num_workers": 0,
        "stage": "sft",
        "do_train": True,
        "finetuning_type": "lora",
        "lora_rank": 8,
        "lora_alpha": 16,
        "lora_dropout": 0.05,
        "lora_target": "q_proj,k_proj,v_proj,o_proj",
        "gradient_checkpointing": True,
        "per_device_train_batch_size": 1,
        "gradient_accumulation_steps": 1,
        "learning_rate": 5.0e-5,
        "lr_scheduler_type": "cosine",
        "max_steps": steps,
        "max_grad_norm": 1.0,
        "logging_steps": 1,
        "save_strategy": "no",
        "eval_strategy": "no",
        "report_to": "none",
        "include_num_input_tokens_seen": True,
    }
    if backend != "cpu":
        config["bf16"] = True
    config.update(VARIANTS[variant].get("lf", {}))
    return config


# an interrupted benchmark waits this long for its run to end: the supervisor's graceful stop (a checkpoint at the
# job's next step, within launcher.stop_grace_s, 120 s by default) and the end of its record
INTERRUPT_WAIT_S = 300


def _stop(proc: subprocess.Popen, wait_s: float) -> tuple[int, bool]:
    """SIGTERM to ``launcher``'s supervisor, which stops the job's whole process tree (it keeps the first stop signal
    it gets); its exit code, and whether it ended by itself within ``wait_s`` seconds (else it was killed)."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=wait_s), True
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(), False


class RunInterrupted(KeyboardInterrupt):
    """``run_variant`` was interrupted and has ended its run: ``run`` is the run's record (``interrupted``), for a
    caller that keeps it before it stops; one that does not catch it stops as at any Ctrl-C."""

    def __init__(self, run: dict[str, Any]) -> None:
        super().__init__("interrupted; the run was stopped")
        self.run = run


def run_variant(args: list[str], env: dict[str, str], timeout_s: float, log: Path) -> dict[str, Any]:
    """``launcher ARGS`` (``run CONFIG --quiet``, ``profile ...``) in a child process; SIGTERM (a graceful stop)
    when it overruns. Interrupted itself (Ctrl-C, ``timeout -s INT``), the benchmark stops the run and waits for
    its supervisor to end it, then raises ``RunInterrupted`` with the run's record: the job runs in a session of its
    own and would otherwise outlive the benchmark, holding the device the next command meets (63 GiB of an H100
    once, which the next variant ran out of)."""
    cmd = [sys.executable, "-m", "launcher", *args]
    started = time.monotonic()
    interrupted = False
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout=timeout_s)
        except KeyboardInterrupt:
            interrupted = True
            print(
                "[patch_bench] interrupted: stopping the run and waiting for it to end (at most "
                f"{INTERRUPT_WAIT_S} s; another Ctrl-C leaves it running)",
                file=sys.stderr,
                flush=True,
            )
            code, ended = _stop(proc, INTERRUPT_WAIT_S)
            if not ended:
                print(
                    f"[patch_bench] the run did not end in {INTERRUPT_WAIT_S} s; its supervisor was killed and "
                    f"its job may still run (`launcher status`; the supervisor's log: {log})",
                    file=sys.stderr,
                    flush=True,
                )
        except subprocess.TimeoutExpired:
            try:
                code, _ = _stop(proc, 90)
            except KeyboardInterrupt:  # interrupted while its overrun stops it: wait as an interrupted run does
                interrupted = True
                code, _ = _stop(proc, INTERRUPT_WAIT_S)
    wall = time.monotonic() - started
    run = {
        "command": " ".join(["python", *cmd[1:]]),
        "exit_code": code,
        "wall_s": round(wall, 1),
        "timed_out": not interrupted and wall >= timeout_s,
    }
    if interrupted:
        raise RunInterrupted({**run, "interrupted": True})
    return run


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _newest_run(root: Path, name: str) -> Path | None:
    """The newest run directory of run name ``name`` (``NAME-YYYYMMDD-HHMMSS``, launcher.run.rundir): not one of a
    longer name that starts the same (``...-fsdp2-profile-...`` is not a ``...-fsdp2`` run)."""
    own = re.compile(re.escape(name) + r"-\d{8}-\d{6}(-\d+)?")
    runs = sorted(
        (p for p in root.glob(f"{name}-*") if own.fullmatch(p.name) and (p / "status.json").exists()),
        key=lambda p: p.stat().st_mtime,
    )
    return runs[-1] if runs else None


def _proof_summary(run_dir: Path) -> dict[str, Any]:
    routing = _read_json(run_dir / "proof" / "rank0" / "deltanet_routing.json")
    ckpt = _read_json(run_dir / "proof" / "rank0" / "checkpoint_all_layers.json")
    first = ckpt.get("first_training_step", {})
    return {
        "deltanet_routing": {
            "status": routing.get("status"),
            "route": routing.get("route") or routing.get("upstream"),
            "first_call": routing.get("first_call"),
            "first_training_step": routing.get("first_training_step"),
            "error": routing.get("error"),
        },
        "checkpoint_all_layers": {
            "status": ckpt.get("status"),
            "offload_inputs": ckpt.get("offload_inputs"),
            **{k: first.get(k) for k in CENSUS_KEYS},
            "layer_plan": ckpt.get("layer_plan"),
            "plan_correction": ckpt.get("plan_correction"),
            "plan_recheck": ckpt.get("plan_recheck"),
            "second_step_observed": (ckpt.get("second_training_step") or {}).get("observed"),
            "third_step_observed": (ckpt.get("third_training_step") or {}).get("observed"),
        },
        **{
            name: {
                k: v
                for k, v in _read_json(run_dir / "proof" / "rank0" / f"{name}.json").items()
                if k in ("status", "first_call", "first_batch", "dummy_image", "why", "evaluations", "multiple")
            }
            for name in ("chunked_loss", "text_only_batches", "final_eval_once", "pad_lengths")
        },
        "packed_rows": {
            k: v
            for k, v in _read_json(run_dir / "proof" / "rank0" / "packed_rows.json").items()
            if k
            in (
                "status",
                "packing",
                "first_packed_batch",
                "first_packed_call",
                "first_packed_attention",
                "first_one_sample_attention",
                "first_multi_sample_attention",
                "first_unpacked_call",
                "first_training_step",
                "error",
            )
        },
        **{
            name: {
                k: v
                for k, v in _read_json(run_dir / "proof" / "rank0" / f"{name}.json").items()
                if k in ("status", "ops", "first_training_step", "error")
            }
            for name in ("fused_ops", "lora_input_cast")
        },
        "gc_freeze": {
            k: v
            for k, v in _read_json(run_dir / "proof" / "rank0" / "gc_freeze.json").items()
            if k in ("status", "frozen_objects", "full_collection_s", "before_training_step", "upstream")
        },
    }


def _retries_in(steps: list[dict[str, Any]], warmup: int) -> int | None:
    """Allocator retries in the steps after the warm-up, from the per-step cumulative ``alloc_retries``."""
    counts = [s.get("alloc_retries") for s in steps]
    if not steps or counts[-1] is None:
        return None
    before = counts[warmup - 1] if 0 < warmup < len(counts) else 0  # as summarize: all steps when none is after
    return counts[-1] - (before or 0)


def summarize(run_dir: Path, warmup: int) -> dict[str, Any]:
    """What one run measured, read from its run directory."""
    status = _read_json(run_dir / "status.json")
    bench = _read_json(run_dir / "bench" / "rank0.json")
    steps = bench.get("steps", [])
    measured = steps[warmup:] or steps
    result: dict[str, Any] = {
        "run_dir": str(run_dir),
        "state": status.get("state"),
        "exit_code": status.get("exit_code"),
        "reason": status.get("reason"),
        "out_of_memory": status.get("out_of_memory"),
        "memory_snapshots": {p.name: p.stat().st_size for p in sorted(run_dir.glob("memory_snapshot_rank*.pickle"))},
        "steps_recorded": len(steps),
        "warmup_steps": min(warmup, len(steps)),
    }
    if measured:
        median_s = statistics.median(s["seconds"] for s in measured)
        periods = [s["period_s"] for s in measured if s.get("period_s")]
        tokens = measured[-1].get("tokens") or 0
        result.update(
            seq_lens=sorted({s.get("seq_len") for s in steps}),
            tokens_per_step=sorted({s.get("tokens") for s in steps}),
            step_seconds=[s["seconds"] for s in steps],
            step_periods=[s.get("period_s") for s in steps],
            step_seq_lens=[s.get("seq_len") for s in steps],
            step_samples=[s.get("samples") for s in steps],
            step_supervised=[s.get("supervised_tokens") for s in steps],
            step_period_gc_s=[s.get("period_gc_s") for s in steps],
            by_samples=by_samples(measured),
            **gc_summary(measured),
            median_fwd_bwd_s=round(median_s, 4),
            tokens_per_s=round(tokens / median_s, 1) if median_s else None,
            median_period_s=round(statistics.median(periods), 4) if periods else None,
            tokens_per_s_by_period=round(tokens / statistics.median(periods), 1) if periods else None,
            peak_allocated_gib=max(s["peak_allocated_gib"] or 0 for s in steps),
            allocated_at_first_step_gib=steps[0].get("allocated_at_start_gib"),
            first_step_s=steps[0]["seconds"],
            # the allocator's retries during the measured steps (cumulative counter: the last minus the one before)
            alloc_retries_measured=_retries_in(steps, warmup),
            **lengths_summary(steps, warmup),
        )
    log = [json.loads(line) for line in _lines(run_dir / "output" / "trainer_log.jsonl")]
    if log:
        result["llamafactory"] = {
            "throughput_last": log[-1].get("throughput"),
            "vram_allocated_max_gib": max((x.get("vram_allocated") or 0) for x in log),
            "loss": [x.get("loss") for x in log if "loss" in x],
        }
    result["model_build"] = bench.get("model_build")
    result["fla_guard"] = bench.get("fla_guard")
    check = bench.get("kernel_check") or {}
    result["kernel_check"] = None
    if check:
        cases = [{k: c.get(k) for k in CASE_KEYS} for c in check.get("cases", [])]
        result["kernel_check"] = {k: check.get(k) for k in ("ok", "kernel", "glue_kernels", "error")} | {"cases": cases}
    result["kernel_check_progress"] = bench.get("kernel_check_progress")  # the cases' seconds; the one it stopped in
    if status.get("state") != "SUCCEEDED":  # where a failed or stopped run was: the end of what the job printed
        result["job_log_tail"] = readable_tail(run_dir / JOB_LOG, LOG_TAIL_LINES)
    result["proof"] = _proof_summary(run_dir)
    return result


def by_samples(measured: list[dict[str, Any]]) -> dict[str, dict[str, Any]] | None:
    """The measured steps grouped by the samples their batch held (``bench_entry.row_samples``: for a packed row of
    batch size 1, its samples), each group's count and median forward+backward and period: which rows cost what.
    None where the steps did not count their samples (a 4D mask, or a record from before they were counted)."""
    groups: dict[int, list[dict[str, Any]]] = {}
    for step in measured:
        if step.get("samples") is not None:
            groups.setdefault(step["samples"], []).append(step)
    if not groups:
        return None
    found = {}
    for samples, group in sorted(groups.items()):
        periods = [s["period_s"] for s in group if s.get("period_s")]
        found[str(samples)] = {
            "steps": len(group),
            "median_fwd_bwd_s": round(statistics.median(s["seconds"] for s in group), 4),
            "median_period_s": round(statistics.median(periods), 4) if periods else None,
        }
    return found


def gc_summary(measured: list[dict[str, Any]]) -> dict[str, Any]:
    """Python's garbage collector over the periods of the measured steps (``bench_entry.GcClock``; a period holds
    its step, and the last step has none): its host seconds in all, its full collections, and the most seconds in
    one period (a full collection stalls the host, and with it the device once its queue drains)."""
    periods = [s.get("period_gc_s") for s in measured if s.get("period_gc_s") is not None]
    if not periods:
        return {}
    return {
        "gc_s_measured": round(sum(periods), 3),
        "full_gcs_measured": sum(s.get("period_full_gcs") or 0 for s in measured),
        "gc_s_longest_period": round(max(periods), 3),
    }


def profile_summary(run_dir: Path, out: Path) -> dict[str, Any]:
    """A ``launcher profile`` run's report (``profile.json``), its ``profile.md`` (copied to ``out``) and where
    its traces are, with their sizes: they are large, so they stay in the run directory."""
    report = _read_json(run_dir / "profile.json")
    md = run_dir / "profile.md"
    if md.is_file():
        shutil.copyfile(md, out / "profile.md")
    traces = {}
    for name in report.get("traces", []):
        path = run_dir / name
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        traces[str(path)] = round(sum(p.stat().st_size for p in files) / 2**20, 1)
    return {
        "report": report or None,
        "markdown": md.read_text() if md.is_file() else None,
        "markdown_copy": str(out / "profile.md") if md.is_file() else None,
        "trace_mib": traces,
    }


def robust_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Slope and intercept of the Theil-Sen line through ``points`` (x, y): the median of the slopes between every
    two points of distinct x, and the median intercept at that slope. A least-squares line follows the one step in
    thirty that compiles for minutes; this one does not while the stray points take part in under about 29 % of
    those pairs (a stray at an x met once takes part in more of them than one at a common x). ``ValueError`` for
    fewer than two distinct x."""
    slopes = [(y2 - y1) / (x2 - x1) for (x1, y1), (x2, y2) in itertools.combinations(points, 2) if x1 != x2]
    if not slopes:
        raise ValueError("a line needs points at two distinct x at least")
    slope = statistics.median(slopes)
    return slope, statistics.median(y - slope * x for x, y in points)


def lengths_summary(steps: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Supervised tokens/s after the warm-up (over those steps' seconds, and over them less the host's seconds
    inside Triton's compile and autotune calls: the steady state), the distinct padded lengths, and the seconds
    lost to steps that met a length not seen before (each such step against a line fitted through the steps of
    seen lengths less their own compile seconds, where recorded: such a step may compile too, as the first row of
    several samples does; ``robust_line`` for what the clock does not show)."""
    measured = steps[warmup:] or steps
    seconds = sum(s["seconds"] for s in measured)
    supervised = sum(s.get("supervised_tokens") or 0 for s in measured)
    seen = {steps[0].get("seq_len")}
    new, repeat = [], []
    for s in steps[1:]:  # the first step (compile, autotune, allocator warm-up) is reported on its own
        (new if s.get("seq_len") not in seen else repeat).append(s)
        seen.add(s.get("seq_len"))
    lost = None
    if len(repeat) >= 2 and len({s["seq_len"] for s in repeat}) >= 2:
        slope, intercept = robust_line(
            [(s["seq_len"], s["seconds"] - (s.get("compile_autotune_s") or 0.0)) for s in repeat]
        )
        lost = round(sum(max(0.0, s["seconds"] - (intercept + slope * s["seq_len"])) for s in new), 2)
    repeat_seconds = sum(s["seconds"] for s in repeat)
    repeat_supervised = sum(s.get("supervised_tokens") or 0 for s in repeat)
    # bench_entry times the host's seconds inside Triton's compile and autotune calls in every step (a disk-cache
    # hit is such a call too, of milliseconds): the steady state takes them out of the steps after the warm-up
    timed = [s["compile_autotune_s"] for s in steps if s.get("compile_autotune_s") is not None]
    compiling = sum(s.get("compile_autotune_s") or 0.0 for s in measured)
    steady_seconds = seconds - compiling if len(timed) == len(steps) else 0.0
    return {
        "supervised_tokens_per_s": round(supervised / seconds, 1) if seconds and supervised else None,
        # the same over the steps of a length seen before: neither Triton's compiles nor the other first-time
        # costs of a new length (likely cuBLAS and the allocator) are in them: a long run's reading
        "supervised_tokens_per_s_seen_lengths": round(repeat_supervised / repeat_seconds, 1)
        if repeat_seconds and repeat_supervised
        else None,
        "supervised_tokens_per_s_minus_compile": round(supervised / steady_seconds, 1)
        if steady_seconds > 0 and supervised
        else None,
        "compile_autotune_s_after_warmup": round(compiling, 2) if timed else None,
        "compile_autotune_s": round(sum(timed), 2) if timed else None,  # every step, the first included
        "distinct_seq_lens": len({s.get("seq_len") for s in steps}),
        "new_length_steps": len(new),
        "seconds_lost_to_new_lengths": lost,
    }


def readable_tail(path: Path, count: int) -> list[str]:
    """The last ``count`` lines of a job log, each of Triton's reproducer dumps among them folded to one line that
    keeps the dump's first line (the ptxas error); a dump cut by the start of the window read folds the same way."""
    lines = tail_lines(path, count * 200, block=1 << 20).splitlines()  # dumps run to thousands of lines
    kept: list[str] = []
    opened = 0  # where in `kept` the dump being read began (0: before the window read, if it closes)
    after_close = False
    for index, line in enumerate(lines):
        if after_close:  # the request to share the dump, right after its closing rule
            after_close = False
            continue
        if line.strip() != REPRODUCER_RULE:
            kept.append(line)
        elif REPRODUCER_END in "".join(lines[index + 1 : index + 2]):
            dump, kept = kept[opened:], kept[:opened]
            first = next((x for x in dump if x.strip()), "")
            kept.append(f"[a Triton reproducer dump of {len(dump)} lines, folded; its first line: {first[:200]}]")
            opened, after_close = len(kept), True
        else:
            opened = len(kept)
    return kept[-count:]


def _lines(path: Path) -> list[str]:
    try:
        return [line for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


def targets(variants: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each measured variant against its target (``TARGETS``), with how far off it is."""
    found: dict[str, Any] = {}
    for name, target in TARGETS.items():
        v = variants.get(name)
        if v is None:
            continue
        row: dict[str, Any] = {"state": v.get("state"), "succeeded": v.get("state") == "SUCCEEDED"}
        peak, tps = v.get("peak_allocated_gib"), v.get("tokens_per_s")
        if "peak_max" in target:
            row["peak_allocated_gib"] = {
                "value": peak,
                "limit": target["peak_max"],
                "met": peak is not None and peak <= target["peak_max"],
            }
        if "tokens_per_s_min" in target:
            least = target["tokens_per_s_min"]
            row["tokens_per_s"] = {
                "value": tps,
                "minimum": least,
                "met": tps is not None and tps >= least,
                "shortfall": None if tps is None else round(1 - tps / least, 4),
            }
        if "other_compute_max_s" in target:
            ranks = ((v.get("profile") or {}).get("report") or {}).get("ranks") or [{}]
            other = ranks[0].get("parts_s", {}).get("other_compute")
            row["other_compute_s"] = {
                "value": other,
                "limit": target["other_compute_max_s"],
                "met": other is not None and other <= target["other_compute_max_s"],
            }
        found[name] = row
    for key, (packed, unpacked) in PACKED_ROW_PAIRS.items():
        row = packed_row_target(variants, packed, unpacked)
        if row:
            found[key] = row
    found.update(offload_targets(variants))
    for name in ("spread", "short"):
        packed, unpacked = variants.get(f"{name}-packed"), variants.get(name)
        if packed and unpacked:
            keys = ("supervised_tokens_per_s", "supervised_tokens_per_s_minus_compile")
            found[f"{name}-packed"] = {key: _gain(packed.get(key), unpacked.get(key), PACKING_GAIN_MIN) for key in keys}
    return found


def offload_targets(variants: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The offload issue's pairs measured in this invocation: ``<on>-speed`` (tokens/s on over off, at least
    ``OFFLOAD_SPEED_MIN``) and ``default-path`` (``on`` against ``on-nooffload``: auto chose off, the same speed within
    ``DEFAULT_PATH_SPEED_MIN`` and the same peak within ``DEFAULT_PATH_PEAK_GIB``)."""
    found: dict[str, Any] = {}
    for on, off in OFFLOAD_PAIRS.items():
        a, b = variants.get(on), variants.get(off)
        if a and b:
            found[f"{on}-speed"] = {
                "tokens_per_s": _ratio(a.get("tokens_per_s"), b.get("tokens_per_s"), OFFLOAD_SPEED_MIN),
                "peak_allocated_gib": {"on": a.get("peak_allocated_gib"), "off": b.get("peak_allocated_gib")},
                "states": [a.get("state"), b.get("state")],
            }
    default, off = (variants.get(k) for k in DEFAULT_PATH_PAIR)
    if default and off:
        chosen = ((default.get("proof") or {}).get("checkpoint_all_layers") or {}).get("offload_inputs") or {}
        peaks = default.get("peak_allocated_gib"), off.get("peak_allocated_gib")
        found["default-path"] = {
            "auto_chose": chosen.get("on"),
            "reason": chosen.get("reason"),
            "tokens_per_s": _ratio(default.get("tokens_per_s"), off.get("tokens_per_s"), DEFAULT_PATH_SPEED_MIN),
            "peak_allocated_gib": {
                "value": peaks[0],
                "off": peaks[1],
                "met": None not in peaks and abs(peaks[0] - peaks[1]) <= DEFAULT_PATH_PEAK_GIB,
            },
            "met": chosen.get("on") is False,
        }
    return found


def _ratio(value: float | None, against: float | None, least: float) -> dict[str, Any]:
    ratio = round(value / against, 3) if value and against else None
    return {
        "value": value,
        "against": against,
        "ratio": ratio,
        "minimum": least,
        "met": ratio is not None and ratio >= least,
    }


def round_key(variant: str, round_: int) -> str:
    """A variant's key in ``results["variants"]``: its name in the first round, ``name#R`` in round ``R``."""
    return variant if round_ == 1 else f"{variant}#{round_}"


def measured_steps(variants: dict[str, dict[str, Any]], variant: str, key: str) -> dict[int, list[float]]:
    """``key`` (``step_seconds`` or ``step_periods``) of the steps after the warm-up, over every round of ``variant``
    that succeeded, by the step's position in its run: the data's order is seeded, so position ``i`` is the same
    batch in every round (one row's rounds are one observation of that row, not several)."""
    found: dict[int, list[float]] = {}
    for v in succeeded_rounds(variants, variant):
        for position, value in enumerate((v.get(key) or [])[v.get("warmup_steps", 0) :]):
            if value:  # the last step has no period
                found.setdefault(position, []).append(value)
    return found


def succeeded_rounds(variants: dict[str, dict[str, Any]], variant: str) -> list[dict[str, Any]]:
    """Every round of ``variant`` (``VARIANT``, ``VARIANT#R``) whose run succeeded."""
    return [v for name, v in variants.items() if name.split("#")[0] == variant and v.get("state") == "SUCCEEDED"]


def median_difference(
    a: dict[int, list[float]], b: dict[int, list[float]], draws: int = BOOTSTRAP_DRAWS
) -> dict[str, Any]:
    """Both medians and median(a) - median(b), in seconds, over all their steps, with a 95 % bootstrap interval of
    the difference that resamples step positions, each with all its rounds (``measured_steps``), so that the rows'
    differences in content count once per row. Seeded: a results file gives the same interval again. It speaks of
    the steps of these runs only, not of the machine's drift from one invocation to the next."""
    import random

    rng = random.Random(0)

    def median_of(steps: dict[int, list[float]], positions) -> float:
        return statistics.median(value for position in positions for value in steps[position])

    spread = sorted(
        median_of(a, rng.choices(sorted(a), k=len(a))) - median_of(b, rng.choices(sorted(b), k=len(b)))
        for _ in range(draws)
    )
    return {
        "packed_s": round(median_of(a, a), 4),
        "unpacked_s": round(median_of(b, b), 4),
        "difference_s": round(median_of(a, a) - median_of(b, b), 4),
        "ci95_s": [round(spread[int(0.025 * draws)], 4), round(spread[int(0.975 * draws) - 1], 4)],
        "steps": [sum(map(len, a.values())), sum(map(len, b.values()))],
        "positions": [len(a), len(b)],
    }


def at_equal_supervised(variants: dict[str, dict[str, Any]], packed: str, unpacked: str) -> dict[str, Any] | None:
    """The packed rows' forward+backward against their supervised tokens (``robust_line`` over every measured step of
    every succeeded round), read at the unpacked steps' median supervised tokens, beside the unpacked median: what a
    packed row would cost holding what an unpacked step holds (a row costs what it trains on: the loss alone 18 µs a
    supervised token at the 27B shape, docs/lab/2026-12-07-packed-same-kind.md). None without the steps' supervised
    tokens (results before ``step_supervised``) or without two distinct counts."""

    def pairs(name: str) -> list[tuple[int, float]]:
        found = []
        for v in (v for v in succeeded_rounds(variants, name) if v.get("step_supervised")):
            skip = v.get("warmup_steps", 0)
            found += [
                (n, s) for n, s in zip(v["step_supervised"][skip:], v["step_seconds"][skip:], strict=True) if n and s
            ]
        return found

    rows, steps = pairs(packed), pairs(unpacked)
    if len({n for n, _ in rows}) < 2 or not steps:
        return None
    slope, intercept = robust_line(rows)
    supervised = statistics.median(n for n, _ in steps)
    at = intercept + slope * supervised
    unpacked_s = statistics.median(s for _, s in steps)
    return {
        "slope_us_per_token": round(slope * 1e6, 1),
        "unpacked_supervised": supervised,
        "packed_mean_supervised": round(statistics.mean(n for n, _ in rows)),
        "packed_at_it_s": round(at, 4),
        "unpacked_s": round(unpacked_s, 4),
        "difference_s": round(at - unpacked_s, 4),
        "steps": len(rows),
    }


def packed_row_target(variants: dict[str, dict[str, Any]], packed: str, unpacked: str) -> dict[str, Any] | None:
    """The packed rows of ``packed`` against the unpacked steps of ``unpacked`` (every round pooled): forward+backward
    and the step period (which adds the collation and everything else between two steps). Met when the packed
    median period is no longer than the unpacked one (forward+backward where no period was recorded); ``resolved``
    when its 95 % interval lies on one side of 0. None until both have two measured step positions. Beside it, not
    deciding it, ``at_equal_supervised``: the packed rows read at the unpacked steps' supervised tokens."""
    rows: dict[str, Any] = {}
    for key, label in (("step_seconds", "fwd_bwd"), ("step_periods", "period")):
        a, b = measured_steps(variants, packed, key), measured_steps(variants, unpacked, key)
        if len(a) >= 2 and len(b) >= 2:
            rows[label] = median_difference(a, b)
    if not rows:
        return None
    decides = rows.get("period") or rows["fwd_bwd"]
    low, high = decides["ci95_s"]
    return {
        **rows,
        "against": unpacked,
        "decided_by": "period" if "period" in rows else "fwd_bwd",
        "met": decides["difference_s"] <= 0,
        "resolved": high < 0 or low > 0,
        "at_equal_supervised": at_equal_supervised(variants, packed, unpacked),
    }


def pooled_targets(*paths: str | Path) -> dict[str, Any]:
    """The targets of several results files' variants taken together, each file's rounds numbered on after the
    files before it (``round_key``): the packed-row targets then pool every round of every file. For invocations
    that split their rounds over several calls on one machine; the other targets read a variant's first round, from
    the first file that ran it.
    """
    pooled: dict[str, dict[str, Any]] = {}
    for path in paths:
        variants = json.loads(Path(path).read_text())["variants"]
        before = {name.split("#")[0]: 0 for name in variants}
        for key in pooled:
            name, _, number = key.partition("#")
            if name in before:
                before[name] = max(before[name], int(number or 1))
        for key, run in variants.items():
            name, _, number = key.partition("#")
            pooled[round_key(name, before[name] + int(number or 1))] = run
    return targets(pooled)


def _gain(packed: float | None, unpacked: float | None, least: float) -> dict[str, Any]:
    gain = round(packed / unpacked, 3) if packed and unpacked else None
    return {
        "packed": packed,
        "unpacked": unpacked,
        "gain": gain,
        "minimum": least,
        "met": gain is not None and gain >= least,
    }


def prepare_assets(out: Path, shape: str, samples: int, variants: list[str]) -> None:
    from benchmarks.bench_assets import count_parameters, write_dataset, write_model_dir, write_spread_dataset

    shutil.rmtree(out / "model", ignore_errors=True)
    model = write_model_dir(out / "model", shape)
    for variant in variants:
        folder, _ = data_dir(out, variant, shape)
        if folder.exists():
            continue
        if VARIANTS[variant].get("data") in SPREAD:
            bounds, least = SPREAD[VARIANTS[variant]["data"]]
            write_spread_dataset(folder, model, *bounds[shape], samples=max(samples, least))
        else:
            share = VARIANTS[variant].get("reply_share", 0.5)
            write_dataset(folder, model, cutoff_of(variant, shape), samples=samples, reply_share=share)
    (out / "model_parameters.json").write_text(json.dumps(count_parameters(model), indent=2) + "\n")


def bench_env(out: Path, shape: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment ``launcher`` runs with (the launcher passes it through to every rank): this one's plus the
    measuring settings, the preflight rows a measuring host skips, and ``extra``."""
    env = {
        **os.environ,
        "RECORD_VRAM": "1",
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "LAUNCHER_PREFLIGHT_SKIP": PREFLIGHT_SKIP,
        bench_entry.KERNEL_CASES_ENV: KERNEL_CASES[shape],
        # kept across variants (on-warm reads it); one set by the caller wins, so invocations can share a cache
        "TRITON_CACHE_DIR": os.environ.get("TRITON_CACHE_DIR") or str(out / "triton-cache"),
        **(extra or {}),
    }
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.patch_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for assets, configs, runs and results.json")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per variant (default 6)")
    parser.add_argument(
        "--all-steps",
        type=int,
        default=None,
        metavar="N",
        help="optimizer steps for every variant, overriding a variant's own count (spread: 32); "
        "for example 160 runs the 80 short samples twice, so the second pass meets lengths "
        "seen before",
    )
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians (default 2)")
    parser.add_argument(
        "--variants",
        default="on,off",
        help=f"comma-separated, run in this order (default on,off): {', '.join(VARIANTS)}",
    )
    parser.add_argument("--shape", choices=("27b", "tiny"), default="27b")
    parser.add_argument(
        "--backend", choices=("cuda", "cpu", "npu"), default=None, help="default: cuda for 27b, cpu for tiny"
    )
    parser.add_argument("--samples", type=int, default=8, help="dataset samples (default 8)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per variant before a graceful stop")
    rounds = (
        "run the --variants list this many times in turn (default 1; for example --variants on,spread-packed "
        "--rounds 3 alternates them, so that the card's warming shows in both); round R's results are keyed "
        "VARIANT#R, and the packed-row target pools them"
    )
    parser.add_argument("--rounds", type=int, default=1, help=rounds)
    parser.add_argument(
        "--kernel-check",
        choices=("first", "each", "none"),
        default="first",
        help="which variants' ranks run the kernel-check cases (KERNEL_CASES) before training: "
        "the first (default: every variant routes its kernels as auto, so the first rank's "
        "check covers the rest on this machine), each, or none; on a cold Triton cache the "
        "cases take minutes of the variant's --timeout",
    )
    ns = parser.parse_args(argv)
    backend = ns.backend or ("cuda" if ns.shape == "27b" else "cpu")
    variants = [v.strip() for v in ns.variants.split(",") if v.strip()]
    if not variants:
        parser.error(f"--variants {ns.variants!r} names none; for example --variants on,off")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    if ns.rounds < 1:
        parser.error(f"--rounds is {ns.rounds}; give at least 1")
    if ns.all_steps is not None and ns.all_steps < 1:
        parser.error(f"--all-steps is {ns.all_steps}; give at least 1, or leave it out for each variant's own count")
    steps = {v: steps_of(v, ns.steps, ns.all_steps) for v in variants}
    short = [v for v in variants if VARIANTS[v].get("profile") and steps[v] - ns.warmup < 1]
    if short:
        parser.error(
            f"--warmup {ns.warmup} leaves no step to profile in {', '.join(short)} "
            f"({steps[short[0]]} steps in all); for example --warmup 2"
        )
    out = ns.out.resolve()
    (out / "configs").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    prepare_assets(out, ns.shape, ns.samples, variants)

    env = bench_env(out, ns.shape)
    results: dict[str, Any] = {
        "command": " ".join(["python -m benchmarks.patch_bench", *(argv if argv is not None else sys.argv[1:])]),
        "shape": ns.shape,
        "backend": backend,
        "steps": steps,
        "warmup": ns.warmup,
        "preflight_skipped": PREFLIGHT_SKIP,
        "model_parameters": _read_json(out / "model_parameters.json"),
        "variants": {},
    }
    checked = {"first": range(1), "each": range(len(variants)), "none": range(0)}[ns.kernel_check]
    results["kernel_check_in"] = [variants[i] for i in checked]  # by position: --variants on,on checks the first
    try:
        for round_, position, variant in [(r, p, v) for r in range(1, ns.rounds + 1) for p, v in enumerate(variants)]:
            key = round_key(variant, round_)
            config = run_config(out, variant, ns.shape, backend, steps[variant])
            path = out / "configs" / f"{variant}.yaml"
            path.write_text(yaml.safe_dump(config, sort_keys=False))
            args = launcher_args(variant, path, config["max_steps"], ns.warmup)
            print(f"[patch_bench] {key}: python -m launcher {' '.join(args)}", flush=True)
            skip = VARIANTS[variant].get("preflight_skip")
            run_env = {**env, "LAUNCHER_PREFLIGHT_SKIP": f"{PREFLIGHT_SKIP},{skip}"} if skip else env
            if round_ > 1 or position not in checked:
                run_env = {**run_env, bench_entry.KERNEL_CASES_ENV: "none"}
            forecast = forecast_of(path)
            earlier = set((out / "runs").glob("*"))
            try:
                run = run_variant(args, run_env, ns.timeout, out / "logs" / f"{key}.supervisor.log")
            except RunInterrupted as stop:  # its run has ended: record it, then go no further
                run = stop.run
            profiled = VARIANTS[variant].get("profile")
            run_dir = _newest_run(out / "runs", config["launcher"]["run_name"] + ("-profile" if profiled else ""))
            if run_dir in earlier:  # this run made no directory: an earlier round's is not its result
                run_dir = None
            summary = summarize(run_dir, ns.warmup) if run_dir else {"state": None, "reason": "no run directory"}
            if run_dir and profiled:
                summary["profile"] = profile_summary(run_dir, out)
            if run_dir and (run_dir / "launcher.log").exists():
                shutil.copyfile(run_dir / "launcher.log", out / "logs" / f"{key}.job.log")
            results["variants"][key] = {**run, **summary, "forecast": forecast}
            print(f"[patch_bench] {key}: {_one_line(results['variants'][key])}", flush=True)
            results_schema.write(out / "results.json", results, bench=BENCH)
            if run.get("interrupted"):
                break
    except KeyboardInterrupt:  # between two runs (a config, a forecast, a summary): none of them is alive
        results["interrupted"] = "between runs"
    if ns.shape == "27b":
        results["targets"] = targets(results["variants"])
    results_schema.write(out / "results.json", results, bench=BENCH)
    print(json.dumps({"targets": results.get("targets")}, default=str))
    if results.get("interrupted") or any(v.get("interrupted") for v in results["variants"].values()):
        print(
            f"[patch_bench] interrupted: the variants run so far are in {out / 'results.json'}",
            file=sys.stderr,
            flush=True,
        )
        return 130
    return 0 if all(v.get("state") == "SUCCEEDED" for v in results["variants"].values()) else 1


def forecast_of(config_path: Path) -> dict[str, Any] | str:
    """The launcher's memory forecast of a variant's config against this machine's device (launcher.checks.memory)."""
    from launcher.checks.memory import device_memory_gib, forecast_run
    from launcher.config.run_config import load_run_config

    config = load_run_config(config_path)
    try:
        return forecast_run(config, config.llamafactory, device_memory_gib(config.launcher.backend)).to_dict()
    except ValueError as err:
        return f"not forecast: {err}"


def _one_line(v: dict[str, Any]) -> str:
    return (
        f"state {v.get('state')}, {v.get('steps_recorded')} steps, seq {v.get('seq_lens')}, "
        f"fwd+bwd median {v.get('median_fwd_bwd_s')} s -> {v.get('tokens_per_s')} tok/s, "
        f"period {v.get('median_period_s')} s, peak {v.get('peak_allocated_gib')} GiB, "
        f"first step {v.get('first_step_s')} s, supervised {v.get('supervised_tokens_per_s')} tok/s, "
        f"{v.get('distinct_seq_lens')} lengths (lost {v.get('seconds_lost_to_new_lengths')} s), "
        f"wall {v.get('wall_s')} s"
    )


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `timeout` and `kill` stop the run as Ctrl-C does
    sys.exit(main())
