"""Greedy decoding speed of the routed DeltaNet kernels against the torch fallback, on one device.

    python -m benchmarks.lab.decode_bench --out DIR [--shape 27b|tiny] [--backend cuda|cpu] [--new-tokens N]
                                      [--prompt-tokens P] [--repeats R] [--batch-sizes 1,8,32]
                                      [--routes routed,torch] [--compare K] [--compare-tokens N]

What ``launcher evaluate`` does per batch of answers, measured: ``B`` prompts of ``P`` random token ids each
(prefill: the chunk kernel), then ``N`` new tokens per row by greedy ``generate`` (each one a recurrent-kernel step
per DeltaNet layer for all ``B`` rows, with the KV/state cache), for each batch size ``B`` of ``--batch-sizes``
(default 1). The model is ``Qwen3_5ForConditionalGeneration`` built from the config of
``benchmarks.bench_assets`` (the 27B shape, or the tiny demo shape) with random weights directly on the device,
in bf16 for 27B (float32 for tiny); no weights are read or written.

Two routes, on the same model and inputs:

- ``routed``: ``patches.deltanet_routing`` with ``kernel: auto`` (FLA's chunk and ``fused_recurrent`` kernels on
  CUDA, FLA's fused gated norm and the upstream conv choice), applied before the model is built, as a run does;
- ``torch``: the same patch with ``kernel: torch``, after which every DeltaNet layer is rebound to what a model
  built under that route binds (transformers' torch chunk and recurrent kernels, the torch conv fallback, the
  torch gated norm with the same weight), so the one model serves both routes.

Per route: one warm-up generation (Triton compiles and autotunes there, untimed), then ``R`` timed ``N``-token
generations (``min_new_tokens=N``, so a random model's early EOS does not shorten it). Inside each, a logits
processor reads the clock (device synchronised) each time a step's logits are ready: the first reading ends the
prefill, the last one the ``N - 1`` decode steps; decode tokens/s = B x (N - 1) / (last - first), the median over
the repeats (all rows' tokens: what a batch of answers gets per second). One generation gives both times, so a
loaded machine cannot make the decode time negative, as a difference of two separate generations could.
Which kernels ran comes from the routing patch's own proof records (``first_call``, ``first_decode_call``).
``--compare K``: ``K`` prompts of different lengths answered in one left-padded batch and one at a time by
``launcher evaluate``'s own decoding, on the routed model, and the count of answers that agree token for token
(``routes.routed.compare``); where one differs, the one-at-a-time logits after the shared tokens say whether it
was a near tie (top-2 margin in bf16 steps of the top logit, the rank of the batch's token there). Results go to
``DIR/decode.json``. On CUDA this process lifts FLA's Hopper guard (``benchmarks.fla_guard``; measurement only:
the forward kernels used here never reach the guarded backward, but the routing probe reads the flag).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROUTES = ("routed", "torch")


def build_model(torch, model_dir: Path, device: str, dtype):
    from transformers import AutoConfig, Qwen3_5ForConditionalGeneration

    config = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3_5ForConditionalGeneration._from_config(config, dtype=dtype)
    return model.eval()


def apply_route(route: str, backend: str, proof_dir: Path) -> dict[str, Any]:
    """Install the routing patch for ``route`` (only that patch; nothing of LLaMA-Factory is needed here)."""
    from patches import deltanet_routing
    from patches.core.proof import ProofFile

    options = deltanet_routing.Options(kernel="auto" if route == "routed" else "torch").model_dump()
    proof = ProofFile(proof_dir, deltanet_routing.NAME, 0)
    proof.start({"patch": deltanet_routing.NAME, "route_name": route, "backend": backend})
    deltanet_routing.check_symbols()
    found = deltanet_routing.apply(options, backend=backend, proof=proof, facts={})
    proof.update(status="applied", **found)
    return found


def rebind_layers(torch, model) -> int:
    """Bind every DeltaNet layer to what the module globals give now (as the constructor would)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    layers = [x for x in model.modules() if isinstance(x, m.Qwen3_5GatedDeltaNet)]
    for layer in layers:
        layer.chunk_gated_delta_rule = m.chunk_gated_delta_rule or m.torch_chunk_gated_delta_rule
        layer.recurrent_gated_delta_rule = m.fused_recurrent_gated_delta_rule or m.torch_recurrent_gated_delta_rule
        layer.causal_conv1d_fn = m.causal_conv1d_fn
        layer.causal_conv1d_update = m.causal_conv1d_update or m.torch_causal_conv1d_update
        if m.FusedRMSNormGated is None and not isinstance(layer.norm, m.Qwen3_5RMSNormGated):
            weight = layer.norm.weight
            norm = m.Qwen3_5RMSNormGated(layer.head_v_dim, eps=layer.layer_norm_epsilon)
            layer.norm = norm.to(device=weight.device, dtype=weight.dtype)
            with torch.no_grad():
                layer.norm.weight.copy_(weight)
    return len(layers)


