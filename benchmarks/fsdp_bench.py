"""Benchmark: FSDP2 over several devices against one, the same config through ``launcher run``.

    python -m benchmarks.fsdp_bench --out DIR [--shape 27b|tiny] [--backend cuda|npu|cpu] [--devices 1,2]
                                    [--steps 6] [--warmup 2] [--single fsdp2|ddp] [--options on,full-loss]
                                    [--variants single,fsdp2,fsdp2-budget120]

``--devices 1`` (one count): the one-device comparison of issue 28 instead, ``ONE_DEVICE`` variants in one
invocation: the single-device path (``ddp``, one process), ``fsdp2`` with one process and ``fsdp2-budget120``,
``fsdp2`` with ``checkpoint_all_layers: {memory_budget_gib: 120}`` (``DEFAULT_VARIANTS``; the budget variant only on
cuda and npu, whose allocators report a peak: on the CPU it is left out unless asked for by name); by name only,
``fsdp2-root-embeddings``: ``fsdp2`` with ``fsdp2_frozen_dtype.embedding_units: false``, the embeddings in the root
unit, to measure that option against its default in one invocation; ``fsdp2-lora-shared`` and ``fsdp2-lora-own``:
``fsdp2`` with ``fsdp2_frozen_dtype.trainable_units: shared`` (torch >= 2.8: each layer's LoRA in the layer's unit,
what the default ``auto`` takes there) or ``own`` (a unit per layer's LoRA: what ``auto`` takes before torch 2.8);
``fsdp2-profile``: ``fsdp2`` through ``launcher profile`` (``--steps`` minus ``--warmup`` steps profiled;
``profile.md`` copied to ``DIR``);
``targets`` holds FSDP2's peak against ``PEAK_MAX_GIB`` and its tokens/s against ``SPEED_MIN`` x the
single-device path's.

For each option set (``OPTIONS``: ``on``, the product's defaults with the chunked loss and every layer
checkpointed; ``full-loss``, the same with ``chunked_loss: false``) and each device count, in one invocation:
the config of ``benchmarks.patch_bench``'s ``on`` variant (27B shape, random weights, the seed's LoRA r8,
cutoff 4096, batch 1 per device, bf16 off the CPU) with ``nproc_per_node: N`` and ``distribution: fsdp2``
(decoder layers and vision blocks wrapped, reshard after forward, no offload: the launcher's defaults). The
layer plan (``memory_budget_gib``, ``uncheckpointed_layers``) is measured inside the model's forward, so it runs
under fsdp2 too: the ``fsdp2-budget120`` variant of ``--devices 1``.

The one-device run is FSDP2 with one process too (``--single fsdp2``, the default): the same accelerate path
(float32 upcast of the shards under mixed precision, bf16 casts at all-gather, LLaMA-Factory's non-reentrant
checkpointing under FSDP2), so the ratio measures what the second device adds and nothing else.
``--single ddp`` compares against the product's one-device path instead (torchrun, bf16 weights).

Under FSDP2 every rank builds the model on the meta device and materializes only its own shards
(``benchmarks.fsdp_init``); each rank records the bytes it materialized. The environment given to
``launcher run`` holds ``MULTICAST_OFF`` (NVLink multicast off: the launcher passes the caller's environment
through to the ranks; the product does not set these itself), and every rank records what it saw.

``DIR/results.json`` (the results schema, ``benchmarks/results_schema.py``; the runs are its variants): per run the
ranks' peak allocated memory, bytes materialized and environment,
tokens/s in total (tokens of all ranks per step / median of the slowest rank's forward+backward), the
scaling against one device (target ``SCALING_MIN`` x devices) and the memory bound per device
(weights / N + the one-device run's activation memory + two unsharded decoder layers), met or not.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
from pathlib import Path
from typing import Any

import yaml

from benchmarks import patch_bench, results_schema

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
OPTIONS: dict[str, dict[str, Any]] = {"on": {}, "full-loss": {"chunked_loss": False}}
SCALING_MIN = 0.95  # per device: 2 devices must reach 1.9x one device's tokens/s (issue 18)
GIB = 2**30
# one device (issue 28): FSDP2 with one process against the single-device path, and under a memory budget
ONE_DEVICE: dict[str, tuple[str, dict[str, Any]]] = {
    "single": ("ddp", {}),
    "fsdp2": ("fsdp2", {}),
    "fsdp2-budget120": ("fsdp2", {"checkpoint_all_layers": {"memory_budget_gib": 120}}),
    # the embeddings left in accelerate's root unit (gathered for the whole step): the patch's option against it
    "fsdp2-root-embeddings": ("fsdp2", {"fsdp2_frozen_dtype": {"embedding_units": False}}),
    # each layer's LoRA in the layer's own unit (torch >= 2.8): one gather and one set of hooks fewer per layer
    "fsdp2-lora-shared": ("fsdp2", {"fsdp2_frozen_dtype": {"trainable_units": "shared"}}),
    # a unit per layer's LoRA, as before torch 2.8 (the images' torch 2.7.1)
    "fsdp2-lora-own": ("fsdp2", {"fsdp2_frozen_dtype": {"trainable_units": "own"}}),
    # ``fsdp2`` through ``launcher profile``: where FSDP2's time goes (its copies named by the operators behind them)
    "fsdp2-profile": ("fsdp2", {}),
    # the same budget on the single-device path, for the comparison inside one invocation
    "single-budget120": ("ddp", {"checkpoint_all_layers": {"memory_budget_gib": 120}}),
    # the budget under FSDP2 through ``launcher profile`` (the plan applies from step 2, before the profiled steps)
    "fsdp2-budget120-profile": ("fsdp2", {"checkpoint_all_layers": {"memory_budget_gib": 120}}),
}
PROFILED = ("fsdp2-profile", "fsdp2-budget120-profile")
DEFAULT_VARIANTS = ("single", "fsdp2", "fsdp2-budget120")
# a memory budget needs an allocator that reports its peak: not the CPU's
NEEDS_PEAK = ("fsdp2-budget120", "single-budget120", "fsdp2-budget120-profile")
PEAK_MAX_GIB = 58.0  # FSDP2's peak at 4,096 tokens: the single-device path's 55.14 GiB plus a little
SPEED_MIN = 0.95  # FSDP2's tokens/s against the single-device path's


def run_name(shape: str, devices: int, options: str) -> str:
    return f"fsdp-{shape}-{devices}dev-{options}"


def bench_config(
    out: Path,
    shape: str,
    backend: str,
    steps: int,
    devices: int,
    options: str,
    single: str = "fsdp2",
    variant: str | None = None,
) -> dict[str, Any]:
    """``patch_bench``'s ``on`` config on ``devices`` processes under FSDP2 (one device: ``single``), or one of
    the ``ONE_DEVICE`` variants."""
    config = patch_bench.run_config(out, "on", shape, backend, steps)
    distribution, extra = ONE_DEVICE[variant] if variant else ("fsdp2" if devices > 1 else single, {})
    config["launcher"].update(
        nproc_per_node=devices,
        distribution=distribution,
        run_name=run_name(shape, devices, options) + (f"-{variant}" if variant else ""),
        patches={**OPTIONS[options], **extra},
    )
    return config


def one_device_targets(runs: dict[str, Any]) -> dict[str, Any]:
    """FSDP2 with one process against the single-device path: peak and tokens/s, each met or not."""
    single, fsdp = runs.get("single", {}), runs.get("fsdp2", {})
    peak, one = fsdp.get("peak_allocated_gib_max"), single.get("tokens_per_s_total")
    many = fsdp.get("tokens_per_s_total")
    ratio = round(many / one, 3) if one and many else None
    budget, single_budget = runs.get("fsdp2-budget120", {}), runs.get("single-budget120", {})
    return {
        "succeeded": {label: run.get("state") == "SUCCEEDED" for label, run in runs.items()},
        "fsdp2_peak_gib": peak,
        "peak_max_gib": PEAK_MAX_GIB,
        "peak_met": None if peak is None else peak <= PEAK_MAX_GIB,
        "single_tokens_per_s": one,
        "fsdp2_tokens_per_s": many,
        "speed_ratio": ratio,
        "speed_min": SPEED_MIN,
        "speed_met": None if ratio is None else ratio >= SPEED_MIN,
        "single_peak_gib": single.get("peak_allocated_gib_max"),
        "budget120_peak_gib": budget.get("peak_allocated_gib_max"),
        "budget120_tokens_per_s": budget.get("tokens_per_s_total"),
        "single_budget120_peak_gib": single_budget.get("peak_allocated_gib_max"),
        "single_budget120_tokens_per_s": single_budget.get("tokens_per_s_total"),
    }


def unit_sizes(model_dir: Path) -> dict[str, int]:
    """Parameters of the largest decoder layer, the largest vision block and the root unit (the rest), built on the
    meta device: the sizes of what FSDP2 all-gathers at once."""
    import torch
    from transformers import AutoConfig, Qwen3_5ForConditionalGeneration

    with torch.device("meta"):
        model = Qwen3_5ForConditionalGeneration._from_config(AutoConfig.from_pretrained(model_dir))
    sizes: dict[str, list[int]] = {"Qwen3_5DecoderLayer": [], "Qwen3_5VisionBlock": []}
    for module in model.modules():
        if type(module).__name__ in sizes:
            sizes[type(module).__name__].append(sum(p.numel() for p in module.parameters()))
    total = sum(p.numel() for p in model.parameters())
    return {
        "decoder_layer_max": max(sizes["Qwen3_5DecoderLayer"]),
        "decoder_layers": len(sizes["Qwen3_5DecoderLayer"]),
        "vision_block_max": max(sizes["Qwen3_5VisionBlock"]),
        "vision_blocks": len(sizes["Qwen3_5VisionBlock"]),
        "root_unit": total - sum(sizes["Qwen3_5DecoderLayer"]) - sum(sizes["Qwen3_5VisionBlock"]),
    }


def world_summary(run_dir: Path, warmup: int) -> dict[str, Any]:
    """What every rank of one run measured (``bench/rank<R>.json``), and the tokens/s of the whole job."""
    records = [patch_bench._read_json(p) for p in sorted((run_dir / "bench").glob("rank*.json"))]
    ranks = []
    for record in records:
        steps = record.get("steps", [])
        peaks = [s["peak_allocated_gib"] for s in steps if s.get("peak_allocated_gib") is not None]
        ranks.append(
            {
                "rank": (record.get("environment") or {}).get("RANK"),
                "steps": len(steps),
                "peak_allocated_gib": max(peaks) if peaks else None,
                "model_build": record.get("model_build"),
                "environment": record.get("environment"),
            }
        )
    result: dict[str, Any] = {"ranks": ranks, "world_size": len(records)}
    count = min((len(r.get("steps", [])) for r in records), default=0)
    if count:
        slowest = [max(r["steps"][i]["seconds"] for r in records) for i in range(count)]
        tokens = [sum(r["steps"][i].get("tokens") or 0 for r in records) for i in range(count)]
        median_s = statistics.median(slowest[warmup:] or slowest)
        peaks = [r["peak_allocated_gib"] for r in ranks if r["peak_allocated_gib"] is not None]
        result.update(
            steps_all_ranks=count,
            tokens_per_step_total=tokens[-1],
            median_slowest_fwd_bwd_s=median_s,
            tokens_per_s_total=round(tokens[-1] / median_s, 1) if median_s else None,
            peak_allocated_gib_max=max(peaks) if peaks else None,
        )
    return result


def memory_bound(
    counts: dict[str, int],
    units: dict[str, int],
    single: dict[str, Any],
    multi: dict[str, Any],
    devices: int,
    param_bytes: int,
) -> dict[str, Any]:
    """Per-device peak of the ``devices`` run against weights / N + one-device activations + two unsharded layers.

    Weights: the parameter count x ``param_bytes`` (the model's dtype). One-device activations: that run's peak
    minus the weights it held (the bytes its rank materialized; under DDP the parameter bytes). Unsharded layer:
    the largest decoder layer's parameters x ``param_bytes`` (FSDP2 all-gathers them in the compute dtype).
    """
    weights = counts["total"] * param_bytes / GIB
    layer = units["decoder_layer_max"] * param_bytes / GIB
    single_rank = (single.get("ranks") or [{}])[0]
    held = (single_rank.get("model_build") or {}).get("bytes_materialized")
    held_gib = held / GIB if held else weights
    single_peak, peak = single.get("peak_allocated_gib_max"), multi.get("peak_allocated_gib_max")
    activation = None if single_peak is None else single_peak - held_gib
    bound = None if activation is None else weights / devices + activation + 2 * layer
    multi_held = [(r.get("model_build") or {}).get("bytes_materialized") for r in multi.get("ranks", [])]
    return {
        "weights_gib": round(weights, 3),
        "weights_per_device_gib": round(weights / devices, 3),
        "one_device_peak_gib": single_peak,
        "one_device_weights_held_gib": round(held_gib, 3),
        "one_device_activation_gib": None if activation is None else round(activation, 3),
        "unsharded_layer_gib": round(layer, 3),
        "bound_gib": None if bound is None else round(bound, 3),
        "arithmetic": None
        if bound is None
        else f"{weights:.2f} / {devices} + ({single_peak:.2f} - {held_gib:.2f}) + 2 x {layer:.3f} = {bound:.2f} GiB",
        "weights_held_per_rank_gib": [None if b is None else round(b / GIB, 3) for b in multi_held],
        "peak_per_device_gib": peak,
        "met": None if bound is None or peak is None else peak <= bound,
    }


def scaling(single: dict[str, Any], multi: dict[str, Any], devices: int) -> dict[str, Any]:
    one, many = single.get("tokens_per_s_total"), multi.get("tokens_per_s_total")
    ratio = round(many / one, 3) if one and many else None
    least = round(SCALING_MIN * devices, 3)
    return {
        "one_device_tokens_per_s": one,
        "tokens_per_s_total": many,
        "ratio": ratio,
        "minimum": least,
        "met": ratio is not None and ratio >= least,
    }


def compare(results: dict[str, Any], devices: list[int], options: list[str], param_bytes: int) -> dict[str, Any]:
    """For each option set and each device count above the first: scaling and the memory bound."""
    base, found = devices[0], {}
    for option in options:
        runs = results["runs"].get(option, {})
        single = runs.get(str(base), {})
        for n in devices[1:]:
            multi = runs.get(str(n), {})
            found[f"{option}:{n}dev"] = {
                "succeeded": all(r.get("state") == "SUCCEEDED" for r in (single, multi)),
                "scaling": scaling(single, multi, n // base),
                "memory": memory_bound(
                    results["model_parameters"], results["units"], single, multi, n // base, param_bytes
                ),
            }
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fsdp_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for assets, configs, runs and results.json")
    parser.add_argument("--shape", choices=("27b", "tiny"), default="27b")
    parser.add_argument(
        "--backend", choices=("cuda", "npu", "cpu"), default=None, help="default: cuda for 27b, cpu for tiny"
    )
    parser.add_argument("--devices", default="1,2", help="device counts, the first is the baseline (default 1,2)")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run (default 6)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians (default 2)")
    parser.add_argument(
        "--single",
        choices=("fsdp2", "ddp"),
        default="fsdp2",
        help="distribution of the one-device run (default fsdp2: the same path)",
    )
    parser.add_argument("--options", default="on", help=f"comma-separated option sets: {', '.join(OPTIONS)}")
    parser.add_argument(
        "--variants",
        default=None,
        help=f"with --devices 1: comma-separated, of {', '.join(ONE_DEVICE)} (default: {','.join(DEFAULT_VARIANTS)})",
    )
    parser.add_argument("--samples", type=int, default=8, help="dataset samples (default 8)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run before a graceful stop")
    ns = parser.parse_args(argv)
    backend = ns.backend or ("cuda" if ns.shape == "27b" else "cpu")
    devices = [int(n) for n in ns.devices.split(",") if n.strip()]
    options = [o.strip() for o in ns.options.split(",") if o.strip()]
    if sorted(set(options) - set(OPTIONS)):
        parser.error(f"unknown option set(s) in {ns.options!r}; choose from {', '.join(OPTIONS)}")
    if not devices or devices != sorted(set(devices)) or devices[0] < 1 or (len(devices) == 1 and devices[0] != 1):
        parser.error(
            f"--devices {ns.devices}: give 1 (the one-device comparison) or increasing counts, the baseline "
            "first (e.g. 1,2)"
        )
    default_variants = [v for v in ONE_DEVICE if v in DEFAULT_VARIANTS and not (backend == "cpu" and v in NEEDS_PEAK)]
    variants = [v.strip() for v in ns.variants.split(",") if v.strip()] if ns.variants else default_variants
    if any(v in PROFILED for v in variants) and ns.steps - ns.warmup < 1:
        parser.error(f"--steps {ns.steps} --warmup {ns.warmup}: a profiled variant needs a step after the warm-up")
    if sorted(set(variants) - set(ONE_DEVICE)) or (ns.variants and len(devices) > 1):
        parser.error(f"--variants {ns.variants}: only with --devices 1, of {', '.join(ONE_DEVICE)}")
    if backend == "cpu" and (budgeted := [v for v in variants if v in NEEDS_PEAK]):
        parser.error(
            f"--variants {','.join(budgeted)}: a memory budget needs an allocator that reports its peak, "
            "which the CPU has not; run them with --backend cuda or npu"
        )
    out = ns.out.resolve()
    (out / "configs").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    patch_bench.prepare_assets(out, ns.shape, ns.samples, ["on"])
    extra = {**MULTICAST_OFF, "BENCH_RECORD_ENV": ",".join(MULTICAST_OFF)}
    env = patch_bench.bench_env(out, ns.shape, extra)
    results: dict[str, Any] = {
        "command": " ".join(["python -m benchmarks.fsdp_bench", *(argv if argv is not None else sys.argv[1:])]),
        "shape": ns.shape,
        "backend": backend,
        "devices": devices,
        "single": ns.single,
        "steps": ns.steps,
        "warmup": ns.warmup,
        "environment_passed": extra,
        "preflight_skipped": patch_bench.PREFLIGHT_SKIP,
        "model_parameters": patch_bench._read_json(out / "model_parameters.json"),
        "units": unit_sizes(out / "model"),
        "runs": {},
    }
    plan = [(n, None) for n in devices] if len(devices) > 1 else [(1, v) for v in variants]
    for option in options:
        for n, variant in plan:
            label = variant or str(n)
            config = bench_config(out, ns.shape, backend, ns.steps, n, option, ns.single, variant)
            path = out / "configs" / f"{option}-{label}.yaml"
            path.write_text(yaml.safe_dump(config, sort_keys=False))
            profiled = variant in PROFILED
            args = patch_bench.launcher_args(label, path, ns.steps, ns.warmup, profiled=profiled)
            print(f"[fsdp_bench] {option}, {label}: python -m launcher {' '.join(args)}", flush=True)
            try:
                run = patch_bench.run_variant(args, env, ns.timeout, out / "logs" / f"{option}-{label}.supervisor.log")
            except patch_bench.RunInterrupted as stop:  # its run has ended: record it, then go no further
                run = stop.run
            run_dir = patch_bench._newest_run(out / "runs", config["launcher"]["run_name"] + ("-profile" * profiled))
            summary = {"state": None, "reason": "no run directory"}
            if run_dir:
                summary = {**patch_bench.summarize(run_dir, ns.warmup), **world_summary(run_dir, ns.warmup)}
                if profiled:
                    summary["profile"] = patch_bench.profile_summary(run_dir, out)
            results["runs"].setdefault(option, {})[label] = {
                **run,
                "distribution": config["launcher"]["distribution"],
                **summary,
            }
            print(f"[fsdp_bench] {option}, {label}: {_one_line(results['runs'][option][label])}", flush=True)
            results_schema.write(out / "results.json", results, bench="benchmarks.fsdp_bench", variants_key="runs")
            if run.get("interrupted"):
                print(f"[fsdp_bench] interrupted: the runs so far are in {out / 'results.json'}", file=sys.stderr)
                return 130
    if len(devices) > 1:
        results["targets"] = compare(results, devices, options, param_bytes=4 if backend == "cpu" else 2)
    else:
        results["targets"] = {option: one_device_targets(results["runs"].get(option, {})) for option in options}
    results_schema.write(out / "results.json", results, bench="benchmarks.fsdp_bench", variants_key="runs")
    print(json.dumps({"targets": results["targets"]}, indent=2, default=str))
    return 0 if all(r.get("state") == "SUCCEEDED" for runs in results["runs"].values() for r in runs.values()) else 1


def _one_line(r: dict[str, Any]) -> str:
    return (
        f"state {r.get('state')}, {r.get('world_size')} rank(s), {r.get('steps_all_ranks')} steps, "
        f"{r.get('tokens_per_s_total')} tok/s in total, peak {r.get('peak_allocated_gib_max')} GiB per device, "
        f"wall {r.get('wall_s')} s"
    )


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `timeout` and `kill` stop the run as Ctrl-C does
    sys.exit(main())
