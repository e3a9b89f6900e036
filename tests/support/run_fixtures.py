"""Run folders for the verify and report tests: crafted ones (fast, exact) and one real demo run.

``make_run`` writes a complete run directory the way ``launcher run`` and LLaMA-Factory lay it out
(status.json, llamafactory.yaml, manifest.json, output/ with trainer_log.jsonl, trainer_state.json,
result files, the final adapter and checkpoints); each test then damages one thing. Adapters are
written with the safetensors library itself, so the launcher's own reader is checked against it.

``real_demo_run`` trains the tiny demo model once per session through ``launcher run`` in a child
process and is shared by every slow test that needs a real run.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import yaml

TINY_LAYERS = ("linear_attention",) * 3 + ("full_attention",)
QKVO = "q_proj,k_proj,v_proj,o_proj"
# What q/k/v/o means in the tiny model: the one full-attention layer (index 3), written out by hand.
TINY_QKVO_MODULES = [f"model.language_model.layers.3.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]


def model_config(layers: tuple[str, ...] = TINY_LAYERS, vision_depth: int = 1) -> dict[str, Any]:
    return {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": {"num_hidden_layers": len(layers), "layer_types": list(layers), "hidden_size": 16},
        "vision_config": {"depth": vision_depth},
    }


def lora_tensors(modules: list[str], rank: int = 8, dim: int = 16, seed: int = 0) -> dict[str, np.ndarray]:
    """A trained-looking adapter: random A and small non-zero B for every module."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for module in modules:
        tensors[f"base_model.model.{module}.lora_A.weight"] = rng.normal(size=(rank, dim)).astype(np.float32)
        tensors[f"base_model.model.{module}.lora_B.weight"] = (rng.normal(size=(dim, rank)) * 1e-3).astype(np.float32)
    return tensors


def write_adapter(
    folder: Path,
    modules: list[str],
    tensors: dict[str, np.ndarray] | None = None,
    rank: int = 8,
    base_model: str = "model",
) -> None:
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = tensors if tensors is not None else lora_tensors(modules, rank)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": modules,
        "rank_pattern": {},
        "base_model_name_or_path": base_model,
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))


def log_lines(train: dict[int, float], evals: dict[int, float], total: int, done: int) -> list[dict[str, Any]]:
    """trainer_log.jsonl records in LLaMA-Factory's order: a train line per step, then that step's eval."""
    lines = []
    for step in range(1, done + 1):
        common = {
            "current_steps": step,
            "total_steps": total,
            "epoch": step / total,
            "percentage": round(step / total * 100, 2),
            "elapsed_time": "0:00:01",
        }
        if step in train:
            lines.append({**common, "loss": train[step], "lr": 1e-4})
        if step in evals:
            lines.append({**common, "eval_loss": evals[step]})
    lines.append({"current_steps": done, "total_steps": total, "epoch": done / total, "percentage": 100.0})
    return lines


