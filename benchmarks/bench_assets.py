"""Assets of the patch benchmark: a config-only model folder and a dataset of full-length samples.

The model folder holds ``config.json`` (the Qwen3.5-27B shape of docs/upstream.md, or the tiny demo shape),
the demo tokenizer and a ``Qwen3VLProcessor`` matching the vision config, and ``random_init.json``: the
marker that makes ``benchmarks.bench_entry`` build the model from the config with random weights on the
device instead of loading weights (writing 55 GB of random weights to disk would measure nothing more).
Everything else (LLaMA-Factory's data path, the Trainer, the patches, LoRA) is the real path.

Token ids come from the demo tokenizer (a few hundred ids), all far below the 248,320-row vocabulary;
special-token ids in the config are that tokenizer's. Every sample of ``write_dataset`` is longer than half of
``cutoff_len`` on both the prompt and the response side and than ``cutoff_len`` in all, so LLaMA-Factory's truncation
leaves exactly ``cutoff_len`` tokens.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from launcher.data.demo import (
    CLIENT,
    COUNSELOR,
    SYSTEM,
    TinyShape,
    build_model_config,
    build_processor,
    build_tokenizer,
)

MARKER = "random_init.json"
DATASET = "bench_long"
SPREAD = "bench_spread"
SPREAD_REPLY_SHARE = 0.7  # of a spread sample's tokens, the reply's (a SoulChat-like counselling turn)

# docs/upstream.md (Qwen3.5-27B): 64 layers, every fourth full attention (0-based 3, 7, ..., 63).
QWEN3_5_27B = TinyShape(
    hidden_size=5120,
    intermediate_size=17408,
    layer_types=(("linear_attention",) * 3 + ("full_attention",)) * 16,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    vision_depth=27,
    vision_hidden_size=1152,
    vision_heads=16,
    patch_size=16,
    temporal_patch_size=2,
    spatial_merge_size=2,
)
# What TinyShape does not carry: real vocabulary, vision MLP width and position table, context length.
QWEN3_5_27B_EXTRA = {
    "text": {"vocab_size": 248320, "max_position_embeddings": 262144},
    "vision": {"intermediate_size": 4304, "num_position_embeddings": 2304},
}
SHAPES: dict[str, tuple[TinyShape, dict[str, dict[str, Any]]]] = {
    "27b": (QWEN3_5_27B, QWEN3_5_27B_EXTRA),
    "tiny": (TinyShape(), {}),
}


def write_model_dir(out: Path, shape: str) -> Path:
    """Write config.json, tokenizer, processor and the random-init marker into ``out``; returns ``out``."""
    tiny, extra = SHAPES[shape]
    tokenizer = build_tokenizer()
    config = build_model_config(tokenizer, tiny)
    for section, values in extra.items():
        sub = config.text_config if section == "text" else config.vision_config
        for key, value in values.items():
            setattr(sub, key, value)
    config.dtype = "bfloat16" if shape == "27b" else "float32"  # the released checkpoint's dtype is bf16
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    build_processor(tokenizer, tiny).save_pretrained(out)
    marker = {
        "what": "config-only model folder: benchmarks.bench_entry builds the model from config.json with random "
        "weights directly on the device (torch default init of transformers, seed 0); no weights are stored",
        "shape": shape,
        "seed": 0,
    }
    (out / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return out


def _text_of(rng: random.Random, tokenizer, pool: list[str], tokens: int) -> str:
    """Sentences of ``pool`` in random order until they hold about ``tokens`` tokens (each counted once)."""
    counts = {sentence: len(tokenizer(sentence, add_special_tokens=False)["input_ids"]) for sentence in pool}
    parts: list[str] = []
    total = 0
    while total < tokens:
        for sentence in rng.sample(pool, len(pool)):
            parts.append(sentence)
            total += counts[sentence]
            if total >= tokens:
                break
    return " ".join(parts)


def _write(out: Path, name: str, records: list[dict[str, Any]]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(records, ensure_ascii=False))
    columns = {"prompt": "instruction", "query": "input", "response": "output", "system": "system"}
    info = {name: {"file_name": f"{name}.json", "formatting": "alpaca", "columns": columns}}
    (out / "dataset_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return out


def write_dataset(
    out: Path, model_dir: Path, cutoff_len: int, samples: int = 8, seed: int = 0, reply_share: float = 0.5
) -> Path:
    """Alpaca records whose prompt and response each exceed half of ``cutoff_len`` tokens, together more than twice
    it, in the ratio ``1 - reply_share`` to ``reply_share``, plus dataset_info.json. LLaMA-Factory's truncation of
    such a pair (``infer_seqlen``) keeps ``cutoff_len`` tokens in all, about ``reply_share`` of them the response's
    (supervised): 2,048 of 4,096 at the default 0.5, about 2,860 at the spread's share (``SPREAD_REPLY_SHARE``)."""
    from transformers import AutoTokenizer

    if not 0.3 <= reply_share <= 0.7:  # outside it one side falls below half the cutoff and is kept whole
        raise ValueError(f"reply_share {reply_share} is outside 0.3 to 0.7, where both sides are truncated")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(seed)
    both = 2 * (int(cutoff_len * 1.1) + 16)  # sentence joins can merge a few tokens: stay clearly above the cutoff
    prompt, reply = int(both * (1 - reply_share)), int(both * reply_share)
    records = [
        {
            "system": SYSTEM,
            "instruction": _text_of(rng, tokenizer, CLIENT, prompt),
            "input": "",
            "output": _text_of(rng, tokenizer, COUNSELOR, reply),
        }
        for _ in range(samples)
    ]
    return _write(out, DATASET, records)


def write_spread_dataset(out: Path, model_dir: Path, low: int, high: int, samples: int = 40, seed: int = 0) -> Path:
    """Alpaca records of about ``low`` to ``high`` tokens in all (uniform), 30 % client turn, 70 % reply, as
    SoulChat-like dialogues spread at cutoff 4096; ``dataset_info.json`` names them ``SPREAD``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(seed)
    records = []
    for _ in range(samples):
        total = rng.randint(low, high) - 24  # the template's own tokens
        prompt, reply = int(total * (1 - SPREAD_REPLY_SHARE)), int(total * SPREAD_REPLY_SHARE)
        records.append(
            {
                "system": "",
                "instruction": _text_of(rng, tokenizer, CLIENT, prompt),
                "input": "",
                "output": _text_of(rng, tokenizer, COUNSELOR, reply),
            }
        )
    return _write(out, SPREAD, records)


def count_parameters(model_dir: Path) -> dict[str, int]:
    """Parameters of the model the folder describes, built on the meta device (no memory, no weights)."""
    import torch
    from transformers import AutoConfig, Qwen3_5ForConditionalGeneration

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = Qwen3_5ForConditionalGeneration._from_config(config)
    visual = sum(p.numel() for n, p in model.named_parameters() if ".visual." in f".{n}")
    total = sum(p.numel() for p in model.parameters())
    return {"total": total, "visual": visual, "language": total - visual}
