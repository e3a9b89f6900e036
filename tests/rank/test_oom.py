"""Out of memory: the phase, step, layer and fix a rank records when it runs out (``launcher.rank.oomtrack``).

The phase tests train the tiny model through the real ``launcher run`` (supervisor, torchrun, LLaMA-Factory, the
Trainer) with ``tests.support.oom_entry``, which raises torch's out-of-memory error in one phase: a CPU has no device
allocator that runs out, so the error is planted where a device's would be raised.
"""

from __future__ import annotations

import json
import os

import pytest

from launcher.rank import oomtrack
from tests.support.common import REPO, make_config
from tests.support.fake_runs import PREFLIGHT_SKIP, launcher, read_status, the_run_dir

GIB = 1 << 30


def test_requested_size_and_summary_from_torch_messages():
    assert oomtrack.requested_bytes("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 ...") == 2 * GIB
    assert oomtrack.requested_bytes("NPU out of memory. Tried to allocate 512.00 MiB (NPU 0; ...)") == 512 << 20
    assert (
        oomtrack.requested_bytes("DefaultCPUAllocator: can't allocate memory: you tried to allocate 123 bytes.") == 123
    )
    assert oomtrack.requested_bytes("out of memory") is None
    line = oomtrack.summary(
        {
            "phase": "recompute in backward",
            "step": 3,
            "layer": 7,
            "kind": "full attention",
            "requested": 2 * GIB,
            "allocated": None,
            "reserved": None,
            "peak": None,
            "fix": "x",
        }
    )
    assert line == (
        "out of memory in recompute in backward at step 3, decoder layer 7 (full attention): requested "
        "2.00 GiB, allocated -, reserved -, peak -; fix: x"
    )


def test_memory_history_is_a_no_op_off_cuda(tmp_path):
    """The allocator history and snapshot need CUDA (or torch_npu's): on the CPU nothing is recorded or written."""
    assert oomtrack.start_history("cpu", 3) is False
    assert oomtrack.dump_snapshot(tmp_path, "0") is None and list(tmp_path.iterdir()) == []


# --- a rank that runs out of memory, in each phase -----------------------------------------------------------------

# (plant, step, layer, expected phase, expected layer, its kind, a phrase of the fix). The tiny model's layers 0-2 are
# DeltaNet, layer 3 full attention; every layer checkpointed.
PHASES = [
    ("forward", 2, 1, "forward", 1, "DeltaNet", "cutoff_len"),
    ("recompute", 2, 3, "recompute in backward", 3, "full attention", "recomputed activations"),
    ("backward", 2, 2, "backward", 2, "DeltaNet", "cutoff_len"),
    ("optimizer", 2, 0, "optimizer step", None, None, "shards the optimizer state"),
    ("evaluation", 2, 0, "evaluation", 0, "DeltaNet", "per_device_eval_batch_size"),
    ("save", 2, 0, "save", None, None, "save_only_model"),
    ("all_gather", 2, 0, "FSDP all-gather", "any", "any", "fsdp2_frozen_dtype"),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("plant", "step", "layer", "phase", "at_layer", "kind", "fix"), PHASES, ids=[p[0] for p in PHASES]
)
def test_a_rank_out_of_memory_is_recorded_with_its_phase_layer_and_fix(
    tmp_path, demo_assets, plant, step, layer, phase, at_layer, kind, fix
):
    settings = {"entry": "tests.support.oom_entry", "stall_minutes": 10.0}
    if plant == "all_gather":
        settings["distribution"] = "fsdp2"
    cfg = make_config(
        tmp_path,
        demo_assets,
        launcher=settings,
        max_steps=3,
        save_steps=2,
        eval_steps=2,
        per_device_train_batch_size=1,
        per_device_eval_batch_size=1,
    )
    env = {
        **os.environ,
        "LAUNCHER_PREFLIGHT_SKIP": f"{PREFLIGHT_SKIP},data_stats",
        "OOM_SPEC": json.dumps({"phase": plant, "step": step, "layer": layer}),
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    }
    proc = launcher("run", cfg, "--quiet", env=env, timeout=900)
    run_dir = the_run_dir(tmp_path / "runs")
    status = read_status(run_dir)
    assert status["state"] == "OUT_OF_MEMORY", (status["reason"], proc.stderr[-3000:])
    assert proc.returncode == 5
    oom = status["out_of_memory"]
    assert oom["phase"] == phase and oom["step"] == step and oom["rank"] == 0, oom
    if at_layer != "any":
        assert (oom["layer"], oom["kind"]) == (at_layer, kind), oom
    assert fix in oom["fix"] and oom["requested"] == 2 * GIB
    assert oom["allocated"] is None  # a CPU has no device allocator to read
    shown = launcher("status", run_dir, env=env).stdout
    (row,) = [ln for ln in shown.splitlines() if ln.startswith("memory")]
    assert f"out of memory in {phase} at step {step}" in row and "requested 2.00 GiB" in row and fix in row
    assert status["reason"].splitlines()[1].startswith(f"rank 0: out of memory in {phase}")
