"""FSDP2 sharding for real on the CPU: two gloo ranks train the tiny model through ``launcher run``.

accelerate 1.11 enables FSDP only on accelerators; the ``fsdp2_frozen_dtype`` patch lets a CPU FSDP2 rank take
it (``patches/fsdp2_frozen_dtype.py``), so this run shards every wrapped layer over the two ranks, is stopped with
a save, resumed (``resume_mode: exact``), verified, keeps its best adapter, and matches one process trained on the
same global batches (one rank with two accumulated micro-batches: the same samples per step and the same mean of
two micro-batch means) at every step, before the stop and after the resume. accelerate 1.11 itself restores only
rank 0's LoRA shard on a resume (docs/upstream.md): the checkpoint file holds rank 0's half, and the
``fsdp2_resume_adapter`` patch's record shows rank 1 left at its initial LoRA B (zero) before it set every rank's
shard from the checkpoint's whole ``adapter_model.safetensors``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from patches import fsdp2_frozen_dtype
from tests.support.common import make_config, read_jsonl
from tests.support.fake_runs import PREFLIGHT_SKIP, launcher, read_status, run_story, the_run_dir, wait_for

pytestmark = pytest.mark.slow

STEPS = 10
# Both runs are float32 on the CPU; they differ only in summation order (an all-reduce of two gradients against
# an accumulation of two micro-batches, and where the shards are gathered), about 1e-7 relative per step. Adam
# divides each gradient by its running RMS, so such differences do not shrink, and lr 1e-3 over 10 steps moves a
# LoRA weight by at most about 1e-2: 1e-5 of the adapter's largest value is far above float32 noise and far below
# what a different batch or one skipped step changes (the test checks that too). After the resume the patch copies
# the checkpoint's float32 adapter bit for bit into every shard, so the same bound holds to the last step; a rank
# left at its initial LoRA values (accelerate 1.11 alone) changes the next steps by far more.
RELATIVE_TOLERANCE = 1e-5


def _config(folder: Path, demo_assets, launcher_settings: dict, **lf) -> Path:
    settings = {
        "max_steps": STEPS,
        "save_steps": 2,
        "eval_steps": 2,
        "save_only_model": False,
        "lora_dropout": 0.0,
        "per_device_train_batch_size": 1,
        "logging_steps": 1,
        **lf,
    }
    folder.mkdir()
    return make_config(
        folder,
        demo_assets,
        launcher={"stop_grace_s": 300, "early_stopping": {"patience": 100}, **launcher_settings},
        **settings,
    )


def _logged_steps(run_dir: Path) -> list[int]:
    return [r["current_steps"] for r in read_jsonl(run_dir / "output" / "trainer_log.jsonl") if "loss" in r]


def _losses(output: Path) -> dict[int, float]:
    return {r["current_steps"]: r["loss"] for r in read_jsonl(output / "trainer_log.jsonl") if "loss" in r}


def _lora(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


def _largest_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    scale = max(float(t.abs().max()) for t in b.values())
    return max(float((a[k] - b[k]).abs().max()) for k in a) / scale


def _proof(run_dir: Path, patch: str, rank: int) -> dict:
    return json.loads((run_dir / "proof" / f"rank{rank}" / f"{patch}.json").read_text())


def _own_units_run(tmp_path: Path, demo_assets, env: dict) -> dict:
    """Two gloo ranks with ``trainable_units: own`` (the mode of the images' torch 2.7.1): every layer's LoRA is
    an FSDP2 unit of its own, sharded like the rest; its losses and last adapter."""
    patches = {"fsdp2_frozen_dtype": {"trainable_units": "own"}}
    config = _config(tmp_path / "own", demo_assets, {"nproc_per_node": 2, "distribution": "fsdp2", "patches": patches})
    done = launcher("run", config, "--quiet", env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = the_run_dir(tmp_path / "own" / "runs")
    preparations = [_proof(run_dir, "fsdp2_frozen_dtype", r)["preparation"] for r in (0, 1)]
    layers_with_lora = {name.split(".layers.")[1].split(".")[0] for name in _lora(run_dir / "output")}
    assert all(p["trainable_units_mode"] == "own" for p in preparations)
    assert preparations[0]["trainable_units"] == len(layers_with_lora) > 0, preparations[0]
    lora_units = [name for name in preparations[0]["units"] if "lora" in name.lower()]
    assert lora_units, list(preparations[0]["units"])
    for name in lora_units:
        local = [p["units"][name]["local_bytes"] for p in preparations]
        assert sum(local) == preparations[0]["units"][name]["full_bytes"] and min(local) > 0, (name, local)
    return {
        "losses": _losses(run_dir / "output"),
        "adapter": _lora(run_dir / "output" / f"checkpoint-{STEPS}"),
        "lora_units": lora_units,
    }


def test_two_gloo_ranks_shard_stop_resume_keep_the_best_and_match_one_process(tmp_path, demo_assets):
    env = {**os.environ, "LAUNCHER_PREFLIGHT_SKIP": PREFLIGHT_SKIP}
    sharded_cfg = _config(tmp_path / "fsdp", demo_assets, {"nproc_per_node": 2, "distribution": "fsdp2"})
    started = launcher("start", sharded_cfg, env=env, timeout=300)
    assert started.returncode == 0, started.stdout + started.stderr
    run_dir = the_run_dir(tmp_path / "fsdp" / "runs")
    wait_for("two logged optimizer steps", lambda: len(_logged_steps(run_dir)) >= 2, timeout=600, every=0.1)
    stopped = launcher("stop", run_dir, env=env, timeout=600)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    status = read_status(run_dir)
    saved = status["saved_checkpoint"]
    assert status["state"] == "CANCELLED" and saved is not None and saved["step"] < STEPS, run_story(run_dir)
    assert status["exit_code"] == 0 and saved["optimizer_state"] is True, run_story(run_dir)

    resumed = launcher("resume", run_dir, "--foreground", env=env, timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    status = read_status(run_dir)
    assert status["state"] == "SUCCEEDED" and status["attempt"] == 2 and status["resume_mode"] == "exact"
    assert _logged_steps(run_dir)[-1] == STEPS
    verified = launcher("verify", run_dir, "--json", env=env, timeout=600)  # the acceptance checks, run again by hand
    assert verified.returncode == 0 and json.loads(verified.stdout)["passed"] is True, verified.stdout[-3000:]

    # sharded for real: every rank holds half of every FSDP2 unit, the frozen base in its load dtype
    records = [json.loads((run_dir / "proof" / f"rank{r}" / "fsdp2_frozen_dtype.json").read_text()) for r in (0, 1)]
    preparations = [r["preparation"] for r in records]
    assert all(p["distributed_type"] == "FSDP" for p in preparations)
    assert records[0]["cpu_fsdp"] == {"distributed_type": "FSDP", "was": "MULTI_CPU"}
    # trainable_units auto: each layer's LoRA in the layer's unit where torch allows a unit to mix dtypes (>= 2.8)
    import torch

    shared = fsdp2_frozen_dtype.trainable_units_mode("auto", torch.__version__) == "shared"
    assert all(p["trainable_units_mode"] == ("shared" if shared else "own") for p in preparations)
    units = preparations[0]["units"]
    assert sum(".layers." in name and name.split(".")[-1].isdigit() for name in units) == 4  # the decoder layers
    # the frozen input and output embeddings are units of their own (split like the rest, below)
    assert all(p["embedding_units"] == ["input", "output"] for p in preparations)
    assert any(n.endswith("embed_tokens") for n in units) and any(n.endswith("lm_head") for n in units), list(units)
    for name, unit in units.items():
        local = [p["units"][name]["local_bytes"] for p in preparations]
        assert sum(local) == unit["full_bytes"] and max(local) <= 0.55 * unit["full_bytes"] + 64, (name, local)
    for side in ("frozen", "trainable"):
        held = [p[side]["local_bytes"] for p in preparations]
        assert preparations[0][side]["dtypes"] == ["float32"] and sum(held) == preparations[0][side]["full_bytes"]

    # the best checkpoint's adapter is the run's adapter, and the record names it
    output = run_dir / "output"
    state = json.loads((output / "trainer_state.json").read_text())
    evals = {h["step"]: h["eval_loss"] for h in state["log_history"] if "eval_loss" in h}
    best_step = min(evals, key=evals.get)
    kept = json.loads((output / "best_adapter.json").read_text())
    assert kept["checkpoint"] == f"checkpoint-{best_step}"
    best = output / kept["checkpoint"]
    assert (output / "adapter_model.safetensors").read_bytes() == (best / "adapter_model.safetensors").read_bytes()

    # one process, two accumulated micro-batches per step: the same global batches
    single_cfg = _config(tmp_path / "one", demo_assets, {"nproc_per_node": 1}, gradient_accumulation_steps=2)
    single = launcher("run", single_cfg, "--quiet", env=env, timeout=900)
    assert single.returncode == 0, single.stdout[-3000:] + single.stderr[-3000:]
    single_output = the_run_dir(tmp_path / "one" / "runs") / "output"
    before_stop = 2  # a checkpoint both runs wrote before the stop (save_steps 2; the stop came later)
    assert saved["step"] > before_stop
    sharded_losses = _losses(output)
    single_losses = _losses(single_output)
    assert sorted(sharded_losses) == sorted(single_losses) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):  # the same global batches, the same losses, before the stop and after the resume
        assert abs(sharded_losses[step] - single_losses[step]) <= RELATIVE_TOLERANCE * abs(single_losses[step]), step
    differences = {}
    for name in (f"checkpoint-{before_stop}", f"checkpoint-{STEPS}", "."):  # before the stop, the last, the kept one
        differences[name] = _largest_difference(_lora(output / name), _lora(single_output / name))
        assert differences[name] <= RELATIVE_TOLERANCE, (name, differences[name])
    own_run = _own_units_run(tmp_path, demo_assets, env)  # the images' mode, against the same single process
    assert all(
        abs(own_run["losses"][step] - single_losses[step]) <= RELATIVE_TOLERANCE * abs(single_losses[step])
        for step in range(1, STEPS + 1)
    ), own_run["losses"]
    differences["own units"] = _largest_difference(own_run["adapter"], _lora(single_output / f"checkpoint-{STEPS}"))
    assert differences["own units"] <= RELATIVE_TOLERANCE
    reference = _lora(single_output / f"checkpoint-{before_stop}")
    # the comparison can fail: two steps apart, the adapters differ by far more than the tolerance
    later = _lora(single_output / f"checkpoint-{before_stop + 2}")
    assert _largest_difference(later, reference) > 100 * RELATIVE_TOLERANCE
    shown = ", ".join(f"{name} {value:.2e}" for name, value in differences.items())
    print(
        f"\nFSDP2 over 2 gloo ranks (stopped at {saved['step']}, resumed) vs one process: largest differences "
        f"{shown} of the largest value"
    )

    # accelerate 1.11's save_fsdp_model(adapter_only=True), which transformers' Trainer always asks for, writes
    # rank 0's FSDP2 shard of each LoRA tensor only, and load_fsdp_model gives the other ranks an empty state dict
    # (docs/upstream.md; accelerate PR 4206). The checkpoint's adapter_model.safetensors is whole.
    import torch

    checkpoint = output / f"checkpoint-{saved['step']}"
    whole = _lora(checkpoint)
    written = torch.load(checkpoint / "pytorch_model_fsdp.bin", weights_only=False)
    assert len(written) == len(whole) > 0
    for name, tensor in written.items():
        full = whole[name.replace(".default.", ".")]
        local = tensor.to_local()
        assert tuple(tensor.shape) == tuple(full.shape) and local.shape[0] == full.shape[0] // 2, name
        assert torch.equal(local, full[: local.shape[0]]), name  # rank 0's half, and nothing of rank 1's

    # so the resume left rank 1 at its initial LoRA (B zero) and rank 0 right, and the patch set both from that file
    loads = [_proof(run_dir, "fsdp2_resume_adapter", r)["loads"] for r in (0, 1)]
    assert [len(x) for x in loads] == [1, 1], loads
    first, second = loads[0][0], loads[1][0]
    assert Path(first["checkpoint"]).resolve() == Path(second["checkpoint"]).resolve() == checkpoint.resolve()
    assert first["tensors_set"] == second["tensors_set"] == first["file_tensors"] == len(whole)
    assert second["local_before"]["lora_B"]["sq_norm"] == 0.0 < second["local_after"]["lora_B"]["sq_norm"]
    assert second["changed_local_tensors"] == len(whole) and first["changed_local_tensors"] == 0
    assert first["local_before"] == first["local_after"]
    after = sum(kind["sq_norm"] for load in (first, second) for kind in load["local_after"].values())
    assert after == pytest.approx(first["file_sq_norm"], rel=1e-9)  # the two shards make up the whole file
