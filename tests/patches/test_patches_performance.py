"""The performance patches on CPU: chunked loss, text-only batches, the layer plan, one final evaluation, the
collector's freeze.

In-process tests use a tiny ``Qwen3_5ForConditionalGeneration`` (the demo model's config, random weights,
fp32) with real PEFT LoRA on q/k/v/o; the layer-plan tests replace ``Trainer.training_step`` by a stub that
does forward and backward (as ``test_patches_checkpointing`` does), so the first- and second-step hooks run
without a whole Trainer. The slow tests train through the real LLaMA-Factory 0.9.5 path
(``torchrun -m launcher.entry``) and compare runs with the patches on and off.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import patches
from patches import chunked_loss
from patches.core.proof import read_proof
from patches.planning.budget import LayerCost, plan
from tests.support.common import read_jsonl
from tests.support.patch_fixtures import EVAL_EVERY_STEP_SGD, lora_model, trainer_log

pytest_plugins = ["tests.support.patch_fixtures"]

ONLY = {
    "deltanet_routing": False,
    "checkpoint_all_layers": False,
    "chunked_loss": False,
    "text_only_batches": False,
    "final_eval_once": False,
}


def only(**on) -> dict:
    return {**ONLY, **on}


def micro_batches(vocab: int):
    """Two micro-batches of two rows: right padding (mask 0, label -100) and masked prompt tokens."""
    import torch

    torch.manual_seed(1)
    batches = []
    for lengths in ((40, 27), (33, 40)):
        ids = torch.randint(5, vocab, (2, 40))
        mask = torch.zeros(2, 40, dtype=torch.long)
        labels = ids.clone()
        for row, length in enumerate(lengths):
            mask[row, :length] = 1
            labels[row, length:] = -100
            labels[row, : 7 + 3 * row] = -100  # the prompt
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return batches


def loss_and_grads(model, batches, accumulation: int):
    """What the Trainer does with ``model_accepts_loss_kwargs = False``: mean per micro-batch, / steps."""
    model.zero_grad()
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        (loss / accumulation).backward()
        losses.append(loss.item())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return losses, grads


def relative(a, b) -> float:
    return float((a - b).norm() / max(b.norm(), 1e-30))


@pytest.mark.usefixtures("restore_patches")
def test_chunked_loss_equals_the_upstream_loss_and_lora_gradients(tmp_path, demo_assets):
    model = lora_model(demo_assets["model"])
    batches = micro_batches(model.config.text_config.vocab_size)
    reference_losses, reference = loss_and_grads(model, batches, accumulation=2)

    patches.apply_enabled(only(chunked_loss={"chunk_tokens": 16}), backend="cpu", proof_dir=tmp_path)
    losses, grads = loss_and_grads(model, batches, accumulation=2)

    assert losses == pytest.approx(reference_losses, rel=1e-4)
    assert len(grads) == len(reference) > 0 and any("lora_A" in n for n in grads)
    worst = max(relative(grads[n], reference[n]) for n in reference)
    assert worst < 1e-4, worst
    first = read_proof(tmp_path, "chunked_loss")["first_call"]
    supervised = int((batches[0]["labels"][:, 1:] != -100).sum())
    assert first["supervised_tokens"] == supervised and first["chunks"] == -(-supervised // 16) > 1


@pytest.mark.usefixtures("restore_patches")
def test_chunked_loss_builds_no_logits_and_leaves_generation_alone(tmp_path, demo_assets):
    import torch

    model = lora_model(demo_assets["model"])
    batch = micro_batches(model.config.text_config.vocab_size)[0]
    patches.apply_enabled(only(chunked_loss=True), backend="cpu", proof_dir=tmp_path)
    assert model(**batch).logits is None
    with torch.no_grad():
        plain = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    assert plain.logits.shape[-1] == model.config.text_config.vocab_size


def test_a_chunked_loss_that_dropped_the_shift_would_be_caught():
    """The comparison above can fail: an unshifted chunked loss differs from the upstream loss."""
    import torch
    from transformers.loss.loss_utils import ForCausalLMLoss

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=False)
    hidden, labels = torch.randn(1, 20, 8), torch.randint(0, 11, (1, 20))
    with torch.no_grad():
        upstream = ForCausalLMLoss(head(hidden), labels, vocab_size=11)
        ours, _, _ = chunked_loss.chunked_causal_lm_loss(hidden, labels, head, 16)
        unshifted, _, _ = chunked_loss.chunked_causal_lm_loss(
            hidden, torch.nn.functional.pad(labels, (1, 0))[:, :-1], head, 16
        )
    assert ours.item() == pytest.approx(upstream.item(), rel=1e-5)
    assert unshifted.item() != pytest.approx(upstream.item(), rel=1e-3)


# --- the layer plan -------------------------------------------------------------------------------------


def cost(kind: str, layers: int, gib: float, seconds: float, seq: int = 1000) -> LayerCost:
    return LayerCost(kind, layers, int(gib * 1024**3), seconds, seq)


def test_a_budget_takes_the_kind_with_the_most_recompute_per_byte_first_and_scales_to_the_cutoff():
    costs = {"deltanet": cost("deltanet", 48, 0.5, 0.010), "attention": cost("attention", 16, 0.5, 0.020)}
    chosen = plan(costs, budget_gib=80.0, peak_gib=60.0, held_gib=50.0, seq_len=1000, cutoff_len=2000)
    # at 2000 tokens: all checkpointed 50 + 10 * 2 = 70 GiB; room 80 - 1 - 70 = 9 GiB; 1 GiB per layer
    assert chosen.detail["all_checkpointed_peak_gib"] == 70.0 and chosen.detail["room_gib"] == 9.0
    assert chosen.uncheckpointed == {"attention": 9}
    assert chosen.projected_peak_gib == 79.0
    roomy = plan(costs, budget_gib=200.0, peak_gib=60.0, held_gib=50.0, seq_len=1000, cutoff_len=1000)
    assert roomy.uncheckpointed == {"attention": 16, "deltanet": 48}
    tight = plan(costs, budget_gib=55.0, peak_gib=60.0, held_gib=50.0, seq_len=1000, cutoff_len=1000)
    assert tight.uncheckpointed == {}


def test_the_second_step_corrects_a_count_that_missed_memory_and_takes_layers_back():
    from patches.planning.budget import correction, scaled

    costs = {"deltanet": cost("deltanet", 48, 0.5, 0.010), "attention": cost("attention", 16, 0.5, 0.020)}
    first = plan(costs, budget_gib=90.0, peak_gib=60.0, held_gib=50.0, seq_len=1000, cutoff_len=1000)
    assert first.uncheckpointed == {"attention": 16, "deltanet": 42}  # room 29 GiB at the counted 0.5 GiB
    # the device says the 58 layers took 58 GiB, not 29: twice the count (second step at half the length)
    factor = correction(
        costs,
        first.uncheckpointed,
        peak_gib=50.0 + 5.0 + 29.0,
        held_gib=50.0,
        first_peak_gib=60.0,
        seq_len=500,
        first_seq_len=1000,
    )
    assert factor == pytest.approx(2.0)
    again = plan(scaled(costs, factor), budget_gib=90.0, peak_gib=60.0, held_gib=50.0, seq_len=1000, cutoff_len=1000)
    assert again.uncheckpointed == {"attention": 16, "deltanet": 13} and again.projected_peak_gib <= 89.0
    assert (
        correction(
            costs,
            first.uncheckpointed,
            peak_gib=70.0,
            held_gib=50.0,
            first_peak_gib=60.0,
            seq_len=1000,
            first_seq_len=1000,
        )
        == 1.0
    )  # less than counted: at the count


def test_a_plan_that_cost_less_than_priced_is_widened_to_the_plan_at_the_real_factor_whole():
    from patches.planning.budget import PRIOR_FACTOR, projected_peak_gib, revised, scaled

    # DeltaNet first (more recompute per byte), 1.207 GiB a layer, attention 1.115 GiB: the 27B's unfused counts
    costs = {"deltanet": cost("deltanet", 48, 1.207, 0.0084), "attention": cost("attention", 16, 1.115, 0.0074)}
    budget = {"budget_gib": 82.6, "peak_gib": 60.0, "held_gib": 50.0, "seq_len": 1000, "cutoff_len": 1000}
    first = plan(scaled(costs, PRIOR_FACTOR), **budget).uncheckpointed  # room 21.6 GiB at 1.5x the count
    assert first == {"deltanet": 11, "attention": 1}
    # the second step shows the count was right: the plan at 1.0 takes 17 DeltaNet layers and no attention layer;
    # the per-kind maximum of the two plans (17 + 1) would cost 21.63 GiB of the 21.6 GiB room
    widened = revised(costs, first, 1.0, priced_at=PRIOR_FACTOR, may_widen=True, **budget)
    assert widened == {"deltanet": 17}
    assert projected_peak_gib(costs, widened, **{k: v for k, v in budget.items() if k != "budget_gib"}) <= 81.6
    # the third step's recheck may only narrow; a factor at or under the price keeps the plan as it is
    assert revised(costs, widened, 1.0, priced_at=1.0, may_widen=False, **budget) == widened
    assert revised(costs, widened, 0.5, priced_at=1.0, may_widen=False, **budget) == widened
    # dearer: the plan at 2.0 is 8 DeltaNet + 1 attention, but narrowing never un-checkpoints a layer that ran
    # checkpointed (the attention layer)
    assert revised(costs, widened, 2.0, priced_at=1.0, may_widen=False, **budget) == {"deltanet": 8}
    narrowed = revised(costs, first, 3.0, priced_at=PRIOR_FACTOR, may_widen=True, **budget)
    assert narrowed == {"deltanet": 5, "attention": 1}  # dearer than the prior at step 2


def test_a_count_is_spread_over_the_kinds_in_order():
    costs = {"deltanet": cost("deltanet", 3, 0.5, 0.030), "attention": cost("attention", 1, 0.5, 0.020)}
    assert plan(costs, count=2).uncheckpointed == {"deltanet": 2}
    assert plan(costs, count=5).uncheckpointed == {"deltanet": 3, "attention": 1}


@pytest.mark.usefixtures("restore_patches")
def test_the_layer_plan_is_measured_in_the_first_step_and_holds_from_the_second(tmp_path, demo_assets, stub_trainer):
    import transformers

    settings = only(checkpoint_all_layers={"uncheckpointed_layers": 2})
    patches.apply_enabled(settings, backend="cpu", proof_dir=tmp_path, facts={"cutoff_len": 40})
    model = lora_model(demo_assets["model"])
    model.gradient_checkpointing_enable()  # what LLaMA-Factory's model preparation does, through the patch
    batch = micro_batches(model.config.text_config.vocab_size)[0]
    for _ in range(3):
        transformers.Trainer.training_step(stub_trainer, model, batch)

    proof = read_proof(tmp_path, "checkpoint_all_layers")
    layer_plan = proof["layer_plan"]
    costs = layer_plan["detail"]["costs"]
    assert set(costs) == {"Qwen3_5DecoderLayer:linear_attention", "Qwen3_5DecoderLayer:full_attention"}
    assert all(c["saved_bytes"] > 0 and c["seq_len"] == 40 for c in costs.values())
    assert layer_plan["uncheckpointed_total"] == 2 and not layer_plan["errors"]
    first, second = proof["first_training_step"], proof["second_training_step"]
    # the first step measures the first layer of each kind inside the model's forward, un-checkpointed
    measured = sorted(layer_plan["measured_layers"].values())
    layers = "base_model.model.model.language_model.layers"
    assert measured == [f"{layers}.0", f"{layers}.3"]
    first_modes = {e["name"]: e["observed"] for e in first["layers_detail"] if e["class"] == "Qwen3_5DecoderLayer"}
    assert sorted(n for n, mode in first_modes.items() if mode == "not_checkpointed") == measured
    assert sorted(first_modes.values()).count("non_reentrant") == 2
    by_name = {e["name"]: e["observed"] for e in second["layers_detail"] if e["class"] == "Qwen3_5DecoderLayer"}
    assert sorted(n for n, mode in by_name.items() if mode == "not_checkpointed") == sorted(
        layer_plan["uncheckpointed_names"]
    )
    assert sorted(by_name.values()).count("non_reentrant") == 2


def test_bad_layer_plan_options_are_refused_naming_the_key():
    with pytest.raises(ValueError, match="uncheckpointed_layers or memory_budget_gib, not both"):
        patches.normalize_settings({"checkpoint_all_layers": {"uncheckpointed_layers": 2, "memory_budget_gib": 90}})
    with pytest.raises(ValueError, match="checkpoint_all_layers.uncheckpointed_layers"):
        patches.normalize_settings({"checkpoint_all_layers": {"uncheckpointed_layers": -1}})
    with pytest.raises(ValueError, match="chunked_loss.chunk_tokens"):
        patches.normalize_settings({"chunked_loss": {"chunk_tokens": 0}})


@pytest.mark.usefixtures("restore_patches")
def test_the_collector_is_frozen_before_the_step_after_the_first_optimizer_step_and_thawed_by_restore(
    tmp_path, monkeypatch
):
    """Two micro-batches a step: the optimizer steps after the second call, so the freeze comes before the third
    (its state exists then); ``restore_all`` thaws what the patch froze. The Trainer's step is a stand-in that reads
    the freeze count (the real step runs in the training tests below)."""
    import gc

    import transformers

    seen: list[int] = []
    monkeypatch.setattr(
        transformers.Trainer, "training_step", lambda self, model, inputs: seen.append(gc.get_freeze_count())
    )
    trainer = SimpleNamespace(args=SimpleNamespace(gradient_accumulation_steps=2))
    assert gc.get_freeze_count() == 0
    alone = {**dict.fromkeys(patches.PATCH_NAMES, False), "gc_freeze": True}  # the others' hooks need a model
    patches.apply_enabled(alone, backend="cpu", proof_dir=tmp_path)
    for _ in range(4):
        transformers.Trainer.training_step(trainer, None, {})
    assert seen[:2] == [0, 0] and seen[2] > 10_000 and seen[3] > 10_000  # (freed ones leave the count)
    proof = read_proof(tmp_path, "gc_freeze")
    assert proof["before_training_step"] == 3 and proof["frozen_objects"] >= seen[2]  # (the proof file came after)
    from patches.registry import restore_all

    restore_all()
    assert gc.get_freeze_count() == 0


# --- through the real LLaMA-Factory training path ---------------------------------------------------------


@pytest.fixture(scope="module")
def trainings(demo_assets, tiny_training, tmp_path_factory):
    """The demo model, 2 steps of 2 micro-batches each, evaluated at every step: patches on, then off."""
    root = tmp_path_factory.mktemp("performance_runs")
    extra = {**EVAL_EVERY_STEP_SGD, "lora_dropout": 0.0}
    results = {
        "on": tiny_training(
            root / "on",
            demo_assets,
            {"checkpoint_all_layers": {"uncheckpointed_layers": 1}},
            lf=extra,
            entry="tests.support.eval_count_entry",
        ),
        "off": tiny_training(
            root / "off",
            demo_assets,
            {"chunked_loss": False, "text_only_batches": False, "final_eval_once": False, "gc_freeze": False},
            lf=extra,
            entry="tests.support.eval_count_entry",
        ),
    }
    for name, result in results.items():
        assert result.returncode == 0, f"{name} training failed:\n{result.stderr[-3000:]}"
    return {name: root / name for name in results}


@pytest.mark.slow
def test_the_patched_training_has_the_same_first_loss_and_eval_loss(trainings):
    on, off = trainer_log(trainings["on"]), trainer_log(trainings["off"])
    first_on, first_off = (next(x["loss"] for x in log if "loss" in x) for log in (on, off))
    assert first_on == pytest.approx(first_off, rel=1e-4)
    evals_on, evals_off = ([x["eval_loss"] for x in log if "eval_loss" in x] for log in (on, off))
    assert evals_on[0] == pytest.approx(evals_off[0], rel=1e-4)


@pytest.mark.slow
def test_the_patched_training_makes_the_same_lora_update(trainings):
    """With SGD and LoRA B starting at zero, B after two steps is minus the learning rate times the summed
    gradients: equal B tensors mean equal gradients through the real Trainer, with the patches on and off."""
    from safetensors.torch import load_file

    on, off = (load_file(trainings[n] / "output" / "adapter_model.safetensors") for n in ("on", "off"))
    b_names = [n for n in off if "lora_B" in n]
    assert b_names and set(on) == set(off)
    assert all(off[n].abs().max() > 0 for n in b_names)
    worst = max(relative(on[n], off[n]) for n in b_names)
    assert worst < 1e-3, worst


@pytest.mark.slow
def test_text_only_data_skips_the_dummy_image_and_the_vision_tower(trainings):
    on = read_proof(trainings["on"] / "proof", "text_only_batches")
    assert on["dummy_image"] == "skipped" and on["first_batch"]["pixel_values"] is False
    census_on = read_proof(trainings["on"] / "proof", "checkpoint_all_layers")["first_training_step"]
    census_off = read_proof(trainings["off"] / "proof", "checkpoint_all_layers")["first_training_step"]
    assert census_on["by_class"]["Qwen3_5VisionBlock"]["observed"] == {"not_run": 1}
    assert census_off["by_class"]["Qwen3_5VisionBlock"]["observed"] == {"non_reentrant": 1}  # LLaMA-Factory's dummy


@pytest.mark.slow
def test_the_final_evaluation_runs_once(trainings):
    on, off = (read_jsonl(trainings[name] / "evaluations.jsonl") for name in ("on", "off"))
    assert [x["step"] for x in off] == [1, 2, 2]  # upstream: the last step's evaluation, then the same again
    assert [x["step"] for x in on] == [1, 2]
    proof = read_proof(trainings["on"] / "proof", "final_eval_once")
    assert [(e["step"], e["ran"]) for e in proof["evaluations"]] == [(1, True), (2, True), (2, False)]
    results = json.loads((trainings["on"] / "output" / "eval_results.json").read_text())
    logged = [x["eval_loss"] for x in trainer_log(trainings["on"]) if "eval_loss" in x]
    assert results["eval_loss"] == pytest.approx(logged[-1])


@pytest.mark.slow
def test_the_collectors_objects_are_frozen_after_the_first_optimizer_step_unless_gc_freeze_is_off(trainings):
    """On (the default), the rank froze what was alive before the call after its first optimizer step (2
    micro-batches a step here: the third call), after the first step's other records, and trained to the same loss
    and LoRA update as the run with it off (the two tests above)."""
    on = read_proof(trainings["on"] / "proof", "gc_freeze")
    assert on["status"] == "applied" and on["before_training_step"] == 3
    assert on["frozen_objects"] > 10_000  # the model, the optimizer, LLaMA-Factory's and transformers' objects
    first_step = read_proof(trainings["on"] / "proof", "checkpoint_all_layers")["first_training_step"]["recorded_at"]
    assert on["frozen_at"] > first_step  # ISO times in UTC: later sorts later
    off = read_proof(trainings["off"] / "proof", "gc_freeze")
    assert off["status"] == "disabled" and "frozen_objects" not in off


@pytest.mark.slow
def test_the_layer_plan_runs_through_the_trainer(trainings):
    proof = read_proof(trainings["on"] / "proof", "checkpoint_all_layers")
    assert proof["layer_plan"]["uncheckpointed_total"] == 1
    second = proof["second_training_step"]["by_class"]["Qwen3_5DecoderLayer"]["observed"]
    assert second == {"not_checkpointed": 1, "non_reentrant": 3}


@pytest.mark.slow
def test_a_dataset_with_an_image_keeps_the_dummy_and_runs_the_vision_tower_on_every_rank(
    demo_assets, tiny_training, tmp_path
):
    """Half the records carry a real 64x64 image: the run keeps LLaMA-Factory's dummy for the others, so every
    rank runs the vision tower every step (two DDP ranks here; under FSDP that is what keeps a rank from
    waiting on another's vision-tower collectives)."""
    from PIL import Image

    data = tmp_path / "data"
    data.mkdir()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(data / "red.png")
    info = json.loads((demo_assets["data"] / "dataset_info.json").read_text())
    entry = info["demo_counsel_train"]
    records = json.loads((demo_assets["data"] / entry["file_name"]).read_text())[:8]
    for i, record in enumerate(records):
        if i % 2 == 0:
            record["instruction"] = "<image>" + record["instruction"]
            record["images"] = [str(data / "red.png")]
    (data / "mm.json").write_text(json.dumps(records, ensure_ascii=False))
    columns = {**entry["columns"], "images": "images"}
    (data / "dataset_info.json").write_text(json.dumps({"mm": {**entry, "file_name": "mm.json", "columns": columns}}))
    assets = {**demo_assets, "data": data}
    result = tiny_training(
        tmp_path / "run", assets, {}, nproc=2, lf={"dataset": "mm", "per_device_train_batch_size": 1}
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        kept = read_proof(tmp_path / "run" / "proof", "text_only_batches", rank)
        assert kept["dummy_image"] == "kept" and "4 image(s)" in kept["why"]
        census = read_proof(tmp_path / "run" / "proof", "checkpoint_all_layers", rank)["first_training_step"]
        assert census["by_class"]["Qwen3_5VisionBlock"]["observed"] == {"non_reentrant": 1}


# --- found in review --------------------------------------------------------------------------------------


@pytest.mark.usefixtures("restore_patches")
def test_the_wrapped_forward_keeps_its_signature_and_applying_twice_keeps_one_chain(tmp_path):
    import inspect

    from llamafactory.data.collator import MultiModalDataCollatorForSeq2Seq
    from transformers import Qwen3_5ForConditionalGeneration

    from patches.core.wrapping import ORIGINAL

    settings = {"pad_lengths": {"multiple": 64}}
    patches.apply_enabled(settings, backend="cpu", proof_dir=tmp_path)
    patches.apply_enabled(settings, backend="cpu", proof_dir=tmp_path)  # pad_lengths wraps text_only_batches
    # generate() reads the forward's signature to pass logits_to_keep=1 at prefill
    assert "logits_to_keep" in inspect.signature(Qwen3_5ForConditionalGeneration.forward).parameters
    chain, call = [], MultiModalDataCollatorForSeq2Seq.__call__
    while hasattr(call, ORIGINAL):
        chain.append(call.__deltanet_launcher_patch__)
        call = getattr(call, ORIGINAL)
    assert chain == ["pad_lengths", "text_only_batches"]


def test_a_micro_batch_without_a_supervised_token_is_nan_with_zero_gradients_as_upstream():
    import torch

    head = torch.nn.Linear(8, 11, bias=False)
    hidden = torch.randn(1, 6, 8, requires_grad=True)
    loss, supervised, _ = chunked_loss.chunked_causal_lm_loss(hidden, torch.full((1, 6), -100), head, 16)
    assert supervised == 0 and torch.isnan(loss) and loss.requires_grad
    loss.backward()  # the Trainer's backward must not raise
    assert hidden.grad is not None and not hidden.grad.abs().sum()


def test_kinds_that_keep_nothing_are_not_planned():
    costs = {"vision": cost("vision", 27, 0.0, 0.003), "deltanet": cost("deltanet", 48, 0.5, 0.010)}
    assert plan(costs, count=4).uncheckpointed == {"deltanet": 4}


def test_a_trainable_vision_tower_keeps_the_dummy_image():
    from patches.text_only_batches import media_verdict

    counted = {"dataset_media": {"counted": True, "images": 0, "videos": 0, "records": 0, "datasets": ["d"]}}
    assert media_verdict(counted)[0] is True
    kept, why = media_verdict({**counted, "vision_trainable": True})
    assert kept is False and "freeze_vision_tower" in why


def test_the_final_evaluation_is_not_reused_when_it_generates():
    from patches import final_eval_once

    trainer = SimpleNamespace(
        args=SimpleNamespace(load_best_model_at_end=False, predict_with_generate=False),
        state=SimpleNamespace(global_step=4),
    )
    final_eval_once._state["last"] = {"step": 4, "prefix": "eval", "metrics": {"eval_loss": 1.0}}
    try:
        assert final_eval_once._reusable(trainer, None, "eval") == {"eval_loss": 1.0}
        trainer.args.predict_with_generate = True
        assert final_eval_once._reusable(trainer, None, "eval") is None
    finally:
        final_eval_once._state.clear()
