"""Benchmark: the patches on and off through the real launcher path.

    python -m benchmarks.patch_bench --out DIR [--steps 6] [--variants on,off] [--shape 27b|tiny]
                                     [--backend cuda|cpu]

1. ``DIR/model``: a config-only folder of the Qwen3.5-27B shape (``--shape 27b``; ``tiny`` for a CPU run of
   the plumbing) with the demo tokenizer and a matching processor (``benchmarks.bench_assets``); the rank
   entry builds the model from it with random weights on the device.
2. ``DIR/data``: samples longer than ``cutoff_len`` on both sides, so every step sees exactly 4096 tokens
   (256 for ``tiny``).
3. ``DIR/configs/<variant>.yaml``: the seed's LoRA settings (r8 on q/k/v/o, batch 1, bf16 on CUDA, gradient
   checkpointing on) for ``--steps`` steps, ``launcher.entry: benchmarks.bench_entry``; variant ``on`` runs
   the default patches, ``off`` turns both off (LLaMA-Factory 0.9.5's own behaviour).
4. ``python -m launcher run CONFIG --quiet`` for each variant, with ``RECORD_VRAM=1`` (LLaMA-Factory logs
   ``vram_allocated``) and ``LAUNCHER_PREFLIGHT_SKIP=packages,kernel,model``: the lent GPU machine is not the
   CUDA image (packages), its Triton trips FLA's Hopper guard in the preflight child process, where the guard
   is not lifted (kernel; the rank entry runs the kernel check instead), and the folder has no weights (model).
5. ``DIR/results.json``: per variant the run's end state, step times (median after ``--warmup`` steps),
   tokens/s = tokens per step / median forward+backward time, the step period and LLaMA-Factory's own
   throughput, peak allocated memory, which kernel ran (proof records), how layers were checkpointed in the
   first step, and the kernel check of the rank process; then the targets (docs/benchmarks.md) are compared.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
TARGET_PEAK_GIB = 70.0
TARGET_TOKENS_PER_S, TARGET_TOLERANCE = 2750.0, 0.10
VARIANT_PATCHES = {
    "on": {"deltanet_routing": {"kernel": "auto"}, "checkpoint_all_layers": True},
    "off": {"deltanet_routing": False, "checkpoint_all_layers": False},
}
CUTOFF = {"27b": 4096, "tiny": 256}
KERNEL_CASES = {"27b": "full:qwen3_5_27b", "tiny": "quick:layout"}
PREFLIGHT_SKIP = "packages,kernel,model"
CENSUS_KEYS = ("layers", "gradient_checkpointing_true", "functions", "observed", "by_layer_type")
CASE_KEYS = ("name", "shape", "key_heads", "status", "errors", "finite", "peak_memory_gib", "timing_ms", "note")


def run_config(out: Path, variant: str, shape: str, backend: str, steps: int) -> dict[str, Any]:
    """The run config of one variant: LLaMA-Factory keys plus the launcher section."""
    config: dict[str, Any] = {
        "launcher": {
            "backend": backend,
            "nproc_per_node": 1,
            "distribution": "ddp",
            "run_name": f"bench-{shape}-{variant}",
            "output_root": str(out / "runs"),
            "smoke": shape != "27b",
            "entry": "benchmarks.bench_entry",
            "stop_grace_s": 20,
            "patches": VARIANT_PATCHES[variant],
        },
        "model_name_or_path": str(out / "model"),
        "dataset_dir": str(out / "data"),
        "dataset": "bench_long",
        "template": "qwen3_vl_nothink",
        "cutoff_len": CUTOFF[shape],
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
    return config


def run_variant(config_path: Path, env: dict[str, str], timeout_s: float, log: Path) -> dict[str, Any]:
    """``launcher run CONFIG --quiet`` in a child process; SIGTERM (a graceful stop) when it overruns."""
    cmd = [sys.executable, "-m", "launcher", "run", str(config_path), "--quiet"]
    started = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)  # the supervisor stops the job's whole process tree
            try:
                code = proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
    wall = time.monotonic() - started
    return {"command": " ".join(["python", *cmd[1:]]), "exit_code": code, "wall_s": round(wall, 1),
            "timed_out": wall >= timeout_s}  # fmt: skip


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _newest_run(root: Path, name: str) -> Path | None:
    runs = sorted((p for p in root.glob(f"{name}-*") if (p / "status.json").exists()), key=lambda p: p.stat().st_mtime)
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
            **{k: first.get(k) for k in CENSUS_KEYS},
        },
    }


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
            median_fwd_bwd_s=round(median_s, 4),
            tokens_per_s=round(tokens / median_s, 1) if median_s else None,
            median_period_s=round(statistics.median(periods), 4) if periods else None,
            tokens_per_s_by_period=round(tokens / statistics.median(periods), 1) if periods else None,
            peak_allocated_gib=max(s["peak_allocated_gib"] or 0 for s in steps),
            allocated_at_first_step_gib=steps[0].get("allocated_at_start_gib"),
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
        result["kernel_check"] = {k: check.get(k) for k in ("ok", "kernel", "error")} | {"cases": cases}
    result["proof"] = _proof_summary(run_dir)
    return result


def _lines(path: Path) -> list[str]:
    try:
        return [line for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


def targets(variant: dict[str, Any]) -> dict[str, Any]:
    """The targets for the patched run on one H200 (docs/benchmarks.md)."""
    peak, tps = variant.get("peak_allocated_gib"), variant.get("tokens_per_s")
    return {
        "peak_allocated_gib": {"value": peak, "limit": TARGET_PEAK_GIB,
                               "met": peak is not None and peak <= TARGET_PEAK_GIB},
        "tokens_per_s": {"value": tps, "reference": TARGET_TOKENS_PER_S, "tolerance": TARGET_TOLERANCE,
                         "deviation": None if tps is None else round(tps / TARGET_TOKENS_PER_S - 1, 4),
                         "met": tps is not None and abs(tps / TARGET_TOKENS_PER_S - 1) <= TARGET_TOLERANCE},
    }  # fmt: skip


def prepare_assets(out: Path, shape: str, samples: int) -> None:
    from benchmarks.bench_assets import count_parameters, write_dataset, write_model_dir

    for sub in ("model", "data"):
        shutil.rmtree(out / sub, ignore_errors=True)
    model = write_model_dir(out / "model", shape)
    write_dataset(out / "data", model, CUTOFF[shape], samples=samples)
    (out / "model_parameters.json").write_text(json.dumps(count_parameters(model), indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.patch_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for assets, configs, runs and results.json")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per variant (default 6)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians (default 2)")
    parser.add_argument("--variants", default="on,off", help="comma-separated: on, off (default on,off)")
    parser.add_argument("--shape", choices=("27b", "tiny"), default="27b")
    parser.add_argument("--backend", choices=("cuda", "cpu", "npu"), default=None,
                        help="default: cuda for 27b, cpu for tiny")  # fmt: skip
    parser.add_argument("--samples", type=int, default=8, help="dataset samples (default 8)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per variant before a graceful stop")
    ns = parser.parse_args(argv)
    backend = ns.backend or ("cuda" if ns.shape == "27b" else "cpu")
    variants = [v.strip() for v in ns.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANT_PATCHES))
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANT_PATCHES)}")
    out = ns.out.resolve()
    (out / "configs").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    prepare_assets(out, ns.shape, ns.samples)

    env = {**os.environ, "RECORD_VRAM": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "LAUNCHER_PREFLIGHT_SKIP": PREFLIGHT_SKIP, "BENCH_KERNEL_CASES": KERNEL_CASES[ns.shape]}  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    results: dict[str, Any] = {
        "command": " ".join(["python -m benchmarks.patch_bench", *(argv if argv is not None else sys.argv[1:])]),
        "shape": ns.shape, "backend": backend, "steps": ns.steps, "warmup": ns.warmup,
        "preflight_skipped": PREFLIGHT_SKIP, "model_parameters": _read_json(out / "model_parameters.json"),
        "variants": {},
    }  # fmt: skip
    for variant in variants:
        config = run_config(out, variant, ns.shape, backend, ns.steps)
        path = out / "configs" / f"{variant}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        print(f"[patch_bench] {variant}: python -m launcher run {path} --quiet", flush=True)
        run = run_variant(path, env, ns.timeout, out / "logs" / f"{variant}.supervisor.log")
        run_dir = _newest_run(out / "runs", config["launcher"]["run_name"])
        summary = summarize(run_dir, ns.warmup) if run_dir else {"state": None, "reason": "no run directory"}
        if run_dir and (run_dir / "launcher.log").exists():
            shutil.copyfile(run_dir / "launcher.log", out / "logs" / f"{variant}.job.log")
        results["variants"][variant] = {**run, **summary}
        print(f"[patch_bench] {variant}: {_one_line(results['variants'][variant])}", flush=True)
        (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    if "on" in results["variants"] and ns.shape == "27b":
        results["targets"] = targets(results["variants"]["on"])
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(json.dumps({"targets": results.get("targets")}, default=str))
    return 0 if all(v.get("state") == "SUCCEEDED" for v in results["variants"].values()) else 1


def _one_line(v: dict[str, Any]) -> str:
    return (f"state {v.get('state')}, {v.get('steps_recorded')} steps, seq {v.get('seq_lens')}, "
            f"fwd+bwd median {v.get('median_fwd_bwd_s')} s -> {v.get('tokens_per_s')} tok/s, "
            f"period {v.get('median_period_s')} s, peak {v.get('peak_allocated_gib')} GiB, "
            f"wall {v.get('wall_s')} s")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