def measure(torch, model, dev, prompt, new_tokens: int, repeats: int) -> dict[str, Any]:
    """Timings of ``prompt`` (``[B, P]``, every row its own answer) and decode tokens/s over all ``B`` rows."""
    from transformers import LogitsProcessorList

    def generate(n: int) -> list[float]:
        """Seconds from the call to each step's logits."""
        readings: list[float] = []

        def clock(_input_ids, scores):
            dev.sync()
            readings.append(time.perf_counter())
            return scores

        dev.sync()
        started = time.perf_counter()
        with torch.no_grad():
            model.generate(
                input_ids=prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
                logits_processor=LogitsProcessorList([clock]),
            )
        dev.sync()
        return [t - started for t in readings] + [time.perf_counter() - started]

    warm = generate(min(4, new_tokens))[-1]
    runs = [generate(new_tokens) for _ in range(repeats)]
    decode_s = statistics.median(r[-2] - r[0] for r in runs)  # first logits (prefill) to the last step's
    rows = int(prompt.shape[0])
    return {
        "batch": rows,
        "warmup_s": round(warm, 3),
        "prefill_s": round(statistics.median(r[0] for r in runs), 4),
        "generate_s": round(statistics.median(r[-1] for r in runs), 4),
        "decode_tokens_per_s": round(rows * (new_tokens - 1) / decode_s, 2),
        "end_to_end_tokens_per_s": round(rows * new_tokens / statistics.median(r[-1] for r in runs), 2),
        "repeats": repeats,
    }


