"""Checkpointing: LLaMA-Factory's real model preparation with and without the patch, on a tiny model.

The model has one DeltaNet layer and one full-attention layer; only the full-attention layer trains
(as with LoRA on q,k,v,o). ``Trainer.training_step`` is replaced by a stub that does forward and backward,
so the first-step hook runs without a whole Trainer; the slow tests do the same through real training.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import patches
from patches import checkpoint_all_layers
from patches.core import trainer_hook
from patches.core.errors import PatchError
from patches.core.proof import read_proof
from patches.planning.census import StepObserver, describe_checkpoint_func, fsdp_units

pytest_plugins = ["tests.support.patch_fixtures"]
pytestmark = pytest.mark.usefixtures("restore_patches")

NON_REENTRANT = "torch.utils.checkpoint.checkpoint(use_reentrant=False)"
LF_WRAPPER = (
    "get_custom_gradient_checkpointing_func.<locals>.custom_gradient_checkpointing_func -> "
    "torch.utils.checkpoint.checkpoint(use_reentrant=True)"
)


def lf_model_args(**overrides):
    """The ``ModelArguments`` fields ``prepare_model_for_training`` reads, at LLaMA-Factory's defaults."""
    fields = {
        "upcast_layernorm": False,
        "disable_gradient_checkpointing": False,
        "use_unsloth_gc": False,
        "use_reentrant_gc": True,
        "upcast_lmhead_output": False,
    }
    return SimpleNamespace(**{**fields, **overrides})


def prepared_like_llamafactory(model, **overrides):
    from llamafactory.model.model_utils.checkpointing import prepare_model_for_training

    model.requires_grad_(False)
    model.model.layers[1].self_attn.q_proj.weight.requires_grad_(True)  # a LoRA-like trainable full-attn layer
    prepare_model_for_training(model, lf_model_args(**overrides))
    return model


def batch():
    import torch

    ids = torch.randint(1, 64, (2, 9))
    return {"input_ids": ids, "labels": ids}


def observed_step(model) -> dict:
    observer = StepObserver(model)
    model.train()
    model(**batch()).loss.backward()
    return observer.finish()


def modes(census: dict) -> dict[str, str]:
    return {entry["layer_type"]: entry["observed"] for entry in census["layers_detail"]}


def test_without_the_patch_llamafactory_skips_the_frozen_deltanet_layer(make_tiny_model):
    model = prepared_like_llamafactory(make_tiny_model())
    census = observed_step(model)
    assert census["gradient_checkpointing_true"] == 2  # the flag is set on both layers ...
    assert census["functions"] == {LF_WRAPPER: 2}
    # ... but only the layer with a trainable parameter is checkpointed, and reentrantly
    assert modes(census) == {"linear_attention": "not_checkpointed", "full_attention": "reentrant"}
    # the checkpointed layer's forward ran again in the backward, the other's once
    calls = {e["layer_type"]: e["calls"] for e in census["layers_detail"]}
    assert calls == {"linear_attention": 1, "full_attention": 2}
    assert census["recomputed"] == 1


def test_with_the_patch_every_layer_is_checkpointed_non_reentrantly(tmp_path, make_tiny_model):
    patches.apply_enabled({}, backend="cpu", proof_dir=tmp_path)
    model = prepared_like_llamafactory(make_tiny_model())
    census = observed_step(model)
    assert census["functions"] == {NON_REENTRANT: 2}
    assert modes(census) == {"linear_attention": "non_reentrant", "full_attention": "non_reentrant"}
    calls = read_proof(tmp_path, "checkpoint_all_layers")["model_preparation"]["enable_calls"]
    assert [(c["requested_kwargs"], c["function"], c["checkpoint_layers"]) for c in calls] == [
        ({"use_reentrant": True}, NON_REENTRANT, 2)
    ]


def test_the_trainers_re_enable_goes_through_the_patch_too(tmp_path, make_tiny_model):
    patches.apply_enabled({}, backend="cpu", proof_dir=tmp_path)
    model = prepared_like_llamafactory(make_tiny_model())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=None)  # what Trainer does before the loop
    assert modes(observed_step(model)) == {"linear_attention": "non_reentrant", "full_attention": "non_reentrant"}


def test_unsloth_checkpointing_is_refused_while_the_patch_is_on(tmp_path, make_tiny_model):
    patches.apply_enabled({}, backend="cpu", proof_dir=tmp_path)
    with pytest.raises(PatchError, match="use_unsloth_gc: true.*remove use_unsloth_gc"):
        prepared_like_llamafactory(make_tiny_model(), use_unsloth_gc=True)


