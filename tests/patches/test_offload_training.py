"""``checkpoint_all_layers.offload_inputs`` through the real LLaMA-Factory 0.9.5 path on CPU.

Two trainings of the demo model (``torchrun -m launcher.entry``, two steps of two micro-batches, SGD, evaluated at
every step), the option forced on and off: the losses, the evaluation losses and the LoRA weights after the SGD steps
(minus the learning rate times the summed gradients) must be the same to the bit. On CPU the offloader copies each
checkpointed input out to host chunks and back into a new buffer (``patches/planning/offload.py``); pinned memory
and side
streams need an accelerator and are not exercised here. Then a run with it on through ``launcher start``, stopped
with ``launcher stop`` (a checkpoint at the stop) and continued with ``launcher resume``, evaluating as it goes.
"""

from __future__ import annotations

import json

import pytest

from patches.core.proof import read_proof
from tests.support import fake_runs as fr
from tests.support.common import make_config, read_jsonl
from tests.support.patch_fixtures import EVAL_EVERY_STEP_SGD, trainer_log

pytest_plugins = ["tests.support.patch_fixtures"]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trainings(demo_assets, tiny_training, tmp_path_factory):
    root = tmp_path_factory.mktemp("offload_runs")
    results = {
        name: tiny_training(
            root / name,
            demo_assets,
            {"checkpoint_all_layers": {"offload_inputs": name == "on"}},
            lf={**EVAL_EVERY_STEP_SGD, "lora_dropout": 0.0},
        )
        for name in ("on", "off")
    }
    for name, result in results.items():
        assert result.returncode == 0, f"{name} training failed:\n{result.stderr[-3000:]}"
    return {name: root / name for name in results}


def test_the_offloaded_training_has_the_same_losses_to_the_bit(trainings):
    on, off = trainer_log(trainings["on"]), trainer_log(trainings["off"])
    losses = [[x["loss"] for x in log if "loss" in x] for log in (on, off)]
    evals = [[x["eval_loss"] for x in log if "eval_loss" in x] for log in (on, off)]
    assert len(losses[0]) == 2 and losses[0] == losses[1]
    assert len(evals[0]) == 2 and evals[0] == evals[1]  # evaluation runs with it on


def test_the_offloaded_training_makes_the_same_lora_update_to_the_bit(trainings):
    """With SGD and LoRA B starting at zero the weights after two steps are the initial ones minus the learning rate
    times the summed gradients: equal tensors, bit for bit, mean equal LoRA gradients."""
    import torch
    from safetensors.torch import load_file

    on, off = (load_file(trainings[n] / "output" / "adapter_model.safetensors") for n in ("on", "off"))
    assert set(on) == set(off) and any("lora_B" in n for n in off)
    assert all(off[n].abs().max() > 0 for n in off if "lora_B" in n)
    assert all(torch.equal(on[n], off[n]) for n in off)


def test_the_record_shows_what_the_first_step_moved(trainings):
    on = read_proof(trainings["on"] / "proof", "checkpoint_all_layers")
    moved = on["offload_inputs"]
    assert moved["on"] is True and moved["setting"] is True
    # the first training_step is one micro-batch: each of the 4 decoder layers' input (the vision block does not
    # run on text-only batches), 3 of them fetched ahead by the backward
    assert moved["first_step"]["packed"] == 4 and moved["first_step"]["packed_bytes"] > 0
    assert (moved["first_step"]["prefetched"], moved["first_step"]["fetched_on_demand"]) == (3, 1)
    assert on["first_training_step"]["observed"] == {"non_reentrant": 4, "not_run": 1}  # the vision block
    off = read_proof(trainings["off"] / "proof", "checkpoint_all_layers")
    assert off["offload_inputs"]["on"] is False and "first_step" not in off["offload_inputs"]


def test_a_run_with_offload_stops_resumes_and_evaluates(tmp_path, demo_assets):
    """``launcher start``, ``launcher stop`` once it has logged two steps (the job saves a checkpoint at the stop),
    ``launcher resume``: the second attempt trains the remaining steps with the inputs offloaded again and
    evaluates. Each batch is slowed by a second (``tests/support/slow_rank_entry.py``) so the stop lands
    mid-run."""
    import os

    cfg = make_config(
        tmp_path,
        demo_assets,
        launcher={
            "entry": "tests.support.slow_rank_entry",
            "patches": {"checkpoint_all_layers": {"offload_inputs": True}},
        },
        max_steps=16,
        save_steps=100,
        eval_steps=4,
        save_only_model=False,
    )
    env = {**os.environ, "SLOW_DATA": json.dumps({"seconds": 1.0})}
    try:
        started = fr.launcher("start", cfg, env=env, timeout=300)
        assert started.returncode == 0, started.stdout + started.stderr
        run_dir = fr.the_run_dir(tmp_path / "runs")
        log = run_dir / "output" / "trainer_log.jsonl"
        fr.wait_for("two logged steps", lambda: sum("loss" in r for r in read_jsonl(log)) >= 2, timeout=300)
        stopped = fr.launcher("stop", run_dir, env=env, timeout=300)
        assert stopped.returncode == 0 and "ended CANCELLED" in stopped.stdout, stopped.stdout + stopped.stderr
        saved = sorted((run_dir / "output").glob("checkpoint-*"))
        assert saved, "the stop saved no checkpoint"
        stopped_at = int(saved[-1].name.split("-")[1])
        assert stopped_at < 16

        resumed = fr.launcher("resume", run_dir, "--foreground", env=env, timeout=600)
        assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
        status = fr.read_status(run_dir)
        assert status["state"] == "SUCCEEDED" and status["attempt"] == 2 and status["resume_mode"] == "exact"
        records = read_jsonl(log)
        steps = [r["current_steps"] for r in records if "loss" in r]
        assert steps[-1] == 16 and stopped_at + 1 in steps
        assert any("eval_loss" in r and r["current_steps"] > stopped_at for r in records)
        proof = read_proof(run_dir / "proof", "checkpoint_all_layers")  # the second attempt's
        assert proof["offload_inputs"]["on"] is True and proof["offload_inputs"]["first_step"]["packed"] > 0
    finally:
        fr.kill_all(fr.processes_naming(str(tmp_path)))
