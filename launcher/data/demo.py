"""Build the CPU demo assets from scratch, with no download.

Writes three things under one folder:

- ``model/``: a tiny, randomly initialised ``Qwen3_5ForConditionalGeneration`` with the real hybrid
  layer pattern (three Gated DeltaNet layers, then one full-attention layer) and a one-block vision
  tower, saved as several safetensors shards with an index; next to it a byte-level BPE tokenizer
  trained locally on the demo text and carrying the Qwen special tokens, and a ``Qwen3VLProcessor``
  whose patch sizes match the vision config (LLaMA-Factory's ``qwen3_5*`` templates refuse to run
  without a processor).
- ``data/``: a small counselling-style dataset in SoulChat-R1's alpaca-with-history shape
  (``system``, ``instruction``, ``input``, ``output``, ``history``), written by us, with train and
  validation files registered in ``dataset_info.json``.

Needs the training stack (torch, transformers, tokenizers). The model is for exercising the real
code path only; its outputs are noise.
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass
from pathlib import Path

from launcher.files import sha256_file, share_readable

DATASET_TRAIN = "demo_counsel_train"
DATASET_EVAL = "demo_counsel_eval"

# Qwen3.5's chat and vision special tokens, in the order Qwen's own tokenizer lists them.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# Qwen ships these as added (non-special) tokens, so they survive decoding.
ADDED_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


@dataclass(frozen=True)
class TinyShape:
    """Sizes of the tiny model; the layer pattern is what matters, not the widths."""

    hidden_size: int = 64
    intermediate_size: int = 128
    layer_types: tuple[str, ...] = ("linear_attention",) * 3 + ("full_attention",)
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    vision_depth: int = 1
    vision_hidden_size: int = 32
    vision_heads: int = 2
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2


# Counselling-flavoured fragments. Synthetic text written for this project; no real conversation.
CLIENT = [
    "I have been feeling anxious before every exam and cannot sleep.",
    "My roommate and I keep arguing about small things.",
    "Since I moved to a new city I feel lonely most evenings.",
    "I worry that my parents are disappointed in my career choice.",
    "Work has been overwhelming and I feel tired all the time.",
    "I find it hard to say no when friends ask me for favours.",
    "After the breakup I keep replaying our last conversation.",
    "I get nervous speaking in meetings even when I know the answer.",
]
COUNSELOR = [
    "That sounds exhausting. Could you tell me more about when the feeling is strongest?",
    "It makes sense that this weighs on you. What have you tried so far?",
    "Thank you for sharing that. How do you usually take care of yourself on hard days?",
    "I hear how much this matters to you. What would a small first step look like?",
    "Many people feel this way in a new place. Who could you reach out to this week?",
    "Let us look at this together. What thoughts come up right before it happens?",
    "You are noticing a pattern, which is already progress. What do you need most right now?",
    "It is okay to feel this way. Which part feels most urgent to talk about today?",
]
SYSTEM = "You are a warm, careful counsellor. Listen first, reflect feelings, and ask one open question."


# every client opening of two or three CLIENT lines, for records that must each open differently
OPENINGS = [" ".join(lines) for n in (2, 3) for lines in itertools.permutations(CLIENT, n)]


def demo_records(count: int, seed: int, distinct_openings: bool = False) -> list[dict]:
    """Return ``count`` alpaca-with-history records, deterministic for a seed.

    ``distinct_openings``: every record's first client turn differs from the others' (drawn from ``OPENINGS``), as
    in a real held-out split; otherwise the eight ``CLIENT`` lines repeat, and ``launcher evaluate``, which answers
    each distinct opening once, would find at most eight test prompts.
    """
    if distinct_openings and count > len(OPENINGS):
        raise ValueError(f"{count} records with distinct openings: the demo has {len(OPENINGS)}")
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        turns = rng.randint(0, 2)
        history = [[rng.choice(CLIENT), rng.choice(COUNSELOR)] for _ in range(turns)]
        records.append(
            {
                "system": SYSTEM,
                "instruction": rng.choice(CLIENT),
                "input": "",
                "output": rng.choice(COUNSELOR),
                "history": history,
            }
        )
    if distinct_openings:  # drawn after the records, which are then the plain ones but for their first turn
        for record, opening in zip(records, rng.sample(OPENINGS, count), strict=True):
            if record["history"]:
                record["history"][0][0] = opening
            else:
                record["instruction"] = opening
    return records


def _corpus() -> list[str]:
    return [SYSTEM, *CLIENT, *COUNSELOR] * 4


def build_tokenizer(vocab_size: int = 600):
    """Train a byte-level BPE tokenizer on the demo text and wrap it as a fast HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
        model_max_length=131072,
    )
    tokenizer.add_tokens(ADDED_TOKENS)
    return tokenizer


