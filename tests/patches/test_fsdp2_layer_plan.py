"""The layer plan under FSDP2: two gloo ranks train the tiny model through ``launcher run`` with a count, and
with a memory budget, and both ranks apply one plan.

The CPU has no allocator counters, so ``launcher check`` (rightly) refuses ``memory_budget_gib`` there; the budget
run passes the check as a count and its ranks run ``tests.support.memory_standin_entry``, which turns the count into a
budget and gives each rank a stand-in counter whose peak differs by rank, so that the two ranks' own plans differ.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.support.common import make_config
from tests.support.fake_runs import PREFLIGHT_SKIP, launcher, read_status, the_run_dir

pytestmark = pytest.mark.slow

DECODER = "Qwen3_5DecoderLayer"


def _run(tmp_path: Path, demo_assets, env: dict | None = None, **launcher_settings) -> Path:
    settings = {
        "nproc_per_node": 2,
        "distribution": "fsdp2",
        "patches": {"checkpoint_all_layers": {"uncheckpointed_layers": 1}},
        **launcher_settings,
    }
    cfg = make_config(
        tmp_path, demo_assets, launcher=settings, max_steps=3, per_device_train_batch_size=1, logging_steps=1
    )
    env = {**os.environ, "LAUNCHER_PREFLIGHT_SKIP": PREFLIGHT_SKIP, **(env or {})}
    done = launcher("run", cfg, "--quiet", env=env, timeout=900)
    run_dir = the_run_dir(tmp_path / "runs")
    status = read_status(run_dir)
    assert done.returncode == 0 and status["state"] == "SUCCEEDED", done.stdout[-3000:] + done.stderr[-3000:]
    return run_dir


def _proofs(run_dir: Path) -> list[dict]:
    return [json.loads((run_dir / "proof" / f"rank{r}" / "checkpoint_all_layers.json").read_text()) for r in (0, 1)]


def _modes(census: dict) -> dict[str, str]:
    """Decoder layer name -> how it ran (FSDP2 renames the class ``FSDP<class>``)."""
    return {e["name"]: e["observed"] for e in census["layers_detail"] if e["class"].endswith(DECODER)}


def _not_checkpointed(census: dict) -> list[str]:
    return sorted(n for n, mode in _modes(census).items() if mode == "not_checkpointed")


def test_two_fsdp2_ranks_measure_in_the_forward_and_apply_one_count_plan(tmp_path, demo_assets):
    proofs = _proofs(_run(tmp_path, demo_assets))
    plans = [p["layer_plan"] for p in proofs]
    for proof, layer_plan in zip(proofs, plans, strict=True):
        first, second = proof["first_training_step"], proof["second_training_step"]
        assert first["fsdp"]["version"] == 2 and second["fsdp"]["version"] == 2
        assert layer_plan["ranks"] == 2 and not layer_plan["errors"]
        assert all(c["saved_bytes"] > 0 for c in layer_plan["measured_here"].values())
        assert len(layer_plan["measured_here"]) == 2  # a DeltaNet and a full-attention layer, inside the forward
        assert _not_checkpointed(first) == sorted(layer_plan["measured_layers"].values())
        assert _not_checkpointed(second) == layer_plan["uncheckpointed_names"]
        assert sorted(_modes(second).values()) == ["non_reentrant"] * 3 + ["not_checkpointed"]
        # the un-checkpointed layer's forward ran once in the step (nothing under FSDP2 recomputed it), the others
        # twice (the forward and the backward's recompute)
        calls = {e["name"]: e["calls"] for e in second["layers_detail"] if e["class"].endswith(DECODER)}
        assert {n: calls[n] for n in layer_plan["uncheckpointed_names"]} == dict.fromkeys(
            layer_plan["uncheckpointed_names"], 1
        )
        assert sorted(calls.values()) == [1, 2, 2, 2] and second["recomputed"] >= 3
    assert plans[0]["uncheckpointed"] == plans[1]["uncheckpointed"] and sum(plans[0]["uncheckpointed"].values()) == 1
    assert plans[0]["uncheckpointed_names"] == plans[1]["uncheckpointed_names"]
    assert plans[0]["detail"]["order"] == plans[1]["detail"]["order"]  # costs agreed per token: one order


def test_two_fsdp2_ranks_agree_on_a_budget_plan_and_on_its_correction(tmp_path, demo_assets):
    """A budget of 100 GiB affords every (tiny) layer on both ranks at step 1. At step 2 rank 0's stand-in peak is
    below the all-checkpointed one (factor 1: nothing to correct) and rank 1's is 100,000 GiB (its own correction
    takes every layer back): both ranks take every layer back, although only rank 1 re-planned."""
    env = {"STANDIN_BUDGET_GIB": "100", "STANDIN_PEAK_GIB": "1.0,0.0;1.0,100000"}
    proofs = _proofs(_run(tmp_path, demo_assets, env=env, entry="tests.support.memory_standin_entry"))
    plans = [p["layer_plan"] for p in proofs]
    names = plans[0]["uncheckpointed_names"]
    assert len(names) == 4 and plans[1]["uncheckpointed_names"] == names
    corrections = [p["plan_correction"] for p in proofs]
    assert corrections[0]["factor"] == 1.0 and corrections[1]["factor"] > 1000
    assert corrections[0]["widened"] == []  # rank 0's factor would widen, but its plan left every layer out already
    for proof, layer_plan, correction in zip(proofs, plans, corrections, strict=True):
        assert proof["options"] == {"uncheckpointed_layers": None, "memory_budget_gib": 100.0, "offload_inputs": "auto"}
        assert layer_plan["this_rank_chose"] == layer_plan["uncheckpointed"] and layer_plan["ranks"] == 2
        assert layer_plan["detail"]["budget_gib"] == 100.0 and not layer_plan["errors"]
        assert _not_checkpointed(proof["second_training_step"]) == sorted(names)  # the plan held at step 2
        assert correction["keep"] == {} and correction["rechecked"] == names and correction["uncheckpointed_total"] == 0


def _widening_run(tmp_path: Path, demo_assets, peaks: str) -> tuple[list[dict], list[dict]]:
    """Two ranks with a budget whose room holds 1.4 of the dearest layer at its count (``STANDIN_ROOM_LAYERS``):
    priced at ``PRIOR_FACTOR`` (1.5x) the first plan affords one layer; at the count it affords two. The tiny
    model's DeltaNet layer counts about 8.7 MB at 200 tokens, its one attention layer about 1.4 MB (d and 0.16 d),
    so in either order of the kinds: at 1.5x, DeltaNet (1.5 d) never fits 1.4 d and the attention layer does; at
    the count, one DeltaNet layer (d) and the attention layer (0.16 d) fit 1.4 d, and a second DeltaNet does not."""
    env = {"STANDIN_BUDGET_GIB": "100", "STANDIN_ROOM_LAYERS": "1.4", "STANDIN_PEAK_GIB": peaks}
    proofs = _proofs(_run(tmp_path, demo_assets, env=env, entry="tests.support.memory_standin_entry"))
    plans = [p["layer_plan"] for p in proofs]
    assert plans[0]["uncheckpointed_names"] == plans[1]["uncheckpointed_names"]
    assert [p["uncheckpointed_total"] for p in plans] == [1, 1]
    for proof, layer_plan in zip(proofs, plans, strict=True):
        correction = proof["plan_correction"]
        assert _not_checkpointed(proof["second_training_step"]) == layer_plan["uncheckpointed_names"]
        # the second step's stand-in peak is below the all-checkpointed one: priced at the count (factor 1)
        assert correction["step"] == 2 and correction["factor"] == 1.0 and correction["priced_at"] == 1.5
        assert correction["rechecked"] == [] and len(correction["widened"]) == 1
        assert correction["uncheckpointed_names"] == sorted(
            layer_plan["uncheckpointed_names"] + correction["widened"], key=lambda n: int(n.rsplit(".", 1)[1])
        )
        # what the widened plan keeps, at the count, fits the room (1.4 of the dearest layer's count)
        counted = {k: c["saved_bytes"] / 1.5 for k, c in layer_plan["detail"]["costs"].items()}
        assert sum(n * counted[k] for k, n in correction["keep"].items()) <= 1.4 * max(counted.values())
        assert correction["projected_peak_gib"] <= layer_plan["detail"]["budget_gib"] - 1.0
        # the widened plan ran at step 3
        assert _not_checkpointed(proof["third_training_step"]) == sorted(correction["uncheckpointed_names"])
    assert proofs[0]["plan_correction"]["keep"] == proofs[1]["plan_correction"]["keep"]
    return proofs, plans


def test_a_plan_that_cost_what_was_counted_is_widened_from_the_third_step_and_holds(tmp_path, demo_assets):
    """The first plan priced each layer at 1.5x its count; the second step's peak shows the count was right, so
    the plan is made again at the count and one more layer runs un-checkpointed from step 3, whose peak (as low
    again) keeps it."""
    proofs, _ = _widening_run(tmp_path, demo_assets, "1.0,0.0;1.0,0.0")
    for proof in proofs:
        correction, recheck = proof["plan_correction"], proof["plan_recheck"]
        assert recheck["step"] == 3 and recheck["factor"] == 1.0 and recheck["priced_at"] == 1.0
        assert recheck["rechecked"] == [] and recheck["widened"] == []  # held, and never widened twice
        assert recheck["uncheckpointed_names"] == correction["uncheckpointed_names"]


def test_a_widened_plan_whose_third_step_peaks_over_the_budget_is_taken_back(tmp_path, demo_assets):
    """As above, but the third step's stand-in peak is 100,000 GiB: the recheck prices the layers at that factor
    and checkpoints every one of them again, on both ranks."""
    proofs, _ = _widening_run(tmp_path, demo_assets, "1.0,0.0,100000;1.0,0.0,100000")
    for proof in proofs:
        correction, recheck = proof["plan_correction"], proof["plan_recheck"]
        assert recheck["step"] == 3 and recheck["factor"] > 1000 and recheck["keep"] == {}
        assert recheck["rechecked"] == correction["uncheckpointed_names"] and recheck["uncheckpointed_total"] == 0
