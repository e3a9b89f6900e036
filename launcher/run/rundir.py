"""Run directories: one folder per run (``<output_root>/<run_id>/``) holding everything needed to understand and
reproduce it. Here: making the folder and writing the files a run starts with (the config copy, its overrides,
the LLaMA-Factory and accelerate YAMLs, ``launch.json``, the manifest).

Every name in a run folder is declared once, in ``launcher/state/runs.py``; what each file holds is the README's
run-directory table ("Run directories"), the one prose map of the folder.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from datetime import datetime
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.config.backend import Backend
from launcher.config.run_config import cutoff_len
from launcher.files import make_folder, sha256_file, write_text_atomic
from launcher.state.procs import container_identity
from launcher.state.runs import (
    ACCELERATE_YAML,
    CONFIG_COPY,
    JOB_LOG,
    LAUNCH_FILE,
    LF_YAML,
    MANIFEST_FILE,
    OUTPUT_SUBDIR,
    OVERRIDES_FILE,
    TRAINER_LOG,
    attempt_name,
)

if TYPE_CHECKING:  # config imports pydantic and patches; host-side readers of run folders need neither
    from launcher.config.run_config import RunConfig

TRACKED_PACKAGES = (
    "torch",
    "torch-npu",
    "torchvision",
    "transformers",
    "peft",
    "accelerate",
    "trl",
    "datasets",
    "tokenizers",
    "llamafactory",
    "fla-core",
    "flash-linear-attention",
    "triton",
    "triton-ascend",
    "deltanet-launcher",
)


@dataclass(frozen=True)
class RunDir:
    run_id: str
    path: Path

    @property
    def output(self) -> Path:
        return self.path / OUTPUT_SUBDIR

    @property
    def trainer_log(self) -> Path:
        return self.output / TRAINER_LOG

    @property
    def log(self) -> Path:
        return self.path / JOB_LOG


def new_run_id(name: str) -> str:
    return f"{name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def make_run_dir(output_root: Path, name: str) -> RunDir:
    """Create a fresh run folder; never reuses or overwrites an existing one."""
    make_folder(output_root, "launcher.output_root")
    base = new_run_id(name)
    for attempt in range(100):
        run_id = base if attempt == 0 else f"{base}-{attempt}"
        path = output_root / run_id
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return RunDir(run_id, path.resolve())
    raise FileExistsError(f"could not create a new run folder under {output_root} for {base}")


def accelerate_config(config: RunConfig, backend: Backend) -> dict[str, Any]:
    """An accelerate config for FSDP2 with the launcher's wrapping settings."""
    fsdp = config.launcher.fsdp
    mixed = "bf16" if config.llamafactory.get("bf16") else ("fp16" if config.llamafactory.get("fp16") else "no")
    return {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP",
        "num_machines": 1,
        "machine_rank": 0,
        "num_processes": config.launcher.nproc_per_node * config.launcher.nnodes,  # accelerate counts all nodes
        "main_training_function": "main",
        "mixed_precision": mixed,
        "use_cpu": backend.name == "cpu",
        "rdzv_backend": "static",
        "same_network": True,
        "fsdp_config": {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": ",".join(fsdp.wrap_classes),
            "fsdp_reshard_after_forward": fsdp.reshard_after_forward,
            "fsdp_offload_params": fsdp.offload_params,
            "fsdp_state_dict_type": "FULL_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": False,
        },
    }


def write_run_files(
    config: RunConfig, backend: Backend, run_dir: RunDir, lf_args: dict[str, Any], attempt: int = 1
) -> None:
    """Write the config copy, the exact job inputs and the manifest into the run folder.

    A resumed attempt writes its own ``*.attemptN.*`` files next to the first attempt's.
    """
    from launcher.config.run_config import dump_yaml

    path = run_dir.path
    if attempt == 1:
        if Path(config.source).resolve() != (path / CONFIG_COPY).resolve():  # a submitted run's copy is its source
            shutil.copyfile(config.source, path / CONFIG_COPY)
        if config.overrides:  # the command line's KEY=VALUE, applied on top of config.yaml (resume does too)
            write_text_atomic(path / OVERRIDES_FILE, dump_yaml(config.overrides))
    lf_yaml = attempt_name(LF_YAML, attempt)
    write_text_atomic(path / lf_yaml, dump_yaml(lf_args))
    if config.launcher.distribution == "fsdp2":
        write_text_atomic(path / ACCELERATE_YAML, dump_yaml(accelerate_config(config, backend)))
    launch = {
        "patches": config.patches,
        "backend": backend.name,
        "llamafactory_yaml": lf_yaml,
        "attempt": attempt,
        "log_examples": config.launcher.log_examples,
        "facts": run_facts(lf_args),
        "profile": config.launcher.profile.model_dump() if config.launcher.profile else None,
        "memory_history_steps": config.launcher.memory_history_steps,
    }
    write_text_atomic(path / LAUNCH_FILE, json.dumps(launch, indent=2) + "\n")
    info = manifest(config, backend, run_dir)
    write_text_atomic(path / attempt_name(MANIFEST_FILE, attempt), json.dumps(info, indent=2) + "\n")