def test_apply_is_idempotent_and_restore_gives_llamafactory_back(tmp_path):
    from llamafactory.model.model_utils import checkpointing as lf

    original = lf._gradient_checkpointing_enable
    patches.apply_enabled({}, backend="cpu", proof_dir=tmp_path)
    patches.apply_enabled({}, backend="cpu", proof_dir=tmp_path)
    assert lf._gradient_checkpointing_enable is checkpoint_all_layers._gradient_checkpointing_enable
    assert trainer_hook.is_installed()
    checkpoint_all_layers.restore()
    assert lf._gradient_checkpointing_enable is original


def test_first_training_step_re_applies_and_records(tmp_path, make_tiny_model, stub_trainer):
    import transformers

    patches.apply_enabled({}, backend="cpu", proof_dir=tmp_path)
    model = prepared_like_llamafactory(make_tiny_model())
    # something between preparation and training puts LLaMA-Factory's reentrant, trainable-only rule back
    checkpoint_all_layers._state["original"](model, {"use_reentrant": True})
    assert describe_checkpoint_func(model.model.layers[0]._gradient_checkpointing_func) == LF_WRAPPER

    transformers.Trainer.training_step(stub_trainer, model, batch())
    transformers.Trainer.training_step(stub_trainer, model, batch())  # only the first step is recorded

    step = read_proof(tmp_path, "checkpoint_all_layers")["first_training_step"]
    assert step["reapplied_layers"] == 2
    assert (step["layers"], step["gradient_checkpointing_true"]) == (2, 2)
    assert step["observed"] == {"non_reentrant": 2}
    assert step["by_class"] == {
        "Qwen3_5DecoderLayer": {"layers": 2, "gradient_checkpointing_true": 2, "observed": {"non_reentrant": 2}}
    }
    assert step["fsdp"] is None
    assert [e["trainable"] for e in step["layers_detail"]] == [False, True]


def test_disabled_patch_still_records_what_llamafactory_did(tmp_path, make_tiny_model, stub_trainer):
    import transformers

    patches.apply_enabled({"checkpoint_all_layers": False}, backend="cpu", proof_dir=tmp_path)
    model = prepared_like_llamafactory(make_tiny_model())
    transformers.Trainer.training_step(stub_trainer, model, batch())
    record = read_proof(tmp_path, "checkpoint_all_layers")
    assert (record["enabled"], record["status"]) == (False, "disabled")
    assert "reapplied_layers" not in record["first_training_step"]
    assert record["first_training_step"]["by_layer_type"] == {
        "linear_attention": {"layers": 1, "gradient_checkpointing_true": 1, "observed": {"not_checkpointed": 1}},
        "full_attention": {"layers": 1, "gradient_checkpointing_true": 1, "observed": {"reentrant": 1}},
    }


def test_no_checkpointing_requested_is_left_off(tmp_path, make_tiny_model, stub_trainer):
    import transformers

    patches.apply_enabled({}, backend="cpu", proof_dir=tmp_path)
    model = prepared_like_llamafactory(make_tiny_model(), disable_gradient_checkpointing=True)
    stub_trainer.args.gradient_checkpointing = False
    transformers.Trainer.training_step(stub_trainer, model, batch())
    step = read_proof(tmp_path, "checkpoint_all_layers")["first_training_step"]
    assert step["reapplied_layers"] == 0
    assert "asks for no gradient checkpointing" in step["note"]
    assert step["observed"] == {"not_checkpointed": 2}


def test_trainer_hook_fires_once_and_after_callbacks_cannot_break_the_step(monkeypatch, stub_trainer):
    import transformers

    seen = []
    monkeypatch.setattr(transformers.Trainer, "training_step", lambda self, model, inputs: seen.append("step"))
    trainer_hook.clear()
    trainer_hook.on_first_training_step("a", before=lambda t, m: seen.append("before"))
    trainer_hook.on_first_training_step("b", after=lambda t, m: 1 / 0)
    trainer_hook.install()  # idempotent
    for _ in range(3):
        transformers.Trainer.training_step(stub_trainer, None, {})
    assert seen == ["before", "step", "step", "step"]


def test_fsdp2_units_are_counted(tmp_path):
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        assert fsdp_units(model) is None
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        assert fsdp_units(model) == {"version": 2, "units": 3}
    finally:
        dist.destroy_process_group()
