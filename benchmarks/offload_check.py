"""The offloader (``patches/planning/offload.py``) alone on a device: the same gradients to the bit, the memory it
saves, the time it costs. A minute's check before the launcher runs (``benchmarks.patch_bench``'s offload variants).

    python -m benchmarks.offload_check --out DIR [--tokens 16384] [--layers 16] [--hidden 5120] [--repeats 3]

A stack of ``--layers`` blocks (RMS-like norm, a 4 x hidden MLP with SiLU, a residual; bf16), each checkpointed
non-reentrantly as the patch checkpoints a decoder layer, runs forward and backward on ``--tokens`` tokens three
ways in turn, ``--repeats`` times: without offload, and with it (``OffloadedCheckpoint``, pinned host chunks, the
side stream, the prefetch). Written to ``DIR/results.json`` (the results schema): per way the median step seconds and
the peak allocated memory above the weights; the targets: the gradients equal to the bit, the peak lower by at
least the inputs offloaded less two in flight, and the step at least 90 % as fast. On CPU it runs too (the copies
without pinning or streams), for the plumbing only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import results_schema

GIB = 1024**3


def _blocks(layers: int, hidden: int, device, dtype):
    import torch

    torch.manual_seed(0)
    return [
        torch.nn.Sequential(
            torch.nn.LayerNorm(hidden, elementwise_affine=False),
            torch.nn.Linear(hidden, 4 * hidden, bias=False),
            torch.nn.SiLU(),
            torch.nn.Linear(4 * hidden, hidden, bias=False),
        ).to(device=device, dtype=dtype)
        for _ in range(layers)
    ]


def _step(blocks, x, func, sync) -> tuple[float, list]:
    for block in blocks:
        block.zero_grad(set_to_none=True)
    started = time.perf_counter()
    hidden = x * 1.0
    for block in blocks:
        hidden = hidden + func(block, hidden)
    hidden.float().square().mean().backward()
    sync()
    seconds = time.perf_counter() - started
    return seconds, [b[1].weight.grad for b in blocks] + [x.grad]


def main(argv: list[str] | None = None) -> int:
    import torch
    from torch.utils.checkpoint import checkpoint

    from patches.planning.offload import OffloadedCheckpoint, Offloader

    parser = argparse.ArgumentParser(prog="python -m benchmarks.offload_check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--repeats", type=int, default=3)
    ns = parser.parse_args(argv)
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    device = accelerator or torch.device("cpu")
    dtype = torch.bfloat16 if accelerator is not None else torch.float32
    memory = getattr(torch, device.type, None) if accelerator is not None else None

    def sync() -> None:
        if accelerator is not None:
            torch.accelerator.synchronize()

    blocks = _blocks(ns.layers, ns.hidden, device, dtype)
    for block in blocks:
        block.requires_grad_(True)
    generator = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(ns.tokens, ns.hidden, device=device, dtype=dtype, generator=generator).requires_grad_(True)

    def plain(fn, *args):
        return checkpoint(fn, *args, use_reentrant=False)

    offloader = Offloader(device.type, min_bytes=0 if accelerator is None else 1024**2)
    ways = {"off": plain, "offload": OffloadedCheckpoint(plain, offloader)}
    found: dict[str, dict[str, Any]] = {name: {"seconds": [], "peak_above_start_gib": None} for name in ways}
    grads: dict[str, list] = {}
    for _ in range(ns.repeats):
        for name, func in ways.items():
            x.grad = None
            sync()
            if memory is not None:
                memory.reset_peak_memory_stats()
                start = memory.memory_allocated()
            seconds, step_grads = _step(blocks, x, func, sync)
            found[name]["seconds"].append(round(seconds, 4))
            if memory is not None:
                found[name]["peak_above_start_gib"] = round((memory.max_memory_allocated() - start) / GIB, 3)
            grads[name] = [g.clone() for g in step_grads]
    for name in ways:
        found[name]["median_s"] = statistics.median(found[name]["seconds"][1:] or found[name]["seconds"])
    one_input = ns.tokens * ns.hidden * torch.tensor([], dtype=dtype).element_size() / GIB
    equal = all(torch.equal(a, b) for a, b in zip(grads["off"], grads["offload"], strict=True))
    speed = found["off"]["median_s"] / found["offload"]["median_s"]
    targets: dict[str, Any] = {
        "gradients_equal": {"met": equal},
        "speed": {"ratio": round(speed, 3), "minimum": 0.9, "met": speed >= 0.9},
    }
    if memory is not None:
        saved = found["off"]["peak_above_start_gib"] - found["offload"]["peak_above_start_gib"]
        least = (ns.layers - 2) * one_input
        targets["memory_saved_gib"] = {"value": round(saved, 3), "minimum": round(least, 3), "met": saved >= least}
    record = {
        "command": " ".join(["python -m benchmarks.offload_check", *(argv if argv is not None else sys.argv[1:])]),
        "tokens": ns.tokens,
        "layers": ns.layers,
        "hidden": ns.hidden,
        "one_input_gib": round(one_input, 4),
        "offloader_stats": dict(offloader.stats),
        "variants": found,
        "targets": targets,
    }
    ns.out.mkdir(parents=True, exist_ok=True)
    results_schema.write(ns.out / "results.json", record, bench="benchmarks.offload_check")
    print(targets)
    return 0 if all(t["met"] for t in targets.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
