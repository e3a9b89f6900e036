"""LoRA training steps on the CPU, measured: ``python -m tests.support.memory_probe MODEL_DIR TOKENS [TOKENS ...]
[--profile]``.

Builds the model of ``MODEL_DIR/config.json`` in float32 with random weights, adapts ``q_proj``, ``k_proj``,
``v_proj`` and ``o_proj`` with PEFT LoRA r8 (as LLaMA-Factory does for the seed's ``lora_target``), checkpoints
every decoder layer non-reentrantly, and runs one AdamW step on each ``TOKENS`` count of random tokens. Prints one
JSON line: the parameters; with ``--profile``, per token count the peak of allocated bytes (torch's profiler, its
CPU memory timeline, weights included); without, the resident set before the model was built and at its peak
(``ru_maxrss``: the profiler's own records would count there).
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
from pathlib import Path


def _step(model, optimizer, ids) -> None:
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()  # the first step allocates Adam's state
    optimizer.zero_grad()


def main(folder: str, tokens: list[int], profiled: bool) -> dict:
    import psutil
    import torch
    from peft import LoraConfig, get_peft_model
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoConfig, Qwen3_5ForConditionalGeneration

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(folder)
    result: dict = {"rss_before": psutil.Process().memory_info().rss, "allocated_peak": {}}
    model = Qwen3_5ForConditionalGeneration._from_config(config, dtype=torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    result["parameters"] = sum(p.numel() for p in model.parameters())
    for count in tokens:
        ids = torch.randint(20, config.text_config.vocab_size, (1, count))
        if not profiled:
            _step(model, optimizer, ids)
            continue
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as p:
            _step(model, optimizer, ids)
        with tempfile.TemporaryDirectory() as tmp:
            timeline = Path(tmp) / "timeline.json"
            p.export_memory_timeline(str(timeline), device="cpu")  # [times, [bytes per category] per time]
            _, sizes = json.loads(timeline.read_text())
        result["allocated_peak"][str(count)] = max(sum(s) for s in sizes)
    result["rss_peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("tokens", type=int, nargs="+")
    parser.add_argument("--profile", action="store_true")
    ns = parser.parse_args()
    print(json.dumps(main(ns.model_dir, ns.tokens, ns.profile)))