def run_facts(lf_args: dict[str, Any]) -> dict[str, Any]:
    """What the patches may rely on, known before the run and the same on every rank (``launch.json``)."""
    from launcher.checks.data_check import dataset_media

    return {
        "cutoff_len": cutoff_len(lf_args),
        "dataset_media": dataset_media(lf_args),
        # LLaMA-Factory's FinetuningArguments freeze both by default; trained, they need the dummy image
        "vision_trainable": not lf_args.get("freeze_vision_tower", True)
        or not lf_args.get("freeze_multi_modal_projector", True),
        "packing": bool(lf_args.get("neat_packing")),
    }


def tuning_record(config: RunConfig, backend: Backend) -> dict[str, dict[str, str]]:
    """The environment levers of ``launcher.tuning`` the job gets, each with its source (config/tuning.py)."""
    from launcher.config.tuning import tuning_env

    return tuning_env(config.launcher.tuning, backend.name, config.launcher.output_root, os.environ)[1]


def manifest(config: RunConfig, backend: Backend, run_dir: RunDir) -> dict[str, Any]:
    lf = config.llamafactory
    return {
        "run_id": run_dir.run_id,
        "config": {
            "path": str(config.source.resolve()),
            "sha256": sha256_file(config.source),
            "overrides": config.overrides,
        },
        "smoke": config.launcher.smoke,
        "backend": backend.name,
        "distribution": config.launcher.distribution,
        "nproc_per_node": config.launcher.nproc_per_node,
        "patches": config.patches,
        "tuning": tuning_record(config, backend),
        "notes": config.notes,
        "packages": package_versions(),
        "git_commit": git_commit(),
        "container": container_identity(),
        "image": image_record(),
        "model": model_fingerprint(Path(str(lf.get("model_name_or_path", "")))),
        "data": data_fingerprint(lf),
    }


def image_record() -> dict[str, str | None]:
    """The image the run is in, as its Dockerfile and compose baked it in (all None outside an image)."""
    return {
        "tag": os.environ.get("LAUNCHER_IMAGE"),
        "digest": os.environ.get("LAUNCHER_IMAGE_DIGEST"),
        "base": os.environ.get("LAUNCHER_BASE_IMAGE"),
        # the npu-cann9 image: the sha256 its user pinned for the triton-ascend wheel no public index carries
        "triton_ascend_sha256": os.environ.get("LAUNCHER_TRITON_ASCEND_SHA256") or None,
    }


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in TRACKED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def git_commit() -> str | None:
    """The commit of the launcher's source tree; the image bakes it in as LAUNCHER_GIT_COMMIT."""
    if os.environ.get("LAUNCHER_GIT_COMMIT"):
        return os.environ["LAUNCHER_GIT_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def model_fingerprint(model_dir: Path) -> dict[str, Any]:
    """Hashes of the model's small files and the shard sizes; the weights themselves are not hashed."""
    if not model_dir.is_dir():
        return {"path": str(model_dir), "present": False}
    small = {
        p.name: sha256_file(p)
        for p in sorted(model_dir.iterdir())
        if p.is_file() and p.suffix == ".json" and p.stat().st_size < 50 << 20
    }
    shards = {p.name: p.stat().st_size for p in sorted(model_dir.glob("*.safetensors"))}
    return {"path": str(model_dir.resolve()), "json_sha256": small, "shard_bytes": shards}


def data_fingerprint(lf: dict[str, Any]) -> dict[str, Any]:
    """sha256 of each data file named by the config's datasets in ``dataset_info.json``."""
    dataset_dir = Path(str(lf.get("dataset_dir", "data")))
    info_path = dataset_dir / "dataset_info.json"
    names = [n.strip() for key in ("dataset", "eval_dataset") for n in str(lf.get(key) or "").split(",") if n.strip()]
    result: dict[str, Any] = {"dataset_dir": str(dataset_dir.resolve()), "files": {}}
    try:
        info = json.loads(info_path.read_text())
    except (OSError, json.JSONDecodeError):
        return result
    for name in names:
        file_name = info.get(name, {}).get("file_name")
        if file_name and (dataset_dir / file_name).is_file():
            result["files"][name] = {"file": file_name, "sha256": sha256_file(dataset_dir / file_name)}
    return result