def compare_batched(torch, model, dev, rows: int, prompt_tokens: int, new_tokens: int) -> dict[str, Any]:
    """Greedy answers to ``rows`` prompts of different lengths (``prompt_tokens / 2`` to ``prompt_tokens``), all in
    one left-padded batch and one at a time, through ``launcher evaluate``'s own decoding
    (``launcher.rank.evaluate_decode.greedy_batched``): how many answers are the same token for token, and where
    each other one first differs."""
    from launcher.rank.evaluate_decode import greedy_batched

    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(max(1, prompt_tokens // 2), prompt_tokens + 1, (rows,), generator=gen).tolist()
    prompts = [torch.randint(10, 500, (n,), generator=gen).tolist() for n in lengths]
    eos = model.generation_config.eos_token_id
    stop = list(eos) if isinstance(eos, (list, tuple)) else [0 if eos is None else int(eos)]
    common = {"max_new_tokens": new_tokens, "stop": stop, "pad_id": 0, "device": dev.name}
    batched = greedy_batched(torch, model, prompts, batch_size=rows, **common)
    single = greedy_batched(torch, model, prompts, batch_size=1, **common)
    differ = [
        next(
            (i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b),
            None if len(x) == len(y) else min(len(x), len(y)),
        )
        for x, y in zip(batched, single, strict=True)
    ]
    margins = [
        None
        if at is None or at >= min(len(b), len(o))
        else difference_margin(torch, model, dev, prompt + o[:at], b[at], o[at])
        for prompt, b, o, at in zip(prompts, batched, single, differ, strict=True)
    ]
    return {
        "rows": rows,
        "new_tokens": new_tokens,
        "prompt_lengths": lengths,
        "stop": stop,
        "exact_matches": sum(d is None for d in differ),
        "first_difference_at": differ,
        "answer_lengths": [len(x) for x in batched],
        "first_difference_margins": margins,
        "differences_at_a_near_tie": sum(bool(m and m["near_tie"]) for m in margins),
        "near_tie_steps": NEAR_TIE_STEPS,
    }


NEAR_TIE_STEPS = 4  # a first difference at a top-2 margin of at most this many bf16 steps of the top logit


def bf16_step(value: float) -> float:
    """The spacing of bfloat16 numbers at ``value`` (8 significant bits): what one rounding can move a logit."""
    import math

    return 2.0 ** (math.floor(math.log2(max(abs(value), 2.0**-126))) - 7)


def difference_margin(torch, model, dev, context: list[int], batched: int, single: int) -> dict[str, Any]:
    """Where a batched answer first leaves the one-at-a-time answer: the logits one at a time gives after the
    shared ``context`` (its top two, their margin in bf16 steps of the top logit, the rank there of the token the
    batch chose). A margin of a few steps is a tie that rounding in a differently shaped batch can flip."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([context], device=dev.name), logits_to_keep=1).logits[0, -1].float()
    top = torch.topk(logits, 2)
    first, second = (float(v) for v in top.values)
    margin = first - second
    step = bf16_step(first)
    return {
        "at_context_tokens": len(context),
        "single_token": single,
        "batched_token": batched,
        "top_tokens": [int(i) for i in top.indices],
        "top2_margin": round(margin, 6),
        "bf16_step": step,
        "margin_in_bf16_steps": round(margin / step, 2),
        "batched_token_rank": int((logits > logits[batched]).sum()) + 1,
        "near_tie": margin <= NEAR_TIE_STEPS * step,
    }


def run(
    out: Path,
    shape: str,
    backend: str,
    new_tokens: int,
    prompt_tokens: int,
    repeats: int,
    batch_sizes: tuple[int, ...] = (1,),
    routes: tuple[str, ...] = ROUTES,
    compare: int = 0,
    compare_tokens: int = 32,
) -> dict[str, Any]:
    import torch

    from benchmarks.bench_assets import write_model_dir
    from launcher.checks.kernels.validate import Device, environment
    from launcher.config.backend import device_name

    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "shape": shape,
        "backend": backend,
        "new_tokens": new_tokens,
        "prompt_tokens": prompt_tokens,
        "batch_sizes": list(batch_sizes),
        "routes": {},
    }
    if backend == "cuda":
        from benchmarks.fla_guard import lift_hopper_guard

        result["fla_guard"] = lift_hopper_guard()
    dev = Device(torch, device_name(backend))
    result["environment"] = environment(torch, dev)
    model_dir = write_model_dir(out / "model", shape)
    dtype = torch.bfloat16 if shape == "27b" else torch.float32
    proof_root = out / "proof"
    routing = apply_route("routed", backend, proof_root / "routed")  # before the build, as in a run
    started = time.perf_counter()
    model = build_model(torch, model_dir, dev.name, dtype)
    dev.sync()
    result["model_build_s"] = round(time.perf_counter() - started, 1)
    result["parameters"] = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, 500, (max(batch_sizes), prompt_tokens), generator=gen).to(dev.name)
    for route in routes:
        if route != "routed":
            routing = apply_route(route, backend, proof_root / route)
            rebind_layers(torch, model)
        batches = {}
        for size in batch_sizes:
            if dev.module is not None:
                dev.module.reset_peak_memory_stats()
            batches[str(size)] = measure(torch, model, dev, prompts[:size], new_tokens, repeats)
            if dev.module is not None:
                batches[str(size)]["peak_allocated_gib"] = round(dev.module.max_memory_allocated() / 2**30, 2)
            print(
                f"decode_bench: {route}: batch {size}: {batches[str(size)]['decode_tokens_per_s']} tokens/s decoding",
                flush=True,
            )
        found = {**batches[str(batch_sizes[0])], "batches": batches}  # the first size's figures at the top
        proof = json.loads((proof_root / route / "rank0" / "deltanet_routing.json").read_text())
        found["route"] = {k: routing["route"][k] for k in ("kernel", "recurrent", "conv", "reason")}
        found["chunk_kernel"] = (proof.get("first_call") or {}).get("kernel")
        found["recurrent_kernel"] = (proof.get("first_decode_call") or {}).get("kernel")
        found["first_decode_call"] = proof.get("first_decode_call")
        if compare and route == "routed":
            found["compare"] = compare_batched(torch, model, dev, compare, prompt_tokens, compare_tokens)
            print(
                f"decode_bench: {route}: batch of {compare} against one at a time: "
                f"{found['compare']['exact_matches']} of {compare} answers the same",
                flush=True,
            )
        result["routes"][route] = found
        print(
            f"decode_bench: {route}: {found['decode_tokens_per_s']} tokens/s decoding "
            f"({found['recurrent_kernel']}), prefill {found['prefill_s']} s",
            flush=True,
        )
    peaks = [
        b["peak_allocated_gib"]
        for r in result["routes"].values()
        for b in r["batches"].values()
        if "peak_allocated_gib" in b
    ]
    if peaks:
        result["peak_allocated_gib"] = max(peaks)
    routed, fallback = (result["routes"].get(r, {}).get("decode_tokens_per_s") for r in ROUTES)
    result["speedup_decode"] = round(routed / fallback, 2) if routed and fallback else None
    (out / "decode.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lab.decode_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for decode.json (and the config-only model)")
    parser.add_argument("--shape", choices=("27b", "tiny"), default="27b")
    parser.add_argument("--backend", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--new-tokens", type=int, default=128, metavar="N")
    parser.add_argument("--prompt-tokens", type=int, default=512, metavar="P")
    parser.add_argument("--repeats", type=int, default=3, metavar="R")
    parser.add_argument(
        "--batch-sizes",
        default="1",
        metavar="LIST",
        help="comma-separated prompts per generate call, e.g. 1,8,32 (default 1)",
    )
    parser.add_argument(
        "--routes",
        default=",".join(ROUTES),
        metavar="LIST",
        help=f"comma-separated, of {', '.join(ROUTES)} (default both)",
    )
    parser.add_argument(
        "--compare",
        type=int,
        default=0,
        metavar="K",
        help="also answer K prompts of different lengths in one batch and one at a time (routed) "
        "and count the answers that are the same token for token; where one differs, the "
        "top-2 logit margin there in bf16 steps (default 0: off; e.g. --compare 8)",
    )
    parser.add_argument(
        "--compare-tokens",
        type=int,
        default=32,
        metavar="N",
        help="new tokens per answer in the --compare check (default 32)",
    )
    ns = parser.parse_args(argv)
    routes = tuple(r.strip() for r in ns.routes.split(",") if r.strip())
    if not routes or set(routes) - set(ROUTES) or len(set(routes)) != len(routes):
        parser.error(f"--routes {ns.routes!r}: give {' or '.join(ROUTES)} or both, separated by a comma")
    if ns.compare and "routed" not in routes:
        parser.error(
            f"--compare {ns.compare} answers on the routed model, but --routes is {ns.routes!r}: "
            "add routed to --routes, or leave --compare out"
        )
    if ns.compare < 0 or ns.compare_tokens < 1:
        parser.error(
            f"--compare {ns.compare} / --compare-tokens {ns.compare_tokens}: use 0 or more prompts and at "
            "least 1 token, e.g. --compare 8 --compare-tokens 32"
        )
    if ns.new_tokens < 2 or ns.prompt_tokens < 1 or ns.repeats < 1:
        parser.error("--new-tokens must be at least 2, --prompt-tokens and --repeats at least 1")
    items = [s.strip() for s in ns.batch_sizes.split(",") if s.strip()]
    if not items or not all(s.isdigit() and int(s) > 0 for s in items):
        parser.error(f"--batch-sizes {ns.batch_sizes!r}: give positive integers separated by commas, e.g. 1,8,32")
    run(
        ns.out,
        ns.shape,
        ns.backend,
        ns.new_tokens,
        ns.prompt_tokens,
        ns.repeats,
        tuple(int(s) for s in items),
        routes,
        ns.compare,
        ns.compare_tokens,
    )
    print(f"decode_bench: written {ns.out / 'decode.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
