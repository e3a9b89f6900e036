"""The demo assets: a real hybrid Qwen3.5 model folder, tokenizer, processor and dataset."""

from __future__ import annotations

import json

import pytest

from launcher.data.demo import (
    ADDED_TOKENS,
    DATASET_EVAL,
    DATASET_TRAIN,
    OPENINGS,
    SPECIAL_TOKENS,
    build_demo_assets,
    demo_records,
)


def test_model_has_the_hybrid_layer_pattern_and_a_vision_tower(demo_assets):
    config = json.loads((demo_assets["model"] / "config.json").read_text())
    assert config["model_type"] == "qwen3_5"
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    layer_types = config["text_config"]["layer_types"]
    assert layer_types.count("linear_attention") >= 3
    assert layer_types.count("full_attention") >= 1
    assert config["vision_config"]["depth"] >= 1


def test_weights_are_several_shards_named_by_the_index(demo_assets):
    model = demo_assets["model"]
    index = json.loads((model / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2
    assert shards == {p.name for p in model.glob("*.safetensors")}
    assert any(".linear_attn.in_proj_qkv." in k for k in index["weight_map"])
    assert any(".self_attn.q_proj." in k for k in index["weight_map"])
    assert any(k.startswith("model.visual.blocks.0.") for k in index["weight_map"])


def test_model_loads_and_runs(demo_assets):
    import torch
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(demo_assets["model"])
    out = model(input_ids=torch.tensor([[1, 2, 3, 4, 5]]))
    assert out.logits.shape[:2] == (1, 5)
    assert torch.isfinite(out.logits).all()


def test_tokenizer_carries_qwen_special_tokens(demo_assets):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_assets["model"])
    for token in SPECIAL_TOKENS + ADDED_TOKENS:
        ids = tok.encode(token, add_special_tokens=False)
        assert len(ids) == 1, (token, ids)
    assert tok.eos_token == "<|im_end|>"


def test_processor_patch_sizes_match_the_vision_config(demo_assets):
    from transformers import AutoProcessor

    config = json.loads((demo_assets["model"] / "config.json").read_text())["vision_config"]
    processor = AutoProcessor.from_pretrained(demo_assets["model"])
    assert type(processor).__name__ == "Qwen3VLProcessor"
    for part in (processor.image_processor, processor.video_processor):
        assert part.patch_size == config["patch_size"]
        assert part.temporal_patch_size == config["temporal_patch_size"]
        assert part.merge_size == config["spatial_merge_size"]


def test_dataset_is_soulchat_shaped_and_registered(demo_assets):
    data = demo_assets["data"]
    info = json.loads((data / "dataset_info.json").read_text())
    assert set(info) == {DATASET_TRAIN, DATASET_EVAL}
    for _name, entry in info.items():
        records = json.loads((data / entry["file_name"]).read_text())
        assert records
        for record in records:
            assert set(record) == {"system", "instruction", "input", "output", "history"}
            assert all(len(pair) == 2 for pair in record["history"])
        assert entry["columns"]["history"] == "history"


def opening(record: dict) -> str:
    """The record's first client turn, the one ``launcher evaluate`` asks."""
    return record["history"][0][0] if record["history"] else record["instruction"]


def test_distinct_openings_give_every_record_its_own_first_turn_and_leave_the_rest_as_drawn():
    plain, distinct = demo_records(40, seed=2), demo_records(40, seed=2, distinct_openings=True)
    assert len({opening(r) for r in distinct}) == 40 and {opening(r) for r in distinct} <= set(OPENINGS)
    for was, now in zip(plain, distinct, strict=True):  # the same records but for the first client turn
        first = "history" if was["history"] else "instruction"
        assert {k: v for k, v in now.items() if k != first} == {k: v for k, v in was.items() if k != first}
        assert now["history"][1:] == was["history"][1:] and opening(now) != opening(was)
        if was["history"]:
            assert now["history"][0][1] == was["history"][0][1]  # the counsellor's reply to it is kept
    assert demo_records(40, seed=2, distinct_openings=True) == distinct  # deterministic for a seed
    with pytest.raises(ValueError, match=f"the demo has {len(OPENINGS)}"):
        demo_records(len(OPENINGS) + 1, seed=0, distinct_openings=True)


def test_existing_assets_are_not_overwritten_without_force(demo_assets):
    root = demo_assets["model"].parent
    before = (demo_assets["model"] / "config.json").stat().st_mtime_ns
    with pytest.raises(FileExistsError, match="--force"):
        build_demo_assets(root)
    assert (demo_assets["model"] / "config.json").stat().st_mtime_ns == before
