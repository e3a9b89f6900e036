"""Both patches through the real LLaMA-Factory 0.9.5 training path on CPU (torchrun, gloo, DDP).

Two trainings of the tiny demo model, two steps each, started exactly as the launcher starts a rank
(``torchrun -m launcher.entry RUN_DIR``): one with every patch on and two ranks (so there is a record per
rank), one with ``checkpoint_all_layers`` turned off, to show what LLaMA-Factory does by itself. The
disabled run's record comes from the read-only first-step observation, not from the patch.
"""

from __future__ import annotations

import pytest

from patches.core.proof import read_proof

pytest_plugins = ["tests.support.patch_fixtures"]
pytestmark = pytest.mark.slow

TORCH_REFERENCE = "transformers.models.qwen3_5.modeling_qwen3_5.torch_chunk_gated_delta_rule"
NON_REENTRANT = "torch.utils.checkpoint.checkpoint(use_reentrant=False)"


@pytest.fixture(scope="module")
def runs(demo_assets, tiny_training, tmp_path_factory):
    root = tmp_path_factory.mktemp("patch_runs")
    results = {
        "patched": tiny_training(root / "patched", demo_assets, {}, nproc=2),
        "unpatched": tiny_training(root / "unpatched", demo_assets, {"checkpoint_all_layers": False}),
    }
    for name, result in results.items():
        assert result.returncode == 0, f"{name} training failed:\n{result.stderr[-3000:]}"
    return {name: root / name for name in results}


def test_both_trainings_saved_an_adapter(runs):
    for run_dir in runs.values():
        assert (run_dir / "output" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("rank", [0, 1])
def test_with_the_patch_every_layer_is_checkpointed_non_reentrantly_at_the_first_step(runs, rank):
    record = read_proof(runs["patched"] / "proof", "checkpoint_all_layers", rank)
    assert (record["status"], record["rank"], record["world_size"]) == ("applied", rank, 2)
    step = record["first_training_step"]
    assert step["functions"] == {NON_REENTRANT: 5}
    assert step["by_layer_type"] == {
        "linear_attention": {"layers": 3, "gradient_checkpointing_true": 3, "observed": {"non_reentrant": 3}},
        "full_attention": {"layers": 1, "gradient_checkpointing_true": 1, "observed": {"non_reentrant": 1}},
    }
    assert step["by_class"]["Qwen3_5VisionBlock"]["gradient_checkpointing_true"] == 1
    # LLaMA-Factory asked for reentrant at preparation; the Trainer re-enabled before the loop
    calls = record["model_preparation"]["enable_calls"]
    assert [c["requested_kwargs"].get("use_reentrant") for c in calls] == [True, None]
    assert {c["function"] for c in calls} == {NON_REENTRANT}


def test_without_the_patch_llamafactory_leaves_the_deltanet_layers_unchecked(runs):
    record = read_proof(runs["unpatched"] / "proof", "checkpoint_all_layers")
    assert (record["enabled"], record["status"]) == (False, "disabled")
    step = record["first_training_step"]
    assert step["by_layer_type"] == {
        "linear_attention": {"layers": 3, "gradient_checkpointing_true": 3, "observed": {"not_checkpointed": 3}},
        "full_attention": {"layers": 1, "gradient_checkpointing_true": 1, "observed": {"reentrant": 1}},
    }
    detail = [e for e in step["layers_detail"] if e.get("layer_type") == "linear_attention"]
    assert all(e["function"].startswith("get_custom_gradient_checkpointing_func") for e in detail)
    assert not any(e["trainable"] for e in detail)


@pytest.mark.parametrize("rank", [0, 1])
def test_routing_records_the_kernel_that_ran_on_each_rank(runs, rank):
    record = read_proof(runs["patched"] / "proof", "deltanet_routing", rank)
    assert record["route"]["kernel"] == "torch"
    call = record["first_call"]
    assert (call["kernel"], call["device"], call["dtype"]) == (TORCH_REFERENCE, "cpu", "torch.float32")
    batch, tokens, heads, dim = call["shape"]  # [B, T, H, D]: 4 value heads of dim 16 in the demo model
    assert (batch, heads, dim) == (2, 4, 16)
    assert 16 < tokens <= 256  # the tokenized sample length, bounded by cutoff_len
    step = record["first_training_step"]
    assert (step["deltanet_layers"], step["routed_layers"]) == (3, 3)
    assert step["kernel_calls_in_step"] == 6  # 3 layers forward + 3 recomputed in backward
