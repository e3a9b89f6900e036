"""What PEFT's fp32 copy of a LoRA layer's input costs under bf16 autocast, against ``lora_input_cast``, which skips
it: the seed's four LoRA layers of one Qwen3.5-27B attention layer, on one CUDA device.

    python -m benchmarks.lab.lora_bench --out DIR [--tokens 4096] [--rank 8] [--dropout 0.05] [--repeats 20]

Each of ``q_proj`` (5,120 -> 12,288: 24 heads of 256 and their gate), ``k_proj`` and ``v_proj`` (5,120 -> 1,024) and
``o_proj`` (6,144 -> 5,120) is a frozen bf16 ``nn.Linear`` with PEFT's LoRA on it (rank ``--rank``, alpha twice the
rank, dropout ``--dropout``, the LoRA weights in fp32 as LLaMA-Factory keeps trainable parameters), fed
``[1, T, in]`` bf16 that needs its gradient (the hidden states do). Both ways run under bf16 autocast: ``cast``,
PEFT 0.18 as it ships (the input copied to fp32, the dropout on the copy, autocast casting it back for the matmul),
and ``skip``, with the product's ``lora_input_cast`` applied. For each projection and way: the median ms of R calls
of the forward and of forward+backward (CUDA events). ``step_ms`` is what one 4,096-token training step spends in
these layers with every layer checkpointed: 16 attention layers x the four projections x (forward + forward and
backward: a checkpointed layer runs its forward twice). With dropout 0 the two ways are compared on the output, the
input's gradient and both LoRA gradients (``gap``: the largest relative L2 difference; 0 when the update is the
same to the bit, as on the CPU and on one H100).

Results go to ``DIR/lora.json``, rewritten after every reading.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.bench_assets import QWEN3_5_27B as SHAPE
from benchmarks.lab import kernel_cli
from benchmarks.lab.attention_bench import cuda_median_ms
from benchmarks.lab.kernel_cli import Results, run

# projection -> (in, out) at the 27B shape, as transformers 5.6.0's Qwen3_5Attention builds them
PROJECTIONS = {
    "q_proj": (SHAPE.hidden_size, SHAPE.num_attention_heads * SHAPE.head_dim * 2),
    "k_proj": (SHAPE.hidden_size, SHAPE.num_key_value_heads * SHAPE.head_dim),
    "v_proj": (SHAPE.hidden_size, SHAPE.num_key_value_heads * SHAPE.head_dim),
    "o_proj": (SHAPE.num_attention_heads * SHAPE.head_dim, SHAPE.hidden_size),
}
ATTENTION_LAYERS = SHAPE.layer_types.count("full_attention")
WAYS = ("cast", "skip")


def lora_linear(torch, features: tuple[int, int], rank: int, dropout: float, device: str):
    """A frozen bf16 Linear with PEFT's LoRA on it, the LoRA weights in fp32, in training mode."""
    from peft import LoraConfig, get_peft_model

    class One(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(*features, bias=False, device=device, dtype=torch.bfloat16)

        def forward(self, x):
            return self.proj(x)

    torch.manual_seed(0)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=dropout, target_modules=["proj"])
    model = get_peft_model(One(), config)
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    lora_b = next(p for n, p in model.named_parameters() if "lora_B" in n)
    torch.nn.init.normal_(lora_b, std=0.02)  # PEFT starts B at 0; a trained adapter has not, and B's zero hides dA
    return model.train()


def set_way(way: str, proof_dir: Path, device: str) -> None:
    """``skip``: the product's patch applied (as on a rank: it also hooks the Trainer's first step, unused here);
    ``cast``: PEFT as it ships."""
    from patches import lora_input_cast
    from patches.core.proof import ProofFile

    lora_input_cast.restore()
    if way == "skip":
        lora_input_cast.apply({}, backend=device, proof=ProofFile(proof_dir, lora_input_cast.NAME, 0), facts={})