def build_model_config(tokenizer, shape: TinyShape = TinyShape()):
    """A ``Qwen3_5Config`` with the tiny shape and token ids taken from ``tokenizer``."""
    from transformers import Qwen3_5Config

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vocab = len(tokenizer)
    vocab += -vocab % 64  # round up like real checkpoints do; unused rows are harmless
    text = {
        "vocab_size": vocab,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": len(shape.layer_types),
        "layer_types": list(shape.layer_types),
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "linear_num_key_heads": shape.linear_num_key_heads,
        "linear_num_value_heads": shape.linear_num_value_heads,
        "linear_key_head_dim": shape.linear_key_head_dim,
        "linear_value_head_dim": shape.linear_value_head_dim,
        "max_position_embeddings": 4096,
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "bos_token_id": None,
    }
    vision = {
        "depth": shape.vision_depth,
        "hidden_size": shape.vision_hidden_size,
        "intermediate_size": shape.vision_hidden_size * 2,
        "num_heads": shape.vision_heads,
        "out_hidden_size": shape.hidden_size,
        "patch_size": shape.patch_size,
        "temporal_patch_size": shape.temporal_patch_size,
        "spatial_merge_size": shape.spatial_merge_size,
        "num_position_embeddings": 64,
    }
    return Qwen3_5Config(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def build_processor(tokenizer, shape: TinyShape = TinyShape()):
    """A ``Qwen3VLProcessor`` whose patch sizes match the vision config.

    transformers builds the video processor on torchvision, which LLaMA-Factory needs anyway.
    """
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    image_processor = Qwen2VLImageProcessor(
        patch_size=shape.patch_size,
        temporal_patch_size=shape.temporal_patch_size,
        merge_size=shape.spatial_merge_size,
    )
    video_processor = Qwen3VLVideoProcessor(
        patch_size=shape.patch_size,
        temporal_patch_size=shape.temporal_patch_size,
        merge_size=shape.spatial_merge_size,
    )
    return Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor)


DEMO_MODEL_MARK = "DEMO_MODEL_RANDOM_WEIGHTS.txt"  # in the demo model's folder: what evaluate and report read


def is_demo_model(folder: Path) -> bool:
    """``folder`` holds the demo's tiny model, whose weights are random (its answers mean nothing)."""
    return (folder / DEMO_MODEL_MARK).is_file()


def build_model_dir(out: Path, seed: int = 0, shard_size: str = "300KB") -> Path:
    """Write the tiny model, tokenizer and processor into ``out`` and return it, with the mark that says its
    weights are random (``is_demo_model``)."""
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    config = build_model_config(tokenizer)
    model = Qwen3_5ForConditionalGeneration(config).to(torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size=shard_size)
    build_processor(tokenizer).save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / DEMO_MODEL_MARK).write_text(
        "The launcher's demo model: a tiny Qwen3.5-architecture model with random "
        "weights, built by `launcher demo`. What it generates is meaningless by "
        "construction; it exists to exercise the pipeline.\n"
    )
    return out


def write_dataset(
    out: Path, train: int = 48, eval: int = 8, seed: int = 0, test: int = 6, distinct_test_openings: bool = False
) -> Path:
    """Write train/validation files and their ``dataset_info.json`` into ``out``, and a held-out test split
    (``demo_counsel_train_test.json``, not registered) recorded as ``launcher data prepare --test-size`` records
    one, so that ``launcher evaluate`` runs on the demo (its records are synthetic, as the rest).
    ``distinct_test_openings``: each test conversation opens differently (``demo_records``), so all of them are
    prompts of ``launcher evaluate``."""
    out.mkdir(parents=True, exist_ok=True)
    columns = {
        "prompt": "instruction",
        "query": "input",
        "response": "output",
        "system": "system",
        "history": "history",
    }
    info = {}
    for name, count, offset in ((DATASET_TRAIN, train, 0), (DATASET_EVAL, eval, 1)):
        file = f"{name}.json"
        (out / file).write_text(json.dumps(demo_records(count, seed + offset), ensure_ascii=False, indent=1))
        info[name] = {"file_name": file, "formatting": "alpaca", "columns": columns}
    (out / "dataset_info.json").write_text(json.dumps(info, indent=2) + "\n")
    test_file = out / f"{DATASET_TRAIN}_test.json"
    test_file.write_text(
        json.dumps(demo_records(test, seed + 2, distinct_openings=distinct_test_openings), ensure_ascii=False, indent=1)
    )
    record = {
        "format": "demo",
        "name": DATASET_TRAIN,
        "counts": {"train": train, "val": eval, "test": test},
        "test": {"file": test_file.name, "sha256": sha256_file(test_file), "samples": test},
    }
    (out / f"{DATASET_TRAIN}.prepare.json").write_text(json.dumps(record, indent=2) + "\n")
    return out


def build_demo_assets(root: Path, force: bool = False) -> dict[str, Path]:
    """Build ``root/model`` and ``root/data``; refuse to overwrite unless ``force``.

    Returns:
        The paths written, keyed ``model`` and ``data``.

    Raises:
        FileExistsError: ``root/model`` or ``root/data`` exists and ``force`` is false.
    """
    model_dir, data_dir = root / "model", root / "data"
    if not force:
        for path in (model_dir, data_dir):
            if path.exists() and any(path.iterdir()):
                raise FileExistsError(
                    f"{path} already exists and is not empty; pass --force to rebuild it, or choose "
                    "another --out folder"
                )
    if force:
        import shutil

        for path in (model_dir, data_dir):
            shutil.rmtree(path, ignore_errors=True)
    build_model_dir(model_dir)
    write_dataset(data_dir)
    for path in (model_dir, data_dir):  # safetensors writes its shards 0600; the demo is for any user
        share_readable(path)
    return {"model": model_dir, "data": data_dir}