def write_trainer_log(output: Path, records: list[dict[str, Any]]) -> None:
    output.mkdir(parents=True, exist_ok=True)
    (output / "trainer_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def make_run(
    root: Path,
    name: str = "crafted-run",
    *,
    layers: tuple[str, ...] = TINY_LAYERS,
    lora_target: str = QKVO,
    modules: list[str] | None = None,
    total: int = 6,
    done: int | None = None,
    eval_steps: int | None = 3,
    save_steps: int = 3,
    train_loss: Callable[[int], float] = lambda s: 2.0 - 0.05 * s,
    eval_loss: Callable[[int], float] = lambda s: 2.1 - 0.04 * s,
    exit_code: int = 0,
    lf_extra: dict[str, Any] | None = None,
    history_extra: Callable[[int], dict[str, float]] | None = None,
    eval_key: str = "eval_loss",
) -> Path:
    """A complete, passing run directory under ``root/runs/name`` (model config under ``root/model``).

    ``eval_key`` other than ``eval_loss`` imitates ``eval_on_each_dataset``: the Trainer then logs
    ``eval_<dataset>_loss`` (into trainer_state.json only; LLaMA-Factory's log keeps just ``eval_loss``).
    ``history_extra`` adds more metrics to each evaluation, e.g. a test split's loss.
    """
    done = total if done is None else done
    modules = TINY_QKVO_MODULES if modules is None else modules
    model = root / "model"
    write_json(model / "config.json", model_config(layers))
    run = root / "runs" / name
    output = run / "output"
    output.mkdir(parents=True)
    write_json(
        run / "status.json",
        {
            "schema": 1,
            "run_id": name,
            "run_dir": str(run),
            "state": "SUCCEEDED" if exit_code == 0 else "FAILED",
            "exit_code": exit_code,
            "signal": None,
        },
    )
    write_json(run / "manifest.json", {"run_id": name, "model": {"path": str(model)}})
    lf = {
        "model_name_or_path": str(model),
        "stage": "sft",
        "do_train": True,
        "finetuning_type": "lora",
        "lora_rank": 8,
        "lora_target": lora_target,
        "max_steps": total,
        "save_strategy": "steps",
        "save_steps": save_steps,
        "logging_steps": 1,
        "output_dir": str(output),
    }
    if eval_steps:
        lf.update(eval_strategy="steps", eval_steps=eval_steps, eval_dataset="val")
    lf.update(lf_extra or {})
    (run / "llamafactory.yaml").write_text(yaml.safe_dump(lf, sort_keys=False))
    write_json(run / "launch.json", {"patches": {}, "backend": "cpu", "llamafactory_yaml": "llamafactory.yaml"})

    train = {s: train_loss(s) for s in range(1, done + 1)}
    evals = {s: eval_loss(s) for s in range(1, done + 1) if eval_steps and s % eval_steps == 0}
    write_trainer_log(output, log_lines(train, evals if eval_key == "eval_loss" else {}, total, done))
    history: list[dict[str, Any]] = []
    for step in range(1, done + 1):
        history.append({"step": step, "loss": train[step], "learning_rate": 1e-4, "epoch": step / total})
        if step in evals:
            history.append({"step": step, eval_key: evals[step], **(history_extra(step) if history_extra else {})})
    state = {
        "global_step": done,
        "max_steps": total,
        "eval_steps": eval_steps,
        "save_steps": save_steps,
        "log_history": history,
        "best_model_checkpoint": None,
    }
    for step in range(save_steps, done + 1, save_steps):
        ckpt = output / f"checkpoint-{step}"
        write_adapter(ckpt, modules, lora_tensors(modules, seed=step), base_model=str(model))
        write_json(
            ckpt / "trainer_state.json",
            {**state, "global_step": step, "log_history": [h for h in history if h["step"] <= step]},
        )
    write_adapter(output, modules, lora_tensors(modules, seed=done), base_model=str(model))
    write_json(output / "trainer_state.json", state)
    train_results = {"epoch": done / total, "train_loss": sum(train.values()) / max(len(train), 1)}
    write_json(output / "train_results.json", train_results)
    results = dict(train_results)
    if eval_steps:
        write_json(output / "eval_results.json", {"epoch": done / total, eval_key: evals.get(done, 0.0)})
        results[eval_key] = evals.get(done, 0.0)
    write_json(output / "all_results.json", results)
    return run


def tensor_key(module: str, ab: str) -> str:
    return f"base_model.model.{module}.lora_{ab}.weight"


def rewrite_adapter(run: Path, change: Callable[[dict[str, np.ndarray]], None]) -> None:
    """Load the final adapter, let ``change`` edit the tensors in place, save it back."""
    from safetensors.numpy import load_file, save_file

    path = run / "output" / "adapter_model.safetensors"
    tensors = {k: v.copy() for k, v in load_file(str(path)).items()}
    change(tensors)
    save_file(tensors, str(path))


# ---- one real training run per session ----------------------------------------------------------------

_REAL_RUN: dict[str, Any] = {}
EARLY_STOPPING = {"patience": 2}


def real_demo_run(tmp_path_factory, demo_assets) -> Path:
    """Train the demo config (with ``launcher.early_stopping``) once per session; return its run dir.

    Memoised here rather than by fixture scope, because test modules that import a fixture each get
    their own copy of it.
    """
    if "proc" not in _REAL_RUN:
        from tests.support.common import launcher_cmd, make_config, only_run_dir

        folder = tmp_path_factory.mktemp("real-run")
        config = make_config(folder, demo_assets, launcher={"early_stopping": EARLY_STOPPING})
        _REAL_RUN["proc"] = proc = launcher_cmd("run", config, "--quiet")
        if proc.returncode == 0:
            _REAL_RUN["run"] = only_run_dir(folder / "runs")
    proc = _REAL_RUN["proc"]
    assert proc.returncode == 0, "the real demo run failed:\n" + proc.stdout[-3000:] + proc.stderr[-3000:]
    return _REAL_RUN["run"]