def measure(
    torch,
    name: str,
    tokens: int,
    rank: int,
    dropout: float,
    repeats: int,
    proof_dir: Path,
    device: str = "cuda",
    timer=cuda_median_ms,
) -> dict[str, Any]:
    """One projection both ways: the median ms of forward and of forward+backward, and (dropout 0) the gap."""
    from patches import lora_input_cast
    from patches.registry import restore_all

    features = PROJECTIONS[name]
    model = lora_linear(torch, features, rank, dropout, device)
    x = torch.randn(1, tokens, features[0], device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(1, tokens, features[1], device=device, dtype=torch.bfloat16)
    trained = [p for p in model.parameters() if p.requires_grad]

    def forward():
        with torch.autocast(device, dtype=torch.bfloat16):
            return model(x)

    def forward_backward():
        x.grad = None
        for param in trained:
            param.grad = None
        out = forward()
        out.backward(grad)
        return out

    found: dict[str, Any] = {"projection": name, "features": list(features), "tokens": tokens}
    results = {}
    try:
        for way in WAYS:  # in this order in every reading (cast first)
            set_way(way, proof_dir, device)
            torch.manual_seed(1)
            out = forward_backward()  # the first call, and the numbers compared below
            results[way] = [t.detach().float().clone() for t in (out, x.grad, *(p.grad for p in trained))]
            found[way] = {
                "forward_ms": round(timer(torch, forward, repeats), 3),
                "forward_backward_ms": round(timer(torch, forward_backward, repeats), 3),
                "casts_skipped": lora_input_cast.skipped_casts(),
            }
    finally:
        restore_all()  # PEFT as it ships, the Trainer unhooked, whatever happened
    if dropout == 0:
        found["gap"] = max(
            float((a - b).norm() / b.norm().clamp_min(1e-30))
            for a, b in zip(results["skip"], results["cast"], strict=True)
        )
    return found


def step_ms(readings: list[dict[str, Any]], way: str) -> float:
    """The step's ms in these layers: every attention layer's four projections, forward + forward and backward."""
    per_layer = sum(r[way]["forward_ms"] + r[way]["forward_backward_ms"] for r in readings)
    return round(ATTENTION_LAYERS * per_layer, 2)


def input_problem(args) -> str | None:
    """What is wrong with the arguments (which value, how to fix), or None; checked before anything is written."""
    if not 0 <= args.dropout < 1:
        return f"--dropout {args.dropout}: give a probability from 0 up to, not including, 1"
    return kernel_cli.below_one(args, "tokens", "rank", "repeats")


def main(argv: list[str] | None = None) -> int:
    parser = kernel_cli.parser(__doc__, "lora.json")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of the input (default 4096)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8, the seed's)")
    parser.add_argument("--dropout", type=float, default=0.05, help="LoRA dropout (default 0.05, the seed's)")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per reading (default 20)")
    args = kernel_cli.parse("lora_bench", parser, argv, "lora.json", input_problem)
    if args is None:
        return 2
    import peft
    import torch

    results = Results(
        "lora_bench",
        args.out,
        "lora.json",
        {
            "torch": torch.__version__,
            "peft": peft.__version__,
            "device": torch.cuda.get_device_name(),
            "tokens": args.tokens,
            "rank": args.rank,
            "dropout": args.dropout,
            "readings": [],
        },
    )
    with tempfile.TemporaryDirectory() as proof_dir:
        for name in PROJECTIONS:
            try:
                found = measure(torch, name, args.tokens, args.rank, args.dropout, args.repeats, Path(proof_dir))
            except KeyboardInterrupt:
                return results.interrupted(name, f"the {name} reading")
            results.data["readings"].append(found)
            print(json.dumps(found), flush=True)
            results.save()
    readings = results.data["readings"]
    results.data["step_ms"] = {way: step_ms(readings, way) for way in WAYS}
    results.data["step_ms"]["saved"] = round(results.data["step_ms"]["cast"] - results.data["step_ms"]["skip"], 2)
    results.save()
    print(json.dumps({"step_ms": results.data["step_ms"]}), flush=True)
    return 0


if __name__ == "__main__":
    run(main)
