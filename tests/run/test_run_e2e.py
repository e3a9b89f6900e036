"""`launcher run` end to end: the tiny Qwen3.5 model trained through the real LLaMA-Factory on CPU.

Real processes throughout: the launcher CLI in a child process, torchrun or accelerate launch, one
rank per process over gloo, the real patches and LLaMA-Factory's trainer.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.support.common import launcher_cmd, make_config, only_run_dir, read_jsonl

pytestmark = pytest.mark.slow
MAX_STEPS = 4


def lora_tensor_names(adapter) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(adapter), "np") as f:
        return [k for k in f.keys() if ".lora_" in k]  # noqa: SIM118  (safe_open is not iterable)


def assert_trained(run_dir, expected_lora_tensors: int = 8) -> None:
    status = json.loads((run_dir / "status.json").read_text())
    assert status["exit_code"] == 0
    assert status["state"] in ("SUCCEEDED",)
    log = read_jsonl(run_dir / "output" / "trainer_log.jsonl")
    loss_lines = [r for r in log if "loss" in r]
    assert loss_lines, "no loss lines in trainer_log.jsonl"
    assert all(r["total_steps"] == MAX_STEPS for r in log)
    assert loss_lines[-1]["current_steps"] == MAX_STEPS
    names = lora_tensor_names(run_dir / "output" / "adapter_model.safetensors")
    assert len(names) == expected_lora_tensors, names
    assert all(".self_attn." in n for n in names)  # q/k/v/o live only in the full-attention layer
    # the exact YAML the job used is in the run directory
    assert (run_dir / "llamafactory.yaml").is_file() and (run_dir / "launcher.log").stat().st_size > 0
    assert_readable_by_everyone(run_dir)


def assert_readable_by_everyone(run_dir) -> None:
    """What a user on the host must read follows the umask (0644 under 022), even when a container's root
    wrote it: records, reports, the adapter and every checkpoint (safetensors writes them 0600), the lock."""
    mask = os.umask(0)
    os.umask(mask)
    readable = 0o444 & ~mask
    files = [run_dir / n for n in ("status.json", "events.jsonl", "verify.json", "manifest.json", "launcher.log")]
    files += [run_dir.parent / "launcher.lock", *(run_dir / "output").rglob("*.safetensors")]
    files += list((run_dir / "output").rglob("*.json"))
    assert len(files) > 8
    closed = [f"{p} {oct(p.stat().st_mode & 0o777)}" for p in files if p.stat().st_mode & readable != readable]
    assert not closed, closed


@pytest.mark.parametrize(
    "launcher",
    [
        {"nproc_per_node": 1, "distribution": "ddp"},
        {"nproc_per_node": 2, "distribution": "ddp"},
        {"nproc_per_node": 2, "distribution": "fsdp2"},
    ],
    ids=["1proc", "ddp2", "fsdp2"],
)
def test_run_trains_and_saves_an_adapter(tmp_path, demo_assets, launcher):
    cfg = make_config(tmp_path, demo_assets, launcher=launcher, max_steps=MAX_STEPS, save_steps=2, eval_steps=2)
    proc = launcher_cmd("run", cfg, "--quiet")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = only_run_dir(tmp_path / "runs")
    assert_trained(run_dir)
    log = (run_dir / "launcher.log").read_text()
    assert f"world size: {launcher['nproc_per_node']}" in log
    if launcher["distribution"] == "fsdp2":
        assert (run_dir / "accelerate.yaml").is_file()
        assert "fsdp2" in log.lower()
        for rank in (0, 1):  # text-only data: no rank builds the dummy image, so none waits on a vision tower
            record = json.loads((run_dir / "proof" / f"rank{rank}" / "text_only_batches.json").read_text())
            assert record["dummy_image"] == "skipped" and record["first_batch"]["pixel_values"] is False


def test_output_goes_to_the_terminal_and_the_log(tmp_path, demo_assets):
    # two steps: after one step of warmup the LoRA B matrices are still zero, which the acceptance checklist
    # fails (FAILED_ACCEPTANCE, exit code 4)
    cfg = make_config(tmp_path, demo_assets, max_steps=2, save_steps=2, eval_steps=2)
    proc = launcher_cmd("run", cfg)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = only_run_dir(tmp_path / "runs")
    assert "train_loss" in proc.stdout
    assert "train_loss" in (run_dir / "launcher.log").read_text()
    assert str(run_dir / "output" / "trainer_log.jsonl") in proc.stdout


def test_invalid_llamafactory_key_fails_before_training(tmp_path, demo_assets):
    cfg = make_config(tmp_path, demo_assets, lora_rnk=4)
    proc = launcher_cmd("run", cfg)
    assert proc.returncode == 2
    assert "lora_rnk: not a LLaMA-Factory argument; did you mean lora_rank?" in proc.stderr
    runs = tmp_path / "runs"  # the lock lives here; no run folder may
    assert not runs.exists() or not [p for p in runs.iterdir() if p.is_dir()]


def test_job_failure_is_recorded_with_its_exit_code_and_traceback(tmp_path, demo_assets):
    # neither check nor preflight can see this one: PEFT refuses the rank while LLaMA-Factory builds the model
    cfg = make_config(tmp_path, demo_assets, lora_rank=0)
    proc = launcher_cmd("run", cfg, "--quiet")
    assert proc.returncode == 1
    run_dir = only_run_dir(tmp_path / "runs")
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "FAILED" and status["exit_code"] == 1
    assert "`r` should be a positive integer" in status["reason"] and "rank 0" in status["reason"]
    events = read_jsonl(run_dir / "events.jsonl")
    assert [e["event"] for e in events] == ["created", "preflight", "started", "ended"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing.yaml"], "config file not found"),
    ],
)
def test_bad_command_lines(tmp_path, args, message):
    proc = launcher_cmd("run", *[tmp_path / a for a in args])
    assert proc.returncode == 2 and message in proc.stderr


def test_unknown_launcher_key_and_missing_model(tmp_path, demo_assets):
    cfg = make_config(tmp_path, demo_assets, launcher={"gpus": 8}, model_name_or_path=str(tmp_path / "nomodel"))
    proc = launcher_cmd("run", cfg)
    assert proc.returncode == 2
    assert "launcher.gpus: unknown key" in proc.stderr
    assert "model_name_or_path" in proc.stderr and "nomodel" in proc.stderr
    assert not (tmp_path / "runs").exists()
